"""The fused loss head's GEMM modes (``train.loss_gemm``) against float64, and, on a GPU, their time and memory.

Precision (any device, CPU by default): bf16 hidden states and weight at the usual scales; the reference is
the float64 loss and gradients of the same bf16 values. Each head reports the loss's absolute error and the
relative (Frobenius) errors of grad_hidden and grad_weight:
  fused fp32         float32 operands (the previous default)
  fused mixed        bf16 operands, float32 accumulation and output (the default; on CPU through exact upcasts,
                     the numerics of CUDA's ``torch.mm(..., out_dtype=float32)``)
  fused input_dtype  bf16 logits upcast per chunk
  plain (HF)         ``F.cross_entropy(F.linear(h, w).float(), y)``: Hugging Face's head, whole logits
Timing and peak memory (CUDA only): one forward + backward of each head at the 350M head, after a warm-up,
``torch.cuda.max_memory_allocated`` above the inputs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_lite.model.loss import chunked_cross_entropy

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class HeadSettings:
    tokens: int = 2048
    hidden: int = 256
    vocab: int = 8192
    chunk_tokens: int = 512
    dtype: torch.dtype = torch.bfloat16
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("tokens", "hidden", "vocab", "chunk_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be >= 1")


@dataclass(frozen=True)
class HeadRow:
    head: str
    loss_abs_error: float | None = None
    grad_hidden_rel_error: float | None = None
    grad_weight_rel_error: float | None = None
    milliseconds: float | None = None
    peak_mib: float | None = None


def heads(chunk_tokens: int) -> dict[str, LossFn]:
    fused = {f"fused {gemm}": (lambda h, w, y, gemm=gemm: chunked_cross_entropy(h, w, y, chunk_tokens, gemm=gemm))
             for gemm in ("fp32", "mixed", "input_dtype")}
    return {**fused, "plain (HF)": lambda h, w, y: F.cross_entropy(F.linear(h, w).float(), y)}


def head_inputs(settings: HeadSettings, device: torch.device | str = "cpu"
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden (N, C) of unit scale (a LayerNorm's output) and weight (V, C) at std 0.05, in the settings' dtype,
    so logits reach |z| ~ 10 as a trained head's do; labels (N,)."""
    generator = torch.Generator().manual_seed(settings.seed)
    hidden_NC = torch.randn(settings.tokens, settings.hidden, generator=generator)
    weight_std = 0.05 * (1024 / settings.hidden) ** 0.5
    weight_VC = torch.randn(settings.vocab, settings.hidden, generator=generator) * weight_std
    labels_N = torch.randint(0, settings.vocab, (settings.tokens,), generator=generator)
    return hidden_NC.to(device, settings.dtype), weight_VC.to(device, settings.dtype), labels_N.to(device)


def _loss_and_grads(loss_fn: LossFn, hidden_NC: torch.Tensor, weight_VC: torch.Tensor, labels_N: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden, weight = hidden_NC.detach().requires_grad_(), weight_VC.detach().requires_grad_()
    loss = loss_fn(hidden, weight, labels_N)
    loss.backward()
    assert hidden.grad is not None and weight.grad is not None
    return loss.detach(), hidden.grad, weight.grad


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


def precision_rows(settings: HeadSettings = HeadSettings()) -> list[HeadRow]:
    """Every head's errors against the float64 loss and gradients of the same values (CPU)."""
    hidden_NC, weight_VC, labels_N = head_inputs(settings)
    reference = _loss_and_grads(lambda h, w, y: F.cross_entropy(h @ w.t(), y), hidden_NC.double(), weight_VC.double(),
                                labels_N)
    rows = []
    for name, loss_fn in heads(settings.chunk_tokens).items():
        loss, grad_hidden, grad_weight = _loss_and_grads(loss_fn, hidden_NC, weight_VC, labels_N)
        rows.append(HeadRow(name, abs(float(loss.double() - reference[0])), _relative(grad_hidden, reference[1]),
                            _relative(grad_weight, reference[2])))
    return rows


def cuda_rows(settings: HeadSettings, steps: int = 3) -> list[HeadRow]:
    """Every head's milliseconds per forward + backward and peak memory above its inputs, on the current GPU."""
    device = torch.device("cuda")
    hidden_NC, weight_VC, labels_N = head_inputs(settings, device)
    rows = []
    for name, loss_fn in heads(settings.chunk_tokens).items():
        _loss_and_grads(loss_fn, hidden_NC, weight_VC, labels_N)  # warm-up: cuBLAS handles and workspaces
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        for _ in range(steps):
            _loss_and_grads(loss_fn, hidden_NC, weight_VC, labels_N)
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / steps
        rows.append(HeadRow(name, milliseconds=seconds * 1e3,
                            peak_mib=(torch.cuda.max_memory_allocated() - base) / 2**20))
    return rows


def format_rows(rows: list[HeadRow], title: str) -> str:
    header = f"  {'head':<18} {'loss abs err':>12} {'grad_h rel':>10} {'grad_w rel':>10} {'ms':>8} {'peak MiB':>9}"
    lines = [title, header]
    for row in rows:
        cells = [f"{row.loss_abs_error:12.2e}" if row.loss_abs_error is not None else f"{'-':>12}",
                 f"{row.grad_hidden_rel_error:10.2e}" if row.grad_hidden_rel_error is not None else f"{'-':>10}",
                 f"{row.grad_weight_rel_error:10.2e}" if row.grad_weight_rel_error is not None else f"{'-':>10}",
                 f"{row.milliseconds:8.2f}" if row.milliseconds is not None else f"{'-':>8}",
                 f"{row.peak_mib:9.1f}" if row.peak_mib is not None else f"{'-':>9}"]
        lines.append(f"  {row.head:<18} " + " ".join(cells))
    return "\n".join(lines) + "\n"
