"""The LM head and its cross entropy, fused and chunked so the (N, V) float32 logits never exist at once.

At the 350M head (hidden 1024, vocabulary 50,048) a micro batch of 16 x 512 tokens has 1.6 GiB of
float32 logits, and the plain path keeps their log-softmax and gradient as well. ``chunked_cross_entropy``
computes the loss ``chunk_tokens`` tokens at a time and recomputes each chunk's logits in backward,
saving only the hidden states, the weight and the labels: peak memory is about one chunk's logits plus
the float32 weight gradient.

Dtypes (``gemm``, the three GEMMs per chunk: logits, grad_hidden, grad_weight; the softmax, the loss and
the weight-gradient sum are float32 in every mode, float64 for float64 inputs):

  mixed        (default) operands in the model's dtype, float32 accumulation and float32 output: bf16
               tensor cores with today's numerics for the logits, since the bf16 values multiplied exactly
               and summed in float32 lose nothing a float32-operand GEMM would keep. On CUDA this is
               ``torch.mm(..., out_dtype=torch.float32)`` (``aten::mm.dtype``); elsewhere (CPU has no such
               kernel) the same numerics come from upcasting the operands, exact for bf16/fp16 values. The
               backward's softmax gradient is rounded to the model's dtype before its two GEMMs (the operands
               must be bf16 for tensor cores), a ~2^-9 relative rounding per element that the float32 sums
               average out (docs/benchmarks.md has the measured errors against float64).
  input_dtype  operands and output in the model's dtype, logits upcast per chunk (Hugging Face, torchtune,
               Liger, Megatron): each logit rounded to 8 mantissa bits (~0.03 absolute at |logit| ~ 10).
  fp32         float32 operands (``h.float() @ w.float().T``): a float32 copy of the weight and float32
               GEMMs, off the tensor cores unless TF32 is on; the reference the other two are measured against.

float32 models run float32 GEMMs in every mode. grad_hidden is produced per chunk and cast to hidden's dtype;
grad_weight sums over every chunk in float32 and is cast to weight's dtype once. The backward works on half a
chunk at a time when it rounds the gradient, so its low-precision copy adds a quarter of a chunk's float32
logits, about what the fp32 mode's float32 weight copy took.

``LMHead`` is the model's output layer: its forward returns logits, or the loss when given labels.
The weight is read inside the head's own forward, so DeepSpeed ZeRO-3 (which gathers a module's
parameters only around that module's forward) gathers it for the fused path too.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_CHUNK_TOKENS = 4096
IGNORE_INDEX = -100
LossGemm = Literal["mixed", "input_dtype", "fp32"]
LOSS_GEMMS: tuple[str, ...] = ("mixed", "input_dtype", "fp32")


def _compute_dtype(hidden_NC: torch.Tensor, weight_VC: torch.Tensor) -> torch.dtype:
    """float32, or float64 when an input is float64: the softmax's, the loss's and the sums' dtype."""
    return torch.promote_types(torch.promote_types(hidden_NC.dtype, weight_VC.dtype), torch.float32)


def native_float32_output(device: torch.device) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=torch.float32)`` runs natively on ``device`` (CUDA; torch >= 2.8)."""
    return device.type == "cuda" and hasattr(torch.ops.aten.mm, "dtype")


class _HeadGemms:
    """The head's GEMMs in one ``gemm`` mode for one (hidden, weight) pair: who rounds what, in one place."""

    def __init__(self, gemm: str, hidden_NC: torch.Tensor, weight_VC: torch.Tensor) -> None:
        self.gemm = gemm
        self.compute_dtype = _compute_dtype(hidden_NC, weight_VC)
        narrow = gemm != "fp32" and hidden_NC.dtype == weight_VC.dtype and hidden_NC.dtype.itemsize < 4
        # operands are rounded to this (the model's bf16/fp16, or nothing) ...
        self.rounding_dtype = hidden_NC.dtype if narrow else self.compute_dtype
        # ... and multiplied in this: the narrow dtype on tensor cores, or the compute dtype where mixed has no
        # native kernel (the upcast of a bf16/fp16 value is exact: the CUDA op's numerics)
        native = gemm == "input_dtype" or native_float32_output(hidden_NC.device)
        self.operand_dtype = self.rounding_dtype if narrow and native else self.compute_dtype
        self.weight_VC = self.operand(weight_VC)  # a copy only where operands are upcast

    @property
    def rounds_gradient(self) -> bool:
        """The backward rounds the float32 softmax gradient to the model's dtype before its GEMMs."""
        return self.rounding_dtype != self.compute_dtype

    def operand(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.rounding_dtype).to(self.operand_dtype)

    def matmul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """a @ b in the compute dtype from operands in the operand dtype."""
        if self.operand_dtype == self.compute_dtype:
            return a @ b
        if self.gemm == "input_dtype":
            return (a @ b).to(self.compute_dtype)  # low-precision output, upcast (Hugging Face's head)
        return torch.mm(a, b, out_dtype=self.compute_dtype)

    def add_matmul(self, total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """total + a @ b, total in the compute dtype (the weight gradient's running sum)."""
        if self.operand_dtype == self.compute_dtype:
            return total.addmm_(a, b)  # in place: no (V, C) temporary
        # mm + add, not addmm(out_dtype=...): torch 2.11's fake-tensor pass fails on addmm.dtype under compile
        return total.add_(self.matmul(a, b))


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
                chunk_tokens: int, ignore_index: int, gemm: str) -> torch.Tensor:
        gemms = _HeadGemms(gemm, hidden_NC, weight_VC)
        weight_CV = gemms.weight_VC.t()
        valid_N = labels_N != ignore_index
        safe_labels_N = labels_N.masked_fill(~valid_N, 0)  # ignored rows gather a real column, then drop out
        total = hidden_NC.new_zeros((), dtype=gemms.compute_dtype)
        logsumexp_N = hidden_NC.new_empty(hidden_NC.shape[:1], dtype=gemms.compute_dtype)  # kept for backward
        for start, end in _chunk_bounds(hidden_NC.shape[0], chunk_tokens):
            logits_nV = gemms.matmul(gemms.operand(hidden_NC[start:end]), weight_CV)  # (n, V) compute dtype
            target_n = logits_nV.gather(1, safe_labels_N[start:end, None]).squeeze(1)
            max_n1 = _exp_shifted_(logits_nV)
            logsumexp_n = logits_nV.sum(dim=1).log_() + max_n1.squeeze(1)
            logsumexp_N[start:end] = logsumexp_n
            total = total + torch.where(valid_N[start:end], logsumexp_n - target_n, 0).sum()
            del logits_nV  # free this chunk before the next one's matmul allocates
        ctx.save_for_backward(hidden_NC, weight_VC, labels_N, logsumexp_N)
        ctx.chunk_tokens, ctx.ignore_index, ctx.gemm = chunk_tokens, ignore_index, gemm
        # count stays a tensor (no host sync); all ignored gives 0/0 = nan, as F.cross_entropy does
        return total / valid_N.sum()

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden_NC, weight_VC, labels_N, logsumexp_N = ctx.saved_tensors
        gemms = _HeadGemms(ctx.gemm, hidden_NC, weight_VC)
        dtype, weight_op_VC = gemms.compute_dtype, gemms.weight_VC
        valid_N = labels_N != ctx.ignore_index
        safe_labels_N = labels_N.masked_fill(~valid_N, 0)
        # d loss / d (per-token NLL) = sign * scale: |grad| / count on kept rows, exactly 0 on ignored ones (also
        # when the count is 0, where F.cross_entropy's gradient is 0 too, not nan). The scale goes into the
        # exponent, scale * softmax = exp(logits - (logsumexp - log scale)), so the (n, V) chunk takes two
        # elementwise passes (shift, exp) instead of six (max, shift, exp, sum, divide, scale); log 0 = -inf
        # zeroes ignored rows. The sign (a loss multiplied by -1) is applied to the GEMMs' small outputs.
        grad_loss = grad_loss.to(dtype)
        scale_N = torch.where(valid_N, grad_loss.abs() / valid_N.sum(), 0)
        shift_N1 = (logsumexp_N - scale_N.log())[:, None]
        sign = grad_loss.sign()
        grad_hidden_NC = torch.empty_like(hidden_NC)
        grad_weight_VC = torch.zeros(weight_VC.shape, dtype=dtype, device=weight_VC.device)
        for start, end in _chunk_bounds(hidden_NC.shape[0], ctx.chunk_tokens):
            hidden_op_nC = gemms.operand(hidden_NC[start:end])
            # scale * (d NLL / d logits) = scale * (softmax - one_hot), built in place on the recomputed logits
            grad_nV = gemms.matmul(hidden_op_nC, weight_op_VC.t())
            grad_nV.sub_(shift_N1[start:end]).exp_()
            grad_nV.scatter_add_(1, safe_labels_N[start:end, None], -scale_N[start:end, None])
            # rounded to the operand dtype half a chunk at a time: a quarter chunk of extra memory, not half
            step = max(1, (end - start + 1) // 2) if gemms.rounds_gradient else end - start
            for sub in range(0, end - start, step):
                rows = slice(sub, min(sub + step, end - start))
                grad_op_mV = gemms.operand(grad_nV[rows])
                grad_hidden_mC = gemms.matmul(grad_op_mV, weight_op_VC) * sign
                grad_hidden_NC[start + rows.start:start + rows.stop] = grad_hidden_mC.to(hidden_NC.dtype)
                grad_weight_VC = gemms.add_matmul(grad_weight_VC, grad_op_mV.t(), hidden_op_nC[rows])
                del grad_op_mV
            del grad_nV  # free this chunk before the next one's matmul allocates
        return grad_hidden_NC, grad_weight_VC.mul_(sign).to(weight_VC.dtype), None, None, None, None


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
                          chunk_tokens: int = DEFAULT_CHUNK_TOKENS, ignore_index: int = IGNORE_INDEX,
                          gemm: LossGemm = "mixed") -> torch.Tensor:
    """Mean cross entropy of ``hidden_NC @ weight_VC.T`` against ``labels_N`` (already aligned), without
    ``ignore_index`` labels in sum or count, as ``F.cross_entropy``; float32 (float64 for float64 inputs).
    The (N, V) logits are never whole: ``chunk_tokens`` rows at a time, recomputed in backward. ``gemm``:
    the GEMMs' operand and output dtypes (module docstring)."""
    _check_inputs(hidden_NC, weight_VC, labels_N, chunk_tokens)
    if gemm not in LOSS_GEMMS:
        raise ValueError(f"loss gemm {gemm!r}: must be one of {', '.join(LOSS_GEMMS)}")
    return _ChunkedCrossEntropy.apply(hidden_NC, weight_VC, labels_N, chunk_tokens, ignore_index, gemm)


class LMHead(nn.Linear):
    """The output layer (no bias; ``weight`` may be assigned a parameter shared with the embedding):
    logits, or with labels the mean loss. ``fused``, ``chunk_tokens`` and ``gemm`` are the defaults of ``forward``
    (the training loop sets ``fused`` from ``train.fused_loss`` and ``gemm`` from ``train.loss_gemm``)."""

    def __init__(self, hidden_size: int, vocab_size: int, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(hidden_size, vocab_size, bias=False, device=device, dtype=dtype)
        self.fused = True
        self.chunk_tokens = DEFAULT_CHUNK_TOKENS
        self.gemm: LossGemm = "mixed"

    def forward(self, x_BTC: torch.Tensor, labels_BT: torch.Tensor | None = None, *,  # type: ignore[override]
                fused: bool | None = None, chunk_tokens: int | None = None,
                ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
        """Logits (B, T, V) without labels; with labels (B, T), already shifted, the scalar mean loss."""
        if labels_BT is None:
            return F.linear(x_BTC, self.weight)  # (B, T, V)
        hidden_NC, labels_N = x_BTC.reshape(-1, x_BTC.shape[-1]), labels_BT.reshape(-1)
        if self.fused if fused is None else fused:
            chunk = self.chunk_tokens if chunk_tokens is None else chunk_tokens
            return chunked_cross_entropy(hidden_NC, self.weight, labels_N, chunk, ignore_index, self.gemm)
        return F.cross_entropy(F.linear(hidden_NC, self.weight).float(), labels_N, ignore_index=ignore_index)
