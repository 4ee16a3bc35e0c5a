"""AdamW with GPT-NeoX/nanoGPT weight-decay groups, and a switch that skips one update.

Decay applies to every parameter with >= 2 dimensions (the QKV/dense/MLP matrices, the embedding and
the LM head); biases and LayerNorm weights (1-D) get none.
"""

from __future__ import annotations

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


def build_optimizer(model: nn.Module, train: TrainConfig) -> SkippableAdamW:
    """AdamW over ``weight_decay_groups``; ``groups_summary`` holds their sizes for the start-up log."""
    groups = weight_decay_groups(model, train.weight_decay)
    summary = describe_groups(groups)
    for group in groups:
        del group["param_names"]  # torch keeps unknown keys in state_dict; the names were for reporting only
    optimizer = SkippableAdamW(groups, lr=train.lr, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps)
    optimizer.groups_summary = summary
    return optimizer
