"""Float32 gradient sums at ZeRO 1 in two operators per parameter group, not a Python hook per parameter.

With ``train.grad_accum_dtype: fp32`` at ZeRO 1 DeepSpeed's BF16_Optimizer keeps, per parameter group, one flat
float32 gradient buffer (``fp32_groups_gradients_flat``: the parameters in group order, then alignment padding).
Its ``bf16.immediate_grad_update`` adds each bf16 gradient into it from a Python hook as backward produces it: on
the H200 host, for the 350M model's 292 tensors x 16 micro batches, 342 ms of a 1.36 s step and 2 kernels (cast,
add) per tensor and micro batch. Without it, DeepSpeed's ``update_hp_grads`` runs the same per-tensor Python loop
after backward. ``install`` replaces that method on the optimizer instance: after each backward the group's bf16
gradients are concatenated in the buffer's own order (one C++ call) and added into the buffer in one mixed-dtype
``add_``, then released as the hooks release them. The sums are bit for bit the same (bf16 -> float32 is exact,
so each element gets the same single float32 rounding). The concatenation is a transient bf16 copy of the
gradients (2 bytes per parameter, at the end of backward, when the activations are gone).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch._utils import _flatten_dense_tensors

# BF16_Optimizer's attributes the fast path reads or keeps right (deepspeed/runtime/bf16_optimizer.py, 0.19.8)
REQUIRED = ("bf16_groups", "fp32_groups_gradients", "fp32_groups_actual_gradients_flat", "fp32_groups_has_gradients",
            "immediate_grad_update", "update_hp_grads", "backward_epilogue")
# On CPU a mixed-dtype add_ casts its bf16 operand through a float32 temporary of its whole size (CUDA casts in the
# kernel), and a temporary above glibc's mmap threshold (32 MB at most) page-faults afresh on every call: there a
# group is summed in runs of consecutive parameters of at most this many elements (16 MB float32 temporaries)
CPU_RUN_ELEMENTS: int | None = 2**22

Run = tuple[int, int, torch.Tensor]  # parameters [first, last) of a group and their (elements,) float32 slice


def install(optimizer: Any) -> bool:
    """Give DeepSpeed's BF16_Optimizer (bf16, ZeRO 1, float32 sums) the flat gradient sum; whether it did.
    Other optimizers, and a BF16_Optimizer that sums from its own hooks (``bf16.immediate_grad_update`` set in
    train.deepspeed), are left as they are. RuntimeError when DeepSpeed's internals are not as expected."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    if not isinstance(optimizer, BF16_Optimizer) or not getattr(optimizer, "using_real_optimizer", True):
        return False
    missing = [name for name in REQUIRED if not hasattr(optimizer, name)]
    if missing:
        raise RuntimeError(f"train.grad_accum_dtype=fp32 at ZeRO 1: DeepSpeed's BF16_Optimizer has no "
                           f"{', '.join(missing)} (a DeepSpeed version this project was not written for); the flat "
                           "float32 gradient sum (training/fp32_grad_sums.py) relies on them")
    if optimizer.immediate_grad_update:
        return False
    if installed(optimizer):
        return True
    check_layout(optimizer.bf16_groups, optimizer.fp32_groups_gradients, optimizer.fp32_groups_actual_gradients_flat)
    runs = [parameter_runs(params, flat, CPU_RUN_ELEMENTS if flat.device.type == "cpu" else None)
            for params, flat in zip(optimizer.bf16_groups, optimizer.fp32_groups_actual_gradients_flat)]
    optimizer.update_hp_grads = functools.partial(update_hp_grads, optimizer, runs, optimizer.update_hp_grads)
    return True


def installed(optimizer: Any) -> bool:
    """Whether ``install`` gave ``optimizer`` the flat gradient sum."""
    method = getattr(optimizer, "update_hp_grads", None)
    return isinstance(method, functools.partial) and method.func is update_hp_grads


def check_layout(params: list[list[torch.Tensor]], hp_grads: list[list[torch.Tensor]],
                 flats: list[torch.Tensor]) -> None:
    """RuntimeError unless each group's float32 gradients are consecutive slices of its flat buffer in parameter
    order, which is what adding the concatenated bf16 gradients into the buffer assumes."""
    if not len(params) == len(hp_grads) == len(flats):
        raise RuntimeError(f"BF16_Optimizer: {len(params)} bf16 groups, {len(hp_grads)} float32 gradient groups and "
                           f"{len(flats)} flat buffers; expected one each per parameter group")
    for index, (group, grads, flat) in enumerate(zip(params, hp_grads, flats)):
        offset = flat.storage_offset()
        for param, grad in zip(group, grads, strict=True):
            if (grad.dim() != 1 or grad.numel() != param.numel() or grad.untyped_storage().data_ptr()
                    != flat.untyped_storage().data_ptr() or grad.storage_offset() != offset):
                raise RuntimeError(f"BF16_Optimizer group {index}: its float32 gradients are not consecutive slices "
                                   "of fp32_groups_actual_gradients_flat in parameter order (a DeepSpeed version this "
                                   "project was not written for)")
            offset += param.numel()
        if offset != flat.storage_offset() + flat.numel():
            raise RuntimeError(f"BF16_Optimizer group {index}: its flat gradient buffer holds "
                               f"{flat.numel()} elements, its parameters {offset - flat.storage_offset()}")


def parameter_runs(params: list[torch.Tensor], flat: torch.Tensor, limit: int | None) -> list[Run]:
    """The group as runs of consecutive parameters of at most ``limit`` elements (a larger parameter alone; None:
    one run), each with its slice of the group's (elements,) float32 gradient buffer ``flat``."""
    runs: list[Run] = []
    first = start = size = 0
    for index, param in enumerate(params):
        if index > first and limit is not None and size + param.numel() > limit:
            runs.append((first, index, flat.narrow(0, start, size)))
            first, start, size = index, start + size, 0
        size += param.numel()
    if first < len(params):
        runs.append((first, len(params), flat.narrow(0, start, size)))
    return runs


@torch.no_grad()
def update_hp_grads(optimizer: Any, runs: list[list[Run]], deepspeeds: Callable[..., None],
                    clear_lp_grads: bool = False) -> None:
    """BF16_Optimizer.update_hp_grads (called from the engine's backward epilogue, before any all-reduce) as one
    ``add_`` per group (per run on CPU). The bf16 gradients are released whatever ``clear_lp_grads`` says (as the
    immediate update does), so the next micro batch's autograd writes fresh ones instead of adding into zeros."""
    if getattr(optimizer, "autoep_folding_tp_group", None) is not None:  # corrects each gradient first: its own loop
        return deepspeeds(clear_lp_grads=clear_lp_grads)
    for index, params in enumerate(optimizer.bf16_groups):
        grads = [param.grad for param in params]
        hp_grads = optimizer.fp32_groups_gradients[index]  # (numel,) float32 slices of the flat buffer
        present = [position for position, grad in enumerate(grads) if grad is not None]
        if len(present) == len(params):
            for first, last, hp_run in runs[index]:
                hp_run.add_(_flatten_dense_tensors(grads[first:last]))  # (n,) float32 += (n,) bf16
            optimizer.fp32_groups_has_gradients[index] = [True] * len(params)
        elif present:  # parameters without a gradient this micro batch (unused): their slices stay as they are
            torch._foreach_add_([hp_grads[position] for position in present],
                                [grads[position].view(-1) for position in present])
            for position in present:
                optimizer.fp32_groups_has_gradients[index][position] = True
        for position in present:
            params[position]._hp_grad = hp_grads[position]  # DeepSpeed's link for safe_get_full_grad
            params[position].grad = None
