"""The LM head and its cross entropy, fused and chunked so the (N, V) float32 logits never exist at once.

At the 350M head (hidden 1024, vocabulary 50,048) a micro batch of 16 x 512 tokens has 1.6 GiB of
float32 logits, and the plain path keeps their log-softmax and gradient as well. ``chunked_cross_entropy``
computes the loss ``chunk_tokens`` tokens at a time and recomputes each chunk's logits in backward,
saving only the hidden states, the weight and the labels: peak memory is about one chunk's logits plus
the float32 weight gradient.

Dtypes: logits are computed in float32 from upcast operands (``h.float() @ w.float().T``), not as an
input-dtype matmul cast afterwards: a bf16 matmul rounds every logit to 8 mantissa bits (~0.03 absolute
at |logit| ~ 10), an error the loss and the softmax gradient inherit, while the bf16 values multiplied
exactly in float32 lose nothing. Its cost is a float32 copy of a bf16 weight (V x C, a fraction of one
chunk's logits; none for float32 inputs) and float32 instead of bf16 GEMMs. float64 inputs stay float64.
grad_hidden is produced per chunk and cast to hidden's dtype; grad_weight sums over every chunk, so it
accumulates in float32 and is cast to weight's dtype once.

``LMHead`` is the model's output layer: its forward returns logits, or the loss when given labels.
The weight is read inside the head's own forward, so DeepSpeed ZeRO-3 (which gathers a module's
parameters only around that module's forward) gathers it for the fused path too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_CHUNK_TOKENS = 4096
IGNORE_INDEX = -100


def _compute_dtype(hidden_NC: torch.Tensor, weight_VC: torch.Tensor) -> torch.dtype:
    """float32, or float64 when an input is float64."""
    return torch.promote_types(torch.promote_types(hidden_NC.dtype, weight_VC.dtype), torch.float32)


def _chunk_bounds(num_tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """Static (start, end) per chunk: a Python loop torch.compile unrolls."""
    return [(start, min(start + chunk_tokens, num_tokens)) for start in range(0, num_tokens, chunk_tokens)]


def _exp_shifted_(logits_nV: torch.Tensor) -> torch.Tensor:
    """In place: logits -> exp(logits - rowmax), so a chunk needs one (n, V) buffer; returns rowmax (n, 1)."""
    max_n1 = logits_nV.amax(dim=1, keepdim=True)
    logits_nV.sub_(max_n1).exp_()
    return max_n1


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross entropy of hidden @ weight^T over the non-ignored labels, chunk by chunk."""

    @staticmethod
    def forward(ctx: Any, hidden_NC: torch.Tensor, weight_VC: torch.Tensor, labels_N: torch.Tensor,
                chunk_tokens: int, ignore_index: int) -> torch.Tensor:
        dtype = _compute_dtype(hidden_NC, weight_VC)
        weight_cVC = weight_VC.to(dtype)  # no copy for float32 weights
        valid_N = labels_N != ignore_index
        safe_labels_N = labels_N.masked_fill(~valid_N, 0)  # ignored rows gather a real column, then drop out
        total = hidden_NC.new_zeros((), dtype=dtype)
        for start, end in _chunk_bounds(hidden_NC.shape[0], chunk_tokens):
            logits_nV = hidden_NC[start:end].to(dtype) @ weight_cVC.t()
            target_n = logits_nV.gather(1, safe_labels_N[start:end, None]).squeeze(1)
            max_n1 = _exp_shifted_(logits_nV)
            logsumexp_n = logits_nV.sum(dim=1).log_() + max_n1.squeeze(1)
            total = total + torch.where(valid_N[start:end], logsumexp_n - target_n, 0).sum()
            del logits_nV  # free this chunk before the next one's matmul allocates
        ctx.save_for_backward(hidden_NC, weight_VC, labels_N)
        ctx.chunk_tokens, ctx.ignore_index = chunk_tokens, ignore_index
        # count stays a tensor (no host sync); all ignored gives 0/0 = nan, as F.cross_entropy does
        return total / valid_N.sum()

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden_NC, weight_VC, labels_N = ctx.saved_tensors
        dtype = _compute_dtype(hidden_NC, weight_VC)
        weight_cVC = weight_VC.to(dtype)
        valid_N = labels_N != ctx.ignore_index
        safe_labels_N = labels_N.masked_fill(~valid_N, 0)
        # d loss / d (per-token NLL): grad / count on kept rows, exactly 0 on ignored ones (also when the
        # count is 0, where F.cross_entropy's gradient is 0 too, not nan)
        scale_N = torch.where(valid_N, grad_loss.to(dtype) / valid_N.sum(), 0)
        grad_hidden_NC = torch.empty_like(hidden_NC)
        grad_weight_cVC = torch.zeros_like(weight_cVC)
        for start, end in _chunk_bounds(hidden_NC.shape[0], ctx.chunk_tokens):
            hidden_cnC = hidden_NC[start:end].to(dtype)
            # d NLL / d logits = softmax - one_hot, built in place on the recomputed logits
            grad_nV = hidden_cnC @ weight_cVC.t()
            _exp_shifted_(grad_nV)
            grad_nV.div_(grad_nV.sum(dim=1, keepdim=True))
            grad_nV.scatter_add_(1, safe_labels_N[start:end, None], grad_nV.new_full((end - start, 1), -1.0))
            grad_nV.mul_(scale_N[start:end, None])
            grad_hidden_NC[start:end] = (grad_nV @ weight_cVC).to(hidden_NC.dtype)
            grad_weight_cVC.addmm_(grad_nV.t(), hidden_cnC)
            del grad_nV  # free this chunk before the next one's matmul allocates
        return grad_hidden_NC, grad_weight_cVC.to(weight_VC.dtype), None, None, None


def _check_inputs(hidden_NC: torch.Tensor, weight_VC: torch.Tensor, labels_N: torch.Tensor, chunk_tokens: int) -> None:
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens!r}: must be an int >= 1")
    if hidden_NC.dim() != 2 or weight_VC.dim() != 2 or hidden_NC.shape[1] != weight_VC.shape[1]:
        raise ValueError(f"hidden {tuple(hidden_NC.shape)} and weight {tuple(weight_VC.shape)}: "
                         "need (N, C) and (V, C)")
    if labels_N.shape != hidden_NC.shape[:1]:
        raise ValueError(f"labels {tuple(labels_N.shape)}: need ({hidden_NC.shape[0]},) for hidden "
                         f"{tuple(hidden_NC.shape)}")


def chunked_cross_entropy(hidden_NC: torch.Tensor, weight_VC: torch.Tensor, labels_N: torch.Tensor,
                          chunk_tokens: int = DEFAULT_CHUNK_TOKENS, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean cross entropy of ``hidden_NC @ weight_VC.T`` against ``labels_N`` (already aligned), without
    ``ignore_index`` labels in sum or count, as ``F.cross_entropy``; float32 (float64 for float64 inputs).
    The (N, V) logits are never whole: ``chunk_tokens`` rows at a time, recomputed in backward."""
    _check_inputs(hidden_NC, weight_VC, labels_N, chunk_tokens)
    return _ChunkedCrossEntropy.apply(hidden_NC, weight_VC, labels_N, chunk_tokens, ignore_index)


class LMHead(nn.Linear):
    """The output layer (no bias; ``weight`` may be assigned a parameter shared with the embedding):
    logits, or with labels the mean loss. ``fused`` and ``chunk_tokens`` are the defaults of ``forward``
    (the training loop sets ``fused`` from ``train.fused_loss``)."""

    def __init__(self, hidden_size: int, vocab_size: int, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(hidden_size, vocab_size, bias=False, device=device, dtype=dtype)
        self.fused = True
        self.chunk_tokens = DEFAULT_CHUNK_TOKENS

    def forward(self, x_BTC: torch.Tensor, labels_BT: torch.Tensor | None = None, *,  # type: ignore[override]
                fused: bool | None = None, chunk_tokens: int | None = None,
                ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
        """Logits (B, T, V) without labels; with labels (B, T), already shifted, the scalar mean loss."""
        if labels_BT is None:
            return F.linear(x_BTC, self.weight)  # (B, T, V)
        hidden_NC, labels_N = x_BTC.reshape(-1, x_BTC.shape[-1]), labels_BT.reshape(-1)
        if self.fused if fused is None else fused:
            chunk = self.chunk_tokens if chunk_tokens is None else chunk_tokens
            return chunked_cross_entropy(hidden_NC, self.weight, labels_N, chunk, ignore_index)
        return F.cross_entropy(F.linear(hidden_NC, self.weight).float(), labels_N, ignore_index=ignore_index)
