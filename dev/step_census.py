"""A census of one training step: what the GPU will be asked to do, counted on a machine without one.

One step (forward with labels -> loss, backward; optionally the AdamW step) runs under a
``TorchDispatchMode``, which sees every aten operator below autograd, forward and backward alike, and
counts, per phase (forward, backward, optimizer):

* **GEMM FLOPs by operand dtype**: ``mm``, ``addmm``, ``addmm_``, ``bmm``, ``baddbmm``, ``baddbmm_``, every
  overload (``mm.dtype`` / ``addmm.dtype``, the CUDA-only ``out_dtype=`` GEMMs, included), 2*M*K*N per
  matrix product (bias adds not counted). A GEMM has float32 operands when either operand is float32:
  on a GPU it runs off the bf16 tensor cores (SIMT or float32 kernels; TF32 at best).
* **SDPA FLOPs**, counted apart: the fused attention kernels (``_scaled_dot_product_*_attention`` and their
  backwards), forward 4*B*H*T*S*D (QK^T and PV), backward 8*B*H*T*S*D (dQ, dK, dV, dP; the flash backward's
  recomputation of QK^T not counted); causal masking not discounted. By the query's dtype.
* **sync-class operations**: ``aten._local_scalar_dense`` (``.item()``, ``bool(t)``, ``int(t)``),
  ``aten.nonzero``, ``aten.is_nonzero``, ``aten.equal`` on a tensor of the model's device, and copies from
  a CPU tensor into the model's device (``_to_copy`` / ``copy_``). Each is a host stall on a GPU. On a
  CPU-only run the model's device is the CPU, so the copy count is always 0 there: run on ``meta`` to see it.
* **dispatched operators**: every aten call the mode sees, and ``non_view_ops`` of them that are not views (a
  view launches no kernel): about the kernels an eager CUDA step launches, so its host-side launch overhead,
  which dominates small models.
* **memory traffic of everything else** (``traffic_bytes``): the bytes each operator that is neither a GEMM, nor
  fused attention, nor a view reads and writes: its tensor inputs and outputs (an input broadcast along a
  dimension counted once along it; an in-place operand read and written; an ``out=`` operand, a fill or
  ``new_zeros`` only written; a gather or scatter what it moves, not the whole table it indexes). Those
  operators are memory-bound on a GPU, so this predicts the eager step's time beside its GEMMs and attention;
  compiled, inductor fuses much of it away.

The census works on whatever device the model is on. ``meta`` is the way to see the CUDA path without a
GPU: nothing is computed, shapes flow, and code that branches on the device type can take its non-CPU
branch (the fused loss's ``mm(..., out_dtype=float32)`` is CUDA-only on real tensors). On ``meta`` the
sync ops cannot return data: they are counted and answered with a stand-in (1 / True; ``nonzero``: every
element nonzero). ``cuda_choices`` (default on ``meta``) makes the operator choices CUDA makes where the
code asks the device: ``scaled_dot_product_attention`` becomes the fused kernel CUDA would pick (flash
without a mask, memory-efficient with one) instead of the math fallback ``meta`` otherwise takes, and the
loss head's ``native_float32_output`` (``megatron_lite.model.loss``, where the code has it) answers yes on
``meta``, so its GEMMs are the ``mm(..., out_dtype=float32)`` ones CUDA runs.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

GEMM_OPS = frozenset({"mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_"})
SDPA_FORWARD_OPS = frozenset({
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable"})
SDPA_BACKWARD_OPS = frozenset(f"{name}_backward" for name in SDPA_FORWARD_OPS)
SYNC_OPS = ("_local_scalar_dense", "nonzero", "is_nonzero", "equal")
COPY_OPS = frozenset({"_to_copy", "copy_", "copy", "_copy_from", "_copy_from_and_resize"})
HOST_TO_DEVICE = "copy cpu->device"
PHASES = ("forward", "backward", "optimizer")
FP32 = "float32"
# operators that move no data (allocations, aliases)
NO_TRAFFIC_OPS = frozenset({"detach", "empty", "empty_like", "new_empty", "empty_strided", "empty_permuted",
                            "_unsafe_view", "alias", "lift_fresh"})
FACTORY_OPS = frozenset({"new_zeros", "new_ones", "new_full", "zeros_like", "ones_like", "full_like", "zeros",
                         "ones", "full", "fill_", "zero_"})  # write their output, read no tensor's data
GATHER_OPS = frozenset({"gather", "index_select", "embedding", "index"})  # read about what they return
SCATTER_OPS = frozenset({"scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_",
                         "index_put", "index_put_", "index_add", "index_add_"})  # move about their source


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class PhaseCensus:
    """What one phase of the step dispatched."""

    gemm_flops: Counter = field(default_factory=Counter)  # operand dtype(s) -> FLOPs
    gemm_calls: Counter = field(default_factory=Counter)  # op overload -> calls
    sdpa_flops: Counter = field(default_factory=Counter)  # query dtype -> FLOPs
    sync_ops: Counter = field(default_factory=Counter)  # op name (or HOST_TO_DEVICE) -> count
    traffic: Counter = field(default_factory=Counter)  # op name -> bytes read + written (``traffic_bytes``)
    dispatched_ops: int = 0
    view_ops: int = 0

    def add(self, other: PhaseCensus) -> None:
        for name in ("gemm_flops", "gemm_calls", "sdpa_flops", "sync_ops", "traffic"):
            getattr(self, name).update(getattr(other, name))
        self.dispatched_ops += other.dispatched_ops
        self.view_ops += other.view_ops


@dataclass
class StepCensus:
    """One training step's census, by phase; the summary figures cover forward + backward (the optimizer
    phase, when run, is reported apart: its operator count depends on AdamW's foreach/fused choice, which
    differs between CPU, meta and CUDA)."""

    device: str
    phases: dict[str, PhaseCensus]

    def total(self, phases: tuple[str, ...] = ("forward", "backward")) -> PhaseCensus:
        total = PhaseCensus()
        for name in phases:
            if name in self.phases:
                total.add(self.phases[name])
        return total

    @property
    def gemm_flops(self) -> int:
        return sum(self.total().gemm_flops.values())

    @property
    def fp32_gemm_flops(self) -> int:
        return sum(flops for key, flops in self.total().gemm_flops.items() if FP32 in key)

    @property
    def fp32_share(self) -> float:
        """Share of the step's GEMM FLOPs (SDPA not included) with a float32 operand."""
        return self.fp32_gemm_flops / self.gemm_flops if self.gemm_flops else 0.0

    @property
    def sdpa_flops(self) -> int:
        return sum(self.total().sdpa_flops.values())

    @property
    def sync_ops(self) -> Counter:
        return self.total().sync_ops

    @property
    def sync_count(self) -> int:
        return sum(self.sync_ops.values())

    @property
    def dispatched_ops(self) -> int:
        return self.total().dispatched_ops

    @property
    def non_view_ops(self) -> int:
        """Dispatched operators that are not views: about the kernels an eager CUDA step launches."""
        total = self.total()
        return total.dispatched_ops - total.view_ops

    @property
    def traffic_bytes(self) -> int:
        """Bytes read and written by the operators that are not GEMMs, fused attention or views."""
        return sum(self.total().traffic.values())

    def as_dict(self) -> dict[str, Any]:
        return {"device": self.device, "gemm_flops": self.gemm_flops, "fp32_gemm_flops": self.fp32_gemm_flops,
                "fp32_share": self.fp32_share, "sdpa_flops": self.sdpa_flops, "sync_ops": dict(self.sync_ops),
                "sync_count": self.sync_count, "dispatched_ops": self.dispatched_ops, "non_view_ops": self.non_view_ops,
                "traffic_bytes": self.traffic_bytes,
                "phases": {name: {"gemm_flops": dict(phase.gemm_flops), "gemm_calls": dict(phase.gemm_calls),
                                  "sdpa_flops": dict(phase.sdpa_flops), "sync_ops": dict(phase.sync_ops),
                                  "traffic": dict(phase.traffic),
                                  "dispatched_ops": phase.dispatched_ops, "view_ops": phase.view_ops}
                           for name, phase in self.phases.items()}}


def _gemm_operands(name: str, args: tuple[Any, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    return (args[0], args[1]) if name in ("mm", "bmm") else (args[1], args[2])  # addmm/baddbmm: (bias, a, b)


def gemm_flops(name: str, args: tuple[Any, ...]) -> tuple[str, int]:
    """(operand dtype key, FLOPs) of one mm-family call: 2*M*K*N per product (times the batch for bmm)."""
    a, b = _gemm_operands(name, args)
    batch = a.shape[0] if a.dim() == 3 else 1
    m, k = a.shape[-2], a.shape[-1]
    flops = 2 * batch * m * k * b.shape[-1]
    key = _dtype_name(a.dtype) if a.dtype == b.dtype else f"{_dtype_name(a.dtype)} x {_dtype_name(b.dtype)}"
    return key, flops


def sdpa_flops(args: tuple[Any, ...], backward: bool) -> tuple[str, int]:
    """(query dtype, FLOPs) of a fused attention call: 4*B*H*T*S*D forward, twice that backward.
    The backwards take grad_out first, then query, key, value."""
    q, k = (args[1], args[2]) if backward else (args[0], args[1])
    batch, heads, queries, dim = q.shape
    flops = 4 * batch * heads * queries * k.shape[-2] * dim
    return _dtype_name(q.dtype), 2 * flops if backward else flops


def touched_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the distinct elements a tensor addresses (a dimension of stride 0, a broadcast, counted once)."""
    elements = 1
    for size, stride in zip(tensor.shape, tensor.stride()):
        elements *= size if stride else 1
    return elements * tensor.element_size()


def traffic_bytes(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """Bytes one memory-bound operator reads and writes (module docstring): its tensor inputs and outputs; a gather
    its indices and twice what it returns; a scatter twice its indices and source (read, then written at them)."""
    if name in NO_TRAFFIC_OPS:
        return 0
    read = (args, {key: value for key, value in kwargs.items() if key != "out"})  # out=: written, returned
    inputs = [value for value in pytree.tree_leaves(read) if isinstance(value, torch.Tensor)]
    outputs = [value for value in pytree.tree_leaves(out) if isinstance(value, torch.Tensor)]
    if name in FACTORY_OPS:
        return sum(map(touched_bytes, outputs))
    if name in GATHER_OPS:
        return sum(map(touched_bytes, inputs[1:])) + 2 * sum(map(touched_bytes, outputs))
    if name in SCATTER_OPS:
        return sum(map(touched_bytes, inputs[1:])) * 2
    return sum(map(touched_bytes, inputs)) + sum(map(touched_bytes, outputs))


def _stand_in(name: str, args: tuple[Any, ...]) -> Any:
    """What a sync op on a meta tensor answers (it has no data): 1 / True; nonzero: every element."""
    tensor = args[0]
    if name == "nonzero":
        return torch.empty((tensor.numel(), tensor.dim()), dtype=torch.long, device=tensor.device)
    if name in ("is_nonzero", "equal") or tensor.dtype == torch.bool:
        return True
    return 1.0 if tensor.dtype.is_floating_point else 1


class CensusMode(TorchDispatchMode):
    """Counts every dispatched aten operator into ``phases[phase]`` (set ``phase`` between phases)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.phases: dict[str, PhaseCensus] = {}
        self.phase = "forward"

    def _on_device(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor) and value.device.type == self.device.type

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        counts = self.phases.setdefault(self.phase, PhaseCensus())
        name = func.overloadpacket.__name__
        counts.dispatched_ops += 1
        counts.view_ops += bool(func.is_view)
        if name in GEMM_OPS:
            key, flops = gemm_flops(name, args)
            counts.gemm_flops[key] += flops
            counts.gemm_calls[str(func).removeprefix("aten.")] += 1
        elif name in SDPA_FORWARD_OPS or name in SDPA_BACKWARD_OPS:
            key, flops = sdpa_flops(args, backward=name in SDPA_BACKWARD_OPS)
            counts.sdpa_flops[key] += flops
        elif name in SYNC_OPS and self._on_device(args[0]):
            counts.sync_ops[name] += 1
            if args[0].device.type == "meta":
                return _stand_in(name, args)
        out = func(*args, **kwargs)
        if not func.is_view and name not in GEMM_OPS and name not in SDPA_FORWARD_OPS and name not in SDPA_BACKWARD_OPS:
            counts.traffic[name] += traffic_bytes(name, args, kwargs, out)
        if name in COPY_OPS and self.device.type != "cpu":
            if name in ("copy_", "copy"):  # copy_(self, src) / copy(self, src): src's data into self's device
                source, target = args[1], args[0]
            elif name in ("_copy_from", "_copy_from_and_resize"):  # _copy_from(self, dst)
                source, target = args[0], args[1]
            else:  # _to_copy(self, *, device=...)
                source, target = args[0], out
            if (isinstance(source, torch.Tensor) and source.device.type == "cpu" and self._on_device(target)):
                counts.sync_ops[HOST_TO_DEVICE] += 1
        return out


class FusedAttentionAsOnCuda(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` as the fused kernel CUDA dispatches to (flash without a mask,
    memory-efficient with one), for devices (``meta``) that would otherwise take the math fallback."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        bound = {**dict(zip(names, args)), **kwargs}
        q, k, v = bound["query"], bound["key"], bound["value"]
        mask, dropout_p = bound.get("attn_mask"), bound.get("dropout_p", 0.0)
        is_causal, scale = bound.get("is_causal", False), bound.get("scale")
        if k.shape[-3] != q.shape[-3]:  # grouped-query heads: the kernel sees them repeated
            repeats = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(repeats, dim=-3), v.repeat_interleave(repeats, dim=-3)
        if mask is None:
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False,
                                                                      scale=scale)[0]
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        bias = mask.to(q.dtype).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, dropout_p, is_causal, scale=scale)[0]


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@contextlib.contextmanager
def cuda_operator_choices() -> Iterator[None]:
    """While active: SDPA as CUDA's fused kernels, and the loss head's float32-output GEMMs on ``meta`` too."""
    from megatron_lite.model import loss as loss_module

    with contextlib.ExitStack() as stack:
        native = getattr(loss_module, "native_float32_output", None)
        if native is not None:
            stack.enter_context(mock.patch.object(
                loss_module, "native_float32_output",
                lambda device: torch.device(device).type == "meta" or native(device)))
        stack.enter_context(FusedAttentionAsOnCuda())
        yield


def census_step(model: torch.nn.Module, ids_BT1: torch.Tensor, *, is_hf: bool = False, optimizer: bool = False,
                device: torch.device | str | None = None, cuda_choices: bool | None = None) -> StepCensus:
    """The census of one training step of ``model`` on ``ids_BT1`` (B, T + 1): inputs ids[:, :-1], labels
    ids[:, 1:]. Ours: ``model(inputs, labels=labels)`` (the trainer's fused loss). ``is_hf``: a Hugging Face
    causal LM, its logits (the model's dtype) to a float32 ``F.cross_entropy``.

    device: the device counted as "the device" (default: the model's); the model and ids must be on it.
    optimizer: also an AdamW step (its own phase). cuda_choices: the operator choices of the CUDA path
    (``cuda_operator_choices``; default: on ``meta``)."""
    device = torch.device(device) if device is not None else _model_device(model)
    if _model_device(model).type != device.type or ids_BT1.device.type != device.type:
        raise ValueError(f"census on {device}: the model is on {_model_device(model)}, the ids on {ids_BT1.device}")
    if cuda_choices is None:
        cuda_choices = device.type == "meta"
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1) if optimizer else None
    inputs, labels = ids_BT1[:, :-1], ids_BT1[:, 1:]
    mode = CensusMode(device)
    with cuda_operator_choices() if cuda_choices else contextlib.nullcontext(), mode:
        if is_hf:
            logits = model(inputs).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
        else:
            loss = model(inputs, labels=labels)
        mode.phase = "backward"
        loss.backward()
        if adamw is not None:
            mode.phase = "optimizer"
            adamw.step()
            adamw.zero_grad(set_to_none=True)
    if adamw is None:
        model.zero_grad(set_to_none=True)
    return StepCensus(device=str(device), phases=mode.phases)
