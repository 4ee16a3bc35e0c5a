"""Fused-QKV row slots: the rows of a GPT-NeoX ``query_key_value`` (per head [q | k-or-t | v]) as three
slot tensors, and ``SlotQKV``, the Linear held as three slot parameters so that one slot can train while
the others stay frozen (``train.stages``). ``join_qkv_slots`` fuses the slot names back in a state dict
(DeepSpeed's ZeRO consolidation of a staged model), so checkpoints and weights keep the fused layout.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SLOTS = (0, 1, 2)  # q, k (CoCA's t), v
SLOT_WEIGHT = "slot{}_weight"  # (H, D, C): one slot's rows of every head
SLOT_BIAS = "slot{}_bias"  # (H * D,): 1-D, so weight-decay groups treat it as a bias


def fuse_slots(slots: list[torch.Tensor], num_heads: int) -> torch.Tensor:
    """Three slot tensors -> the fused per-head-interleaved tensor: weights (H, D, C) -> (H * 3 * D, C),
    biases (H * D,) -> (H * 3 * D,); row h*3D + k*D + d is slot k's row (h, d)."""
    if slots[0].dim() == 3:
        return torch.stack(slots, dim=1).reshape(-1, slots[0].shape[-1])  # (H, 3, D, C) -> (3HD, C)
    return torch.stack([slot.view(num_heads, -1) for slot in slots], dim=1).reshape(-1)  # (H, 3, D) -> (3HD,)


def split_slots(fused: torch.Tensor, num_heads: int) -> list[torch.Tensor]:
    """Inverse of ``fuse_slots``: (3 * H * D[, C]) -> three (H, D, C) weights or (H * D,) biases."""
    per_head = fused.reshape(num_heads, 3, -1, *fused.shape[1:])  # (H, 3, D[, C])
    if fused.dim() == 2:
        return [per_head[:, k].clone() for k in SLOTS]
    return [per_head[:, k].reshape(-1).clone() for k in SLOTS]


class SlotQKV(nn.Module):
    """A fused per-head [q | k | v] Linear held as three slot parameters, so that one slot trains while
    the others stay frozen without optimizer state. Output and state_dict are those of the Linear."""

    def __init__(self, linear: nn.Linear, num_heads: int, weight_slots: Iterable[int], bias_slots: Iterable[int]
                 ) -> None:
        super().__init__()
        self.num_heads = num_heads
        weight_slots, bias_slots = set(weight_slots), set(bias_slots)
        for k, slot in enumerate(split_slots(linear.weight.detach(), num_heads)):
            self.register_parameter(SLOT_WEIGHT.format(k), nn.Parameter(slot, requires_grad=k in weight_slots))
        self.has_bias = linear.bias is not None
        if self.has_bias:
            for k, slot in enumerate(split_slots(linear.bias.detach(), num_heads)):
                self.register_parameter(SLOT_BIAS.format(k), nn.Parameter(slot, requires_grad=k in bias_slots))
        self.register_state_dict_post_hook(_fuse_state)
        self.register_load_state_dict_pre_hook(_split_state)

    def _slots(self, template: str) -> list[torch.Tensor]:
        return [getattr(self, template.format(k)) for k in SLOTS]

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        weight = fuse_slots(self._slots(SLOT_WEIGHT), self.num_heads)  # (3 * H * D, C)
        bias = fuse_slots(self._slots(SLOT_BIAS), self.num_heads) if self.has_bias else None
        return F.linear(x_BTC, weight, bias)


def _is_whole(slots: list[torch.Tensor], dims: int) -> bool:
    """False for ZeRO-3's partitioned placeholders (empty tensors), which pass through unfused."""
    return all(slot.dim() == dims and slot.numel() > 0 for slot in slots)


def _fuse_state(module: SlotQKV, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    for template, fused_name, dims in ((SLOT_WEIGHT, "weight", 3), (SLOT_BIAS, "bias", 1)):
        names = [prefix + template.format(k) for k in SLOTS]
        if names[0] not in state:
            continue
        slots = [state.pop(name) for name in names]
        state[prefix + fused_name] = fuse_slots(slots, module.num_heads) if _is_whole(slots, dims) else slots[0]


def _split_state(module: SlotQKV, state: dict[str, Any], prefix: str, *args: Any) -> None:
    for template, fused_name, dims in ((SLOT_WEIGHT, "weight", 2), (SLOT_BIAS, "bias", 1)):
        fused = state.pop(prefix + fused_name, None)
        if fused is None:
            continue
        whole = fused.dim() == dims and fused.numel() > 0
        slots = split_slots(fused, module.num_heads) if whole else [fused] * 3
        for k, slot in enumerate(slots):
            state[prefix + template.format(k)] = slot


def join_qkv_slots(state: dict[str, torch.Tensor], module_state: dict[str, torch.Tensor] | None = None
                   ) -> dict[str, torch.Tensor]:
    """A state dict named by a staged model's parameters (DeepSpeed's ZeRO consolidation) with every
    ``...query_key_value.slot{k}_{weight,bias}`` joined back into ``...query_key_value.{weight,bias}``.
    Slots missing from ``state`` (frozen ones, which ZeRO-1 does not consolidate) come from the fused
    tensors of ``module_state`` (the engine's module state_dict, fused names)."""
    joined: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        match = re.search(r"\.slot[012]_(weight|bias)$", name)
        if match is None:
            joined[name] = tensor
        elif name[: match.start() + 1] + match[1] not in joined:
            prefix, kind = name[: match.start() + 1], match[1]
            joined[prefix + kind] = _join(state, prefix, kind, module_state)
    return joined


def _join(state: dict[str, torch.Tensor], prefix: str, kind: str, module_state: dict[str, torch.Tensor] | None
          ) -> torch.Tensor:
    """The fused ``prefix + kind`` ("weight" or "bias") from its slots in ``state`` (else ``module_state``)."""
    weights = [state[prefix + SLOT_WEIGHT.format(k)] for k in SLOTS if prefix + SLOT_WEIGHT.format(k) in state]
    num_heads = weights[0].shape[0]  # (H, D, C); a stage trains at least one weight slot of a split QKV
    names = [prefix + (SLOT_WEIGHT if kind == "weight" else SLOT_BIAS).format(k) for k in SLOTS]
    if all(name in state for name in names):
        return fuse_slots([state[name] for name in names], num_heads)
    if module_state is None or prefix + kind not in module_state:
        raise ValueError(f"{prefix + kind}: QKV slots missing from the consolidated state and no module copy")
    saved = split_slots(module_state[prefix + kind].float(), num_heads)
    return fuse_slots([state[name] if name in state else saved[k] for k, name in enumerate(names)], num_heads)
