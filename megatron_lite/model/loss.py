"""The LM head and its cross entropy, fused and chunked so the (N, V) float32 logits never exist at once.

At the 350M head (hidden 1024, vocabulary 50,048) a micro batch of 16 x 512 tokens has 1.6 GiB of
float32 logits, and the plain path keeps their log-softmax and gradient as well. ``chunked_cross_entropy``
computes the loss ``chunk_tokens`` tokens at a time and, where gradients are wanted, both gradients in the
same pass over each chunk (for a loss gradient of 1; the backward scales them by the real one), as Liger's
fused linear cross entropy does: each chunk's logits are made once, three GEMMs per chunk instead of four
with a recompute, and the forward keeps only the two float32 gradients. Peak memory is about one chunk's
logits plus the float32 weight gradient; the float32 gradients live from the head's forward to its backward.

Dtypes (``gemm``, the three GEMMs per chunk: logits, grad_hidden, grad_weight; the softmax, the loss and
the gradients' sums are float32 in every mode, float64 for float64 inputs):

  mixed        (default) operands in the model's dtype, float32 accumulation and float32 output: bf16
               tensor cores with today's numerics for the logits, since the bf16 values multiplied exactly
               and summed in float32 lose nothing a float32-operand GEMM would keep. On CUDA this is
               ``torch.mm(..., out_dtype=torch.float32)`` (``aten::mm.dtype``); elsewhere (CPU has no such
               kernel) the same numerics come from upcasting the operands, exact for bf16/fp16 values. The
               softmax gradient is rounded to the model's dtype before its two GEMMs (the operands
               must be bf16 for tensor cores), a ~2^-9 relative rounding per element that the float32 sums
               average out (docs/benchmarks.md has the measured errors against float64).
  input_dtype  operands and output in the model's dtype, logits upcast per chunk (Hugging Face, torchtune,
               Liger, Megatron): each logit rounded to 8 mantissa bits (~0.03 absolute at |logit| ~ 10).
  fp32         float32 operands (``h.float() @ w.float().T``): a float32 copy of the weight and float32
               GEMMs, off the tensor cores unless TF32 is on; the reference the other two are measured against.

float32 models run float32 GEMMs in every mode. grad_hidden is produced per chunk, grad_weight sums over every
chunk, both in float32, scaled by the loss's gradient and cast to their inputs' dtypes once, in backward. Run
eagerly, each chunk is worked on in place in its one float32 buffer and the gradient rounded half a chunk at a
time, so its low-precision copy adds a quarter of a chunk's float32 logits, about what the fp32 mode's float32
weight copy took. Traced by torch.compile (regional or whole), the chunk is written functionally instead, for
inductor to fuse: a log-sum-exp reduction and one kernel writing the whole chunk's rounded gradient (half a chunk
more, one GEMM per gradient per chunk); in-place passes would be functionalised into a second float32 buffer.
Inductor also sums grad_weight's per-chunk products in one kernel after the last chunk (less traffic than a
running sum), so the compiled head holds chunks - 1 float32 (V, C) products at its peak where the eager one holds
one sum: 1.43 GB at 8 chunks of the 350M config's 50,048 x 1,024 (CUDA lowering, docs/performance.md).
Under ``torch.no_grad`` (evaluation), or for an input that does not require grad, that gradient is not computed.

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

    def scaled_operand_(self, x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
        """``operand(x * factor)`` in one pass over ``x`` (compute dtype; scaled in place where it is not
        rounded): the product is rounded as it is stored, not written in float32 and then cast."""
        if not self.rounds_gradient:
            return x.mul_(factor)
        rounded = torch.empty(x.shape, dtype=self.rounding_dtype, device=x.device)
        return torch.mul(x, factor, out=rounded).to(self.operand_dtype)

    def logits(self, hidden_op_nC: torch.Tensor, weight_op_VC: torch.Tensor) -> torch.Tensor:
        """hidden @ weight^T, (n, V) in the compute dtype; ``matmul`` serves the two gradient GEMMs."""
        return self.matmul(hidden_op_nC, weight_op_VC.t())

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


# gemm modes beyond LOSS_GEMMS, registered by the modules that define them (model/float8.py: "float8")
HEAD_GEMMS: dict[str, type[_HeadGemms]] = {}


class _WeightGradientSum:
    """grad_weight's running sum over the chunks in the compute dtype: the first product itself, each later one
    added in place, so no zeroed (V, C) buffer is written and read again to add the first product to."""

    def __init__(self, gemms: _HeadGemms) -> None:
        self.gemms = gemms
        self.total_VC: torch.Tensor | None = None

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """total += a @ b."""
        self.total_VC = (self.gemms.matmul(a, b) if self.total_VC is None
                         else self.gemms.add_matmul(self.total_VC, a, b))

    def result(self, like_VC: torch.Tensor) -> torch.Tensor:
        """The sum; zeros shaped as ``like_VC`` where no chunk was added (no tokens)."""
        if self.total_VC is None:
            return torch.zeros(like_VC.shape, dtype=self.gemms.compute_dtype, device=like_VC.device)
        return self.total_VC


def _chunk_bounds(num_tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """Static (start, end) per chunk: a Python loop torch.compile unrolls."""
    return [(start, min(start + chunk_tokens, num_tokens)) for start in range(0, num_tokens, chunk_tokens)]


def _exp_shifted_(logits_nV: torch.Tensor) -> torch.Tensor:
    """In place: logits -> exp(logits - rowmax), so a chunk needs one (n, V) buffer; returns rowmax (n, 1)."""
    max_n1 = logits_nV.amax(dim=1, keepdim=True)
    logits_nV.sub_(max_n1).exp_()
    return max_n1


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross entropy of hidden @ weight^T over the non-ignored labels, chunk by chunk. Where gradients are
    wanted, the forward computes them too, for a loss gradient of 1, while each chunk's logits are at hand (as
    Liger's fused linear cross entropy does): the logits are made once, not recomputed in backward, and the
    backward only scales the two saved gradients by the loss's gradient."""

    @staticmethod
    def forward(ctx: Any, hidden_NC: torch.Tensor, weight_VC: torch.Tensor, labels_N: torch.Tensor,
                chunk_tokens: int, ignore_index: int, gemm: str, grad_hidden_wanted: bool,
                grad_weight_wanted: bool) -> torch.Tensor:
        gemms = HEAD_GEMMS.get(gemm, _HeadGemms)(gemm, hidden_NC, weight_VC)
        dtype, weight_op_VC = gemms.compute_dtype, gemms.weight_VC
        valid_N = labels_N != ignore_index
        safe_labels_N = labels_N.masked_fill(~valid_N, 0)  # ignored rows gather a real column, then drop out
        count = valid_N.sum()  # stays a tensor: no host sync
        # d loss / d (per-token NLL): 1 / count on kept rows, exactly 0 on ignored ones (also when the count is 0,
        # where F.cross_entropy's gradient is 0 too, not nan)
        scale_N = torch.where(valid_N, count.to(dtype).reciprocal(), 0)
        total = hidden_NC.new_zeros((), dtype=dtype)
        # in the compute dtype until backward scales them and casts each once
        grad_hidden_NC = (torch.empty(hidden_NC.shape, dtype=dtype, device=hidden_NC.device) if grad_hidden_wanted
                          else None)
        grad_weight_sum = _WeightGradientSum(gemms) if grad_weight_wanted else None
        # traced by torch.compile: functional, for inductor to fuse; eager: in place, one (n, V) buffer per chunk
        chunk_step = _traced_chunk if torch.compiler.is_compiling() else _eager_chunk
        for start, end in _chunk_bounds(hidden_NC.shape[0], chunk_tokens):
            hidden_op_nC = gemms.operand(hidden_NC[start:end])
            logits_nV = gemms.logits(hidden_op_nC, weight_op_VC)  # (n, V) compute dtype
            total = total + chunk_step(gemms, logits_nV, safe_labels_N[start:end], valid_N[start:end],
                                       scale_N[start:end], hidden_op_nC, weight_op_VC, start, grad_hidden_NC,
                                       grad_weight_sum)
            del logits_nV  # free this chunk before the next one's matmul allocates
        grad_weight_VC = None if grad_weight_sum is None else grad_weight_sum.result(weight_VC)
        ctx.save_for_backward(grad_hidden_NC, grad_weight_VC)
        ctx.dtypes = (hidden_NC.dtype, weight_VC.dtype)
        # all ignored gives 0/0 = nan, as F.cross_entropy does
        return total / count

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden_NC, grad_weight_VC = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        grad_hidden = None if grad_hidden_NC is None else (grad_hidden_NC * grad_loss).to(hidden_dtype)
        grad_weight = None if grad_weight_VC is None else (grad_weight_VC * grad_loss).to(weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def _eager_chunk(gemms: _HeadGemms, logits_nV: torch.Tensor, labels_n: torch.Tensor, valid_n: torch.Tensor,
                 scale_n: torch.Tensor, hidden_op_nC: torch.Tensor, weight_op_VC: torch.Tensor, start: int,
                 grad_hidden_NC: torch.Tensor | None, grad_weight_sum: _WeightGradientSum | None) -> torch.Tensor:
    """One chunk's summed loss, and its share of the gradients where wanted, in place over ``logits_nV``: the
    chunk's only (n, V) buffer in the compute dtype, plus half a chunk in the model's dtype for the GEMMs."""
    target_n = logits_nV.gather(1, labels_n[:, None]).squeeze(1)
    max_n1 = _exp_shifted_(logits_nV)  # logits_nV now exp(logits - rowmax)
    sum_n1 = logits_nV.sum(dim=1, keepdim=True)
    loss = torch.where(valid_n, sum_n1.squeeze(1).log() + max_n1.squeeze(1) - target_n, 0).sum()
    if grad_hidden_NC is not None or grad_weight_sum is not None:
        # scale * (d NLL / d logits) = scale * (softmax - one_hot) = (exp - sum * one_hot) * (scale / sum):
        # the one-hot term in place at the labels, the scaling in the pass that rounds for the GEMMs
        logits_nV.scatter_add_(1, labels_n[:, None], -sum_n1)
        _chunk_gradients(gemms, logits_nV, scale_n[:, None] / sum_n1, hidden_op_nC, weight_op_VC, start,
                         grad_hidden_NC, grad_weight_sum)
    return loss


def _traced_chunk(gemms: _HeadGemms, logits_nV: torch.Tensor, labels_n: torch.Tensor, valid_n: torch.Tensor,
                  scale_n: torch.Tensor, hidden_op_nC: torch.Tensor, weight_op_VC: torch.Tensor, start: int,
                  grad_hidden_NC: torch.Tensor | None, grad_weight_sum: _WeightGradientSum | None) -> torch.Tensor:
    """``_eager_chunk``'s results written for inductor: no in-place op on the logits (functionalised, the eager
    chunk's in-place passes became a second (n, V) buffer and a scatter fallback) but a log-sum-exp reduction and
    one elementwise kernel that writes the gradient already scaled, one-hot subtracted and rounded for the GEMMs.
    The logits are read twice, the gradient written once; one GEMM per gradient per chunk. The label's logit is
    a masked sum in the log-sum-exp's pass (exactly the logit: the other terms are zeros), not a gather: inductor
    put the chunks' gathers in the kernel that sums the loss after the last chunk, which kept every chunk's
    (n, V) logits alive to the end of the head (8 of them, 6.6 GB, at 64 x 512 tokens and 50,048 columns)."""
    one_hot_nV = torch.arange(logits_nV.shape[1], device=logits_nV.device) == labels_n[:, None]
    lse_n = torch.logsumexp(logits_nV, dim=1)
    target_n = torch.where(one_hot_nV, logits_nV, 0).sum(dim=1)
    loss = torch.where(valid_n, lse_n - target_n, 0).sum()
    if grad_hidden_NC is None and grad_weight_sum is None:
        return loss
    grad_op_nV = gemms.operand((torch.exp(logits_nV - lse_n[:, None]) - one_hot_nV.to(logits_nV.dtype))
                               * scale_n[:, None])
    _gradient_gemms(gemms, grad_op_nV, weight_op_VC, hidden_op_nC, start, grad_hidden_NC, grad_weight_sum)
    return loss


def _gradient_gemms(gemms: _HeadGemms, grad_op_mV: torch.Tensor, weight_op_VC: torch.Tensor,
                    hidden_op_mC: torch.Tensor, row_start: int, grad_hidden_NC: torch.Tensor | None,
                    grad_weight_sum: _WeightGradientSum | None) -> None:
    """The two GEMMs of m rows' logit gradient ``grad_op_mV`` (operand dtype): grad_hidden's rows from ``row_start``,
    and their term of grad_weight's running sum."""
    if grad_hidden_NC is not None:
        grad_hidden_NC[row_start:row_start + grad_op_mV.shape[0]] = gemms.matmul(grad_op_mV, weight_op_VC)
    if grad_weight_sum is not None:
        grad_weight_sum.add(grad_op_mV.t(), hidden_op_mC)


def _chunk_gradients(gemms: _HeadGemms, unscaled_nV: torch.Tensor, factor_n1: torch.Tensor, hidden_op_nC: torch.Tensor,
                     weight_op_VC: torch.Tensor, start: int, grad_hidden_NC: torch.Tensor | None,
                     grad_weight_sum: _WeightGradientSum | None) -> None:
    """One chunk's share of both gradients from its logits' gradient ``unscaled_nV * factor_n1`` (compute dtype;
    the scaling is applied here, in the pass that rounds): its rows of grad_hidden, and its term of grad_weight's
    running sum. Where the GEMMs take the model's dtype, the gradient is rounded to it half a chunk at a time: a
    quarter chunk of extra memory, not half."""
    n = unscaled_nV.shape[0]
    step = max(1, (n + 1) // 2) if gemms.rounds_gradient else n
    for sub in range(0, n, step):
        rows = slice(sub, min(sub + step, n))
        grad_op_mV = gemms.scaled_operand_(unscaled_nV[rows], factor_n1[rows])
        _gradient_gemms(gemms, grad_op_mV, weight_op_VC, hidden_op_nC[rows], start + rows.start, grad_hidden_NC,
                        grad_weight_sum)
        del grad_op_mV


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
    The (N, V) logits are never whole: ``chunk_tokens`` rows at a time, with the gradients computed in the same
    pass where grad is enabled. ``gemm``: the GEMMs' operand and output dtypes (module docstring)."""
    _check_inputs(hidden_NC, weight_VC, labels_N, chunk_tokens)
    if gemm not in LOSS_GEMMS and gemm not in HEAD_GEMMS:
        raise ValueError(f"loss gemm {gemm!r}: must be one of {', '.join(LOSS_GEMMS)}")
    grad_enabled = torch.is_grad_enabled()  # False inside the Function's forward: asked here
    return _ChunkedCrossEntropy.apply(hidden_NC, weight_VC, labels_N, chunk_tokens, ignore_index, gemm,
                                      grad_enabled and hidden_NC.requires_grad,
                                      grad_enabled and weight_VC.requires_grad)


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
