"""Evaluation: generation with the KV cache (long-context perplexity and passkey land later)."""
