"""Greedy and sampled generation with the KV cache.

The cache is sized for the whole generation and its max_length doubles as the length that fixes
the dynamic-NTK base, so cached keys and new queries always share one base (HF issue #25104).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_lite.model.gpt import GPT


def sample_next_token(logits_BV: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                      top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, V) logits -> (B,) token ids. temperature 0 means greedy."""
    if temperature < 0:
        raise ValueError(f"temperature={temperature}: must be >= 0")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k}: must be >= 1")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p}: must be in (0, 1]")
    if temperature == 0:
        return logits_BV.argmax(dim=-1)
    logits = logits_BV.float() / temperature
    if top_k is not None:
        kth_largest = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p is not None:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) > top_p  # keep the token crossing top_p
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: GPT, prompt_ids_BT: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, eos_token_id: int | None = None,
             generator: torch.Generator | None = None, vocab_limit: int | None = None) -> torch.Tensor:
    """Prompt + up to max_new_tokens ids (B, T + new); rows that emit eos keep emitting eos.

    ``vocab_limit``: only ids below it are generated — the tokenizer's vocabulary, since the model's is
    padded (make_vocab_size_divisible_by) and an undertrained model may rank a padding id first.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 0")
    was_training = model.training
    model.eval()
    try:
        cache = model.new_cache(prompt_ids_BT.shape[1] + max_new_tokens)
        tokens = [prompt_ids_BT]
        finished = torch.zeros(prompt_ids_BT.shape[0], dtype=torch.bool, device=prompt_ids_BT.device)
        next_input = prompt_ids_BT
        for _ in range(max_new_tokens):
            logits_BV = model(next_input, cache=cache, logits_from=next_input.shape[1] - 1)  # (B, T', V)
            logits_BV = logits_BV[:, -1, :vocab_limit]  # (B, V) or (B, vocab_limit)
            next_token = sample_next_token(logits_BV, temperature, top_k, top_p, generator)
            if eos_token_id is not None:
                next_token = next_token.masked_fill(finished, eos_token_id)
                finished |= next_token == eos_token_id
            next_input = next_token[:, None]
            tokens.append(next_input)
            if eos_token_id is not None and bool(finished.all()):
                break
    finally:
        model.train(was_training)  # the caller's mode, also when generation raises
    return torch.cat(tokens, dim=1)


def generate_text(model: GPT, tokenizer: Any, prompt: str, max_new_tokens: int, temperature: float = 0.0,
                  top_k: int | None = None, top_p: float | None = None, num_samples: int = 1,
                  seed: int | None = None) -> list[str]:
    """Continuations of ``prompt`` (text only, prompt excluded), ending at the tokenizer's EOD.

    ``tokenizer`` is a megatron_lite.data.tokenizer.AnyTokenizer (encode_prompt/decode/eod_id/prefix_ids).
    A prompt starts a document as the training data did (a Hugging Face tokenizer's BOS, if it adds one,
    then the text); an empty prompt starts from EOD, the separator every training document follows.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples={num_samples}: must be >= 1")
    device = next(model.parameters()).device
    prompt_ids = tokenizer.encode_prompt(prompt) if prompt else [tokenizer.eod_id, *tokenizer.prefix_ids]
    ids_BT = torch.tensor([prompt_ids] * num_samples, dtype=torch.long, device=device)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
    out_BT = generate(model, ids_BT, max_new_tokens, temperature, top_k, top_p, tokenizer.eod_id, generator,
                      vocab_limit=getattr(tokenizer, "vocab_size", None))
    texts = []
    for row in out_BT[:, len(prompt_ids) :].tolist():
        if tokenizer.eod_id in row:
            row = row[: row.index(tokenizer.eod_id)]
        texts.append(tokenizer.decode(row))
    return texts
