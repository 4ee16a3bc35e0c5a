"""Remote-code files copied into exported Hugging Face directories (self-contained: torch + transformers only)."""
