"""FP8 training (``train.fp8``): which of the model's GEMMs run in float8.

Block linears go through torchao's float8 training (``convert_to_float8_training``, its default recipe: one
dynamic scale per tensor, e4m3 for inputs and weights, e5m2 for output gradients, products in the inputs'
dtype): each chosen ``nn.Linear`` becomes a ``Float8Linear`` in place, holding the same ``weight`` and ``bias``
parameters, so state-dict keys, parameter order, optimizer state and checkpoints are those of the plain model.

The LM head is no plain linear: with the fused loss (``train.fused_loss``) its three GEMMs per token chunk
(logits, grad_hidden, grad_weight) run inside ``chunked_cross_entropy``, where a module swap cannot reach them.
``Float8HeadGemms`` runs those three GEMMs in float8 with torchao's casting primitives and the same recipe
(tensorwise dynamic scales, e4m3 operands, e5m2 for the logits' gradient), float32 products from
``torch._scaled_mm``; the softmax and the loss stay float32. The plain head (``train.fused_loss=false``) has no
FP8 path.

Attention kernels (SDPA, flash, flex; CoCA's and RoPE's rotations) stay in the model's dtype: only GEMMs of
``nn.Linear`` layers and the head change. A float8 GEMM needs its matrix dimensions divisible by 16; linears
that do not fit stay in the model's dtype (``Float8Plan.skipped``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from megatron_lite.model import loss

FLOAT8_CHOICES: tuple[str, ...] = ("none", "lm_head", "mlp", "all")  # megatron_lite.config.schema.Float8Choice
MLP_LINEARS = ("dense_h_to_4h", "dense_4h_to_h", "gate_proj", "up_proj", "down_proj")  # within a block's mlp
HEAD_GEMM = "float8"  # the LM head's gemm mode (``loss.HEAD_GEMMS``) that ``Float8HeadGemms`` serves
DIVISOR = 16  # float8 GEMMs (cuBLASLt through torch._scaled_mm) need matrix dimensions divisible by this
MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (sm89) and Hopper (sm90) on
INSTALL_HINT = "pip install -e \".[fp8]\" -c constraints.txt"


@dataclass
class Float8Plan:
    """What ``train.fp8`` converts in one model: block linears by name, the head, and what stays as it is."""

    choice: str
    linears: list[str] = field(default_factory=list)  # converted to torchao's Float8Linear
    head: bool = False  # the fused loss head's GEMMs in float8
    skipped: list[str] = field(default_factory=list)  # "name (out x in)": chosen, dimensions not divisible by 16

    def summary(self) -> str:
        """The one line a run prints as it converts."""
        parts = [f"{len(self.linears)} block linears"] if self.linears else []
        if self.head:
            parts.append("the LM head's loss GEMMs")
        what = " and ".join(parts) or "nothing"
        return (f"train.fp8={self.choice}: {what} in FP8 (torchao tensorwise dynamic scaling; "
                "attention kernels stay in the model's dtype)")

    def skipped_notice(self) -> str | None:
        """One line naming the chosen layers left in the model's dtype, or None."""
        if not self.skipped:
            return None
        shown = ", ".join(self.skipped[:4]) + (f" and {len(self.skipped) - 4} more" if len(self.skipped) > 4 else "")
        return (f"train.fp8={self.choice}: {len(self.skipped)} layer(s) stay in the model's dtype, their dimensions "
                f"not divisible by {DIVISOR} as float8 GEMMs need: {shown}")


def _fits(out_features: int, in_features: int) -> bool:
    return out_features % DIVISOR == 0 and in_features % DIVISOR == 0


def _chosen(name: str, choice: str) -> bool:
    """Whether the block linear ``name`` (``layers.N.<module>.<linear>``) is one ``choice`` converts."""
    if choice == "all":
        return True
    parts = name.split(".")
    return choice == "mlp" and len(parts) >= 2 and parts[-2] == "mlp" and parts[-1] in MLP_LINEARS


def plan_float8(model: nn.Module, choice: str) -> Float8Plan:
    """Which GEMMs ``choice`` puts in float8 in ``model`` (a GPT): no side effects. ValueError for an unknown
    choice."""
    if choice not in FLOAT8_CHOICES:
        raise ValueError(f"train.fp8={choice!r}: must be one of {', '.join(map(repr, FLOAT8_CHOICES))}")
    plan = Float8Plan(choice)
    if choice == "none":
        return plan
    if choice in ("mlp", "all"):
        layers = getattr(model, "layers")
        for name, module in layers.named_modules(prefix="layers"):
            if not isinstance(module, nn.Linear) or not _chosen(name, choice):
                continue
            if _fits(module.out_features, module.in_features):
                plan.linears.append(name)
            else:
                plan.skipped.append(f"{name} ({module.out_features}x{module.in_features})")
    if choice in ("lm_head", "all"):
        head = getattr(model, "lm_head")
        if _fits(head.out_features, head.in_features):
            plan.head = True
        else:
            plan.skipped.append(f"lm_head ({head.out_features}x{head.in_features})")
    return plan


def float8_unavailable(device: torch.device) -> str | None:
    """Why ``device`` cannot run float8 matmuls fast, or None: a CUDA GPU of compute capability 8.9 or newer."""
    if device.type != "cuda":
        return f"this run's device is {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return f"this run's GPU ({name}) has compute capability {capability[0]}.{capability[1]}"
    return None


def float8_problem(choice: str, fused_loss: bool, device: torch.device) -> str | None:
    """Why ``train.fp8=choice`` cannot train here, as one line, or None (also for ``none``)."""
    if choice == "none":
        return None
    if choice == "lm_head" and not fused_loss:
        return ("train.fp8=lm_head: the head's FP8 GEMMs live in the fused loss, and train.fused_loss=false; "
                "set train.fused_loss=true")
    try:
        import_torchao_float8()
    except ImportError as error:
        return f"train.fp8={choice} needs torchao ({error}): {INSTALL_HINT}"
    reason = float8_unavailable(device)
    if reason is not None:
        return (f"train.fp8={choice}: FP8 matmuls need a CUDA GPU of compute capability 8.9 or newer (H100, H200, "
                f"L4, L40S, RTX 4090), {reason}; set train.fp8=none")
    return None


@contextlib.contextmanager
def _quiet_torchao_import() -> Iterator[None]:
    """torchao's import logs a warning for each of its compiled extensions that does not load (its CUDA kernels
    for other recipes, on a CPU build of torch), and torch's pytree a deprecation for torchao's enum: neither
    concerns the float8 training path, which runs on ``torch._scaled_mm``."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [each.level for each in loggers]
    for each in loggers:
        each.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for each, level in zip(loggers, levels):
            each.setLevel(level)


def import_torchao_float8() -> Any:
    """``torchao.float8`` (ImportError where torchao is not installed)."""
    with _quiet_torchao_import():
        import torchao.float8

    return torchao.float8


def _patch_inductor_for_float8() -> None:
    """torchao's workaround for a Triton miscompile of transposed float8 stores (triton-lang/triton#11111), which
    ``convert_to_float8_training`` applies: applied for the head's casts too, where no linear is converted."""
    with contextlib.suppress(ImportError):
        from torchao.float8._inductor_patch import _patch_inductor_min_max_codegen

        _patch_inductor_min_max_codegen()


def apply_float8(model: nn.Module, choice: str) -> Float8Plan:
    """Convert ``model`` (a GPT) in place as ``train.fp8=choice`` says; returns the plan it carried out. Call
    after the model's loss settings (``use_loss_settings``: the head's gemm mode is set here) and before
    torch.compile and DeepSpeed wrap it."""
    plan = plan_float8(model, choice)
    if not plan.linears and not plan.head:
        return plan
    float8 = import_torchao_float8()
    _patch_inductor_for_float8()
    if plan.linears:
        chosen = set(plan.linears)
        layers = getattr(model, "layers")
        float8.convert_to_float8_training(layers, module_filter_fn=lambda _, fqn: f"layers.{fqn}" in chosen,
                                          config=float8.Float8LinearConfig())
    if plan.head:
        getattr(model, "lm_head").gemm = HEAD_GEMM
    return plan


# ----------------------------------------------------------------------------------------------
# The fused loss head in float8


def _to_float8(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` in float8 ``dtype`` with one dynamic scale (amax -> the dtype's largest value), saturated; and the
    inverse scale that ``torch._scaled_mm`` multiplies the product back by."""
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    scale = tensor_to_scale(x, dtype)  # float32 scalar: max(dtype) / amax(x)
    return to_fp8_saturated(x.float() * scale, dtype), scale.reciprocal()


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x if x.shape[0] == rows else torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


class Float8HeadGemms(loss._HeadGemms):
    """The fused head's GEMMs in float8: ``logits`` from e4m3 hidden and weight, the two gradient GEMMs
    (``matmul``: the logits' gradient first) from an e5m2 gradient and an e4m3 weight or hidden, each operand with
    one dynamic scale, every product float32. Operands are rounded to the model's dtype as the mixed mode does
    (the softmax gradient too) and cast to float8 per GEMM; the weight's e4m3 copy for the logits is made once per
    forward. grad_weight's inner dimension (tokens) is padded with zeros to a multiple of 16. ``train.loss_gemm``
    does not apply."""

    def __init__(self, gemm: str, hidden_NC: torch.Tensor, weight_VC: torch.Tensor) -> None:
        super().__init__("mixed", hidden_NC, weight_VC)
        self.operand_dtype = self.rounding_dtype  # operands stay narrow: the cast to float8 happens per GEMM
        self.weight_VC = self.operand(weight_VC)
        self.weight8_VC, self.weight_inverse_scale = _to_float8(self.weight_VC, torch.float8_e4m3fn)

    def _scaled_mm(self, a8: torch.Tensor, a_inverse: torch.Tensor, b8: torch.Tensor,
                   b_inverse: torch.Tensor) -> torch.Tensor:
        """a8 @ b8 in the compute dtype from a float32 product; ``a8`` laid out row-major, ``b8`` column-major."""
        a8, b8 = a8.contiguous(), b8.t().contiguous().t()
        out = torch._scaled_mm(a8, b8, scale_a=a_inverse, scale_b=b_inverse, out_dtype=torch.float32)
        return out.to(self.compute_dtype)

    def logits(self, hidden_op_nC: torch.Tensor, weight_op_VC: torch.Tensor) -> torch.Tensor:
        hidden8_nC, hidden_inverse = _to_float8(hidden_op_nC, torch.float8_e4m3fn)
        return self._scaled_mm(hidden8_nC, hidden_inverse, self.weight8_VC.t(), self.weight_inverse_scale)

    def matmul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        inner = -(-a.shape[1] // DIVISOR) * DIVISOR
        if inner != a.shape[1]:  # grad_weight over a token count not divisible by 16: zero rows add nothing
            a, b = _pad_rows(a.t(), inner).t(), _pad_rows(b, inner)
        grad8, grad_inverse = _to_float8(a, torch.float8_e5m2)
        other8, other_inverse = _to_float8(b, torch.float8_e4m3fn)
        return self._scaled_mm(grad8, grad_inverse, other8, other_inverse)

    def add_matmul(self, total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return total.add_(self.matmul(a, b))


loss.HEAD_GEMMS[HEAD_GEMM] = Float8HeadGemms
