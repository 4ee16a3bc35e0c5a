"""Peak memory of the LM loss forward+backward: the fused, chunked head (``chunked_cross_entropy``) vs
the plain one (``F.cross_entropy(F.linear(h, w).float(), labels)``: the whole (N, V) logits, their
log-softmax and their gradient), in one run, at the 350M head by default.

Memory is counted with ``track_peak_memory`` (live tensors allocated inside the region, so it works on
CPU): the hidden states, the weight and the labels exist before the region and are not counted; the
gradients (grad_hidden N x C, grad_weight V x C) are. Wall time is of a separate, untracked step after
an untimed warm-up step (the tracker's dispatch overhead must not be timed); it is informational. MiB = 2**20 bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatron_lite.bench.memory import track_peak_memory
from megatron_lite.model.loss import chunked_cross_entropy

MIB = 2**20
TARGET_RATIO = 0.25  # fused peak <= 25% of plain peak

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LossMemorySettings:
    hidden: int = 1024
    vocab: int = 50_048
    tokens: int = 8 * 512
    chunk_tokens: int = 1024
    seed: int = 0

    def validate(self) -> None:
        for name in ("hidden", "vocab", "tokens", "chunk_tokens"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"--{name.replace('_', '-')} {value}: must be >= 1")


@dataclass(frozen=True)
class LossMemoryResult:
    settings: LossMemorySettings
    plain_peak_mib: float
    fused_peak_mib: float
    plain_seconds: float
    fused_seconds: float

    @property
    def ratio(self) -> float:
        """fused peak / plain peak."""
        return self.fused_peak_mib / self.plain_peak_mib

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": self.ratio, "target_ratio": TARGET_RATIO}


def _inputs(settings: LossMemorySettings) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 leaf hidden (N, C) and weight (V, C) at the usual init scale, random labels (N,)."""
    generator = torch.Generator().manual_seed(settings.seed)
    hidden_NC = torch.randn(settings.tokens, settings.hidden, generator=generator).requires_grad_()
    weight_VC = (torch.randn(settings.vocab, settings.hidden, generator=generator) * 0.02).requires_grad_()
    labels_N = torch.randint(0, settings.vocab, (settings.tokens,), generator=generator)
    return hidden_NC, weight_VC, labels_N


def _step(loss_fn: LossFn, hidden_NC: torch.Tensor, weight_VC: torch.Tensor, labels_N: torch.Tensor) -> None:
    hidden_NC.grad = weight_VC.grad = None  # gradients allocated inside the region count
    loss_fn(hidden_NC, weight_VC, labels_N).backward()


def peak_mib(loss_fn: LossFn, hidden_NC: torch.Tensor, weight_VC: torch.Tensor, labels_N: torch.Tensor) -> float:
    with track_peak_memory() as tracker:
        _step(loss_fn, hidden_NC, weight_VC, labels_N)
    hidden_NC.grad = weight_VC.grad = None
    return tracker.peak_bytes / MIB


def wall_seconds(loss_fn: LossFn, hidden_NC: torch.Tensor, weight_VC: torch.Tensor, labels_N: torch.Tensor) -> float:
    # the first step at a size pays one-off costs (fresh pages from the OS for its buffers): untimed
    _step(loss_fn, hidden_NC, weight_VC, labels_N)
    started = time.perf_counter()
    _step(loss_fn, hidden_NC, weight_VC, labels_N)
    elapsed = time.perf_counter() - started
    hidden_NC.grad = weight_VC.grad = None
    return elapsed


def plain_loss(hidden_NC: torch.Tensor, weight_VC: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden_NC, weight_VC).float(), labels_N)


def run(settings: LossMemorySettings) -> LossMemoryResult:
    settings.validate()
    hidden_NC, weight_VC, labels_N = _inputs(settings)

    def fused(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return chunked_cross_entropy(h, w, y, settings.chunk_tokens)

    return LossMemoryResult(settings,
                            plain_peak_mib=peak_mib(plain_loss, hidden_NC, weight_VC, labels_N),
                            fused_peak_mib=peak_mib(fused, hidden_NC, weight_VC, labels_N),
                            plain_seconds=wall_seconds(plain_loss, hidden_NC, weight_VC, labels_N),
                            fused_seconds=wall_seconds(fused, hidden_NC, weight_VC, labels_N))


def format_report(result: LossMemoryResult) -> str:
    s = result.settings
    verdict = "met" if result.ratio <= TARGET_RATIO else "MISSED"
    return (f"LM loss forward+backward on {torch.device('cpu')}, float32: hidden {s.hidden}, vocabulary {s.vocab:,}, "
            f"{s.tokens:,} tokens; fused chunk {s.chunk_tokens:,} tokens\n"
            f"  plain  peak {result.plain_peak_mib:9.1f} MiB   time {result.plain_seconds:6.2f} s\n"
            f"  fused  peak {result.fused_peak_mib:9.1f} MiB   time {result.fused_seconds:6.2f} s\n"
            f"  fused / plain peak: {result.ratio:.3f} (target <= {TARGET_RATIO}: {verdict})\n")
