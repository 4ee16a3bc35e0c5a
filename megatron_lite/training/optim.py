"""AdamW with GPT-NeoX/nanoGPT weight-decay groups, and a switch that skips one update.

Decay applies to every parameter with >= 2 dimensions (the QKV/dense/MLP matrices, the embedding and
the LM head); biases and LayerNorm weights (1-D) get none.

Fused AdamW (train.fused_optimizer; by default on CUDA): DeepSpeed 0.19.8's wrappers take the client optimizer
as it is and call its ``step()`` on their float32 master partitions (bf16: ``BF16_Optimizer``; ZeRO 1/2:
``DeepSpeedZeroOptimizer``; ZeRO 3: ``DeepSpeedZeroOptimizer_Stage3``; fp16: ``FP16_UnfusedOptimizer``), which
are floating tensors on the parameters' device, so torch's fused kernel applies to them unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from megatron_lite.config import TrainConfig


def weight_decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two parameter groups: ``decay`` (>= 2-D) and ``no_decay`` (< 2-D), each with parameter names."""
    decay, no_decay = [], []
    seen: set[int] = set()
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad or id(parameter) in seen:  # tied weights appear once
            continue
        seen.add(id(parameter))
        (decay if parameter.dim() >= 2 else no_decay).append((name, parameter))
    return [
        {"name": "decay", "params": [p for _, p in decay], "param_names": [n for n, _ in decay],
         "weight_decay": weight_decay},
        {"name": "no_decay", "params": [p for _, p in no_decay], "param_names": [n for n, _ in no_decay],
         "weight_decay": 0.0},
    ]


class SkippableAdamW(torch.optim.AdamW):
    """torch AdamW whose next ``step()`` can be turned into a no-op (a non-finite loss skips the update).

    DeepSpeed's wrappers (ZeRO, bf16) call this step after reducing gradients; skipping here leaves
    weights and Adam moments untouched on every stage and precision.
    """

    skip_next_step: bool = False
    groups_summary: str = ""  # what gets weight decay; build_optimizer sets it, the loop logs it at start-up
    fused_wanted: bool = False  # train.fused_optimizer as decided at build (``use_fused_adamw``)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if self.skip_next_step:
            self.skip_next_step = False
            return None
        return super().step(closure)


def describe_groups(groups: list[dict[str, Any]]) -> str:
    """One line: tensors and parameters per weight-decay group."""
    parts = [f"{group['name']} {len(group['params'])} tensors ({sum(p.numel() for p in group['params']):,} parameters, "
             f"weight decay {group['weight_decay']:g})" for group in groups]
    return "optimizer groups: " + "; ".join(parts)


def use_fused_adamw(parameters: Iterable[torch.Tensor], setting: bool | None) -> bool:
    """train.fused_optimizer for these parameters: null means fused when every one is a floating-point CUDA
    tensor (CPU runs stay unfused); true means fused, a ValueError where torch has no fused kernel for one."""
    parameters = list(parameters)
    if setting is False or not parameters:
        return False
    if setting is None:
        return all(p.is_cuda and p.is_floating_point() for p in parameters)
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    supported = _get_fused_kernels_supported_devices()
    for parameter in parameters:
        if parameter.device.type not in supported or not parameter.is_floating_point():
            raise ValueError(f"train.fused_optimizer=true: torch's fused AdamW takes floating-point tensors on "
                             f"{', '.join(supported)}, and a parameter is {parameter.dtype} on {parameter.device.type}")
    return True


def set_fused(optimizer: torch.optim.Optimizer, fused: bool) -> None:
    """Make ``optimizer``'s groups ``fused`` (or not) after a state load, which takes the flag from the checkpoint:
    a checkpoint written unfused would otherwise turn fusion off for the rest of the run. Each Adam ``step``
    counter moves where that path keeps it (fused: float32 on the parameter's device; unfused: on the CPU)."""
    for group in optimizer.param_groups:
        group["fused"] = fused or None  # None: torch's default (foreach on CUDA)
        if fused:
            group["foreach"] = None  # fused and foreach cannot both be set
        for parameter in group["params"]:
            step = optimizer.state.get(parameter, {}).get("step")
            if isinstance(step, torch.Tensor):
                device = parameter.device if fused or group.get("capturable") else torch.device("cpu")
                optimizer.state[parameter]["step"] = step.to(device=device, dtype=torch.float32)


def build_optimizer(model: nn.Module, train: TrainConfig) -> SkippableAdamW:
    """AdamW over ``weight_decay_groups``, fused as ``use_fused_adamw`` decides; ``groups_summary`` holds the
    groups' sizes (and fusion) for the start-up log."""
    groups = weight_decay_groups(model, train.weight_decay)
    fused = use_fused_adamw((p for group in groups for p in group["params"]), train.fused_optimizer)
    summary = describe_groups(groups) + ("; fused AdamW" if fused else "")
    for group in groups:
        del group["param_names"]  # torch keeps unknown keys in state_dict; the names were for reporting only
    optimizer = SkippableAdamW(groups, lr=train.lr, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps,
                               fused=fused or None)
    optimizer.groups_summary = summary
    optimizer.fused_wanted = fused
    return optimizer
