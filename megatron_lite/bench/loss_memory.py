"""Peak memory of the LM loss forward+backward: the fused, chunked head (megatron_lite/model/loss.py) vs
the plain one (the whole (N, V) logits upcast to float32, and their gradient), in one run.

Counted with ``track_peak_memory`` (live tensors allocated inside the region), so it works on CPU;
the hidden states and the weight exist before the region and are not counted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_lite.bench.memory import track_peak_memory
from megatron_lite.model.loss import chunked_cross_entropy

MB = 2**20


@dataclass
class LossMemoryResult:
    hidden: int
    vocab: int
    tokens: int
    chunk_tokens: int
    plain_peak_mb: float
    fused_peak_mb: float
    plain_seconds: float
    fused_seconds: float

    @property
    def ratio(self) -> float:
        return self.fused_peak_mb / self.plain_peak_mb


def _measure(loss_fn, hidden_NC: torch.Tensor, weight_VC: torch.Tensor, labels_N: torch.Tensor) -> tuple[float, float]:
    hidden_NC.grad = weight_VC.grad = None
    started = time.perf_counter()
    with track_peak_memory() as tracker:
        loss_fn(hidden_NC, weight_VC, labels_N).backward()
    return tracker.peak_bytes / MB, time.perf_counter() - started


def run(hidden: int = 1024, vocab: int = 50_048, tokens: int = 8 * 512,
        chunk_tokens: int = 512) -> LossMemoryResult:
    for name, value in (("hidden", hidden), ("vocab", vocab), ("tokens", tokens), ("chunk_tokens", chunk_tokens)):
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} {value}: must be >= 1")
    generator = torch.Generator().manual_seed(0)
    hidden_NC = torch.randn(tokens, hidden, generator=generator).requires_grad_()
    weight_VC = (torch.randn(vocab, hidden, generator=generator) * 0.02).requires_grad_()
    labels_N = torch.randint(0, vocab, (tokens,), generator=generator)
    plain = _measure(lambda h, w, y: F.cross_entropy(F.linear(h, w).float(), y), hidden_NC, weight_VC, labels_N)
    fused = _measure(lambda h, w, y: chunked_cross_entropy(h, w, y, chunk_tokens), hidden_NC, weight_VC, labels_N)
    return LossMemoryResult(hidden, vocab, tokens, chunk_tokens, plain[0], fused[0], plain[1], fused[1])


def format_report(result: LossMemoryResult) -> str:
    return (f"LM loss forward+backward, hidden {result.hidden}, vocabulary {result.vocab:,}, {result.tokens:,} tokens "
            f"(fused chunk {result.chunk_tokens} tokens)\n"
            f"  plain  peak {result.plain_peak_mb:8.1f} MiB  ({result.plain_seconds:.2f} s, tracked)\n"
            f"  fused  peak {result.fused_peak_mb:8.1f} MiB  ({result.fused_seconds:.2f} s, tracked)\n"
            f"  fused / plain peak: {result.ratio:.3f} (target <= 0.25)\n")
