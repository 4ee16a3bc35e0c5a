"""Staged fine-tuning (``train.stages``): which parameters train in which stage, and the model surgery
that gives frozen parameters -- and frozen rows of a fused QKV weight -- no optimizer state.

Frozen whole tensors get ``requires_grad=False`` and stay out of the optimizer, so DeepSpeed (ZeRO 0-3)
holds no fp32 copy, gradient or Adam moments for them. A fused GPT-NeoX ``query_key_value`` of which only
some slots train is replaced for the stage by ``SlotQKV``: the three per-head-interleaved slots as separate
parameters (the trainable ones in the optimizer, the others frozen), assembled into the fused weight in
forward. Its state_dict keeps the fused names and layout, and ``join_qkv_slots`` does the same for the
names DeepSpeed's ZeRO consolidation produces, so checkpoints and consolidated weights look as without
stages.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.config import TrainConfig

SLOTS = (0, 1, 2)  # q, k (CoCA's t), v
SLOT_LABELS = ("q", "k", "v")
SLOT_WEIGHT = "slot{}_weight"  # (H, D, C): one slot's rows of every head
SLOT_BIAS = "slot{}_bias"  # (H * D,): 1-D, so weight-decay groups treat it as a bias
_SLOT_PATTERN = re.compile(r"^(?P<module>.*query_key_value)\[(?P<slot>[^\]]*)\]$")


# ----------------------------------------------------------------------------------------------
# The plan: stages over steps


@dataclass(frozen=True)
class Stage:
    index: int  # 0-based
    start: int  # first optimizer step of the stage (0-based)
    steps: int
    trainable: tuple[str, ...]
    lr: float  # peak learning rate

    @property
    def end(self) -> int:
        return self.start + self.steps

    def label(self, count: int) -> str:
        """'stage 2/3 (steps 11-20)', steps 1-based as in the log lines."""
        return f"stage {self.index + 1}/{count} (steps {self.start + 1}-{self.end})"


def plan_stages(train: TrainConfig) -> list[Stage]:
    """train.stages laid end to end; empty without stages."""
    stages, start = [], 0
    for index, stage in enumerate(train.stages):
        stages.append(Stage(index, start, stage.steps, tuple(stage.trainable),
                            stage.lr if stage.lr is not None else train.lr))
        start += stage.steps
    return stages


def stage_at(stages: list[Stage], step: int) -> Stage:
    """The stage that optimizer step ``step`` (0-based) belongs to; the last stage from its end on."""
    for stage in stages:
        if step < stage.end:
            return stage
    return stages[-1]


# ----------------------------------------------------------------------------------------------
# Fused QKV slots


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


def complete_zero_state(state: dict[str, torch.Tensor], module_state: dict[str, torch.Tensor]
                        ) -> dict[str, torch.Tensor]:
    """DeepSpeed's ZeRO consolidation of a checkpoint made model-shaped: QKV slots joined, and tensors it
    leaves out (ZeRO-1 keeps no copy of parameters outside the optimizer) taken from the module's own
    state_dict, which ZeRO-1/2 save whole (ZeRO-3 saves frozen fragments, which DeepSpeed consolidates)."""
    joined = join_qkv_slots(state, module_state)
    for name, tensor in module_state.items():
        if name not in joined and tensor.numel() > 0:
            joined[name] = tensor
    return joined


# ----------------------------------------------------------------------------------------------
# Selecting and freezing


@dataclass
class Selection:
    """What one stage trains, resolved against a model's parameter names."""

    whole: set[str]  # parameters that train entirely
    slots: dict[str, tuple[frozenset[int], frozenset[int]]]  # fused QKV module -> trainable (weight, bias) slots
    trainable: int  # trainable elements
    total: int  # all elements (unique parameters)


def _examples(names: list[str], limit: int = 8) -> str:
    """A few real parameter names: the top-level ones and those of the first layer."""
    shown = ([name for name in names if not name.startswith("layers.")]
             + [name for name in names if name.startswith("layers.0.")])[:limit]
    return ", ".join(shown) + (", ..." if len(names) > len(shown) else "")


def _parse_slot(pattern: str, key: str) -> tuple[str, int] | None:
    match = _SLOT_PATTERN.match(pattern)
    if match is None:
        return None
    if match["slot"] not in ("0", "1", "2"):
        raise ValueError(f"{key}={pattern!r}: the slot of query_key_value[k] must be 0 (q), 1 (k; CoCA's t) or 2 (v)")
    return match["module"], int(match["slot"])


def select(model: nn.Module, patterns: Iterable[str], key: str) -> Selection:
    """Resolve a stage's patterns (``key`` names it in errors, e.g. train.stages[1].trainable)."""
    parameters = dict(model.named_parameters())
    names = list(parameters)
    fused = [name for name, module in model.named_modules()
             if name.endswith("query_key_value") and isinstance(module, nn.Linear)]
    whole: set[str] = set()
    weight_slots: dict[str, set[int]] = {name: set() for name in fused}
    bias_slots: dict[str, set[int]] = {name: set() for name in fused}
    for position, pattern in enumerate(patterns):
        slot = _parse_slot(pattern, f"{key}[{position}]")
        if slot is not None:
            matched = [name for name in fused if fnmatch.fnmatchcase(name, slot[0])]
            for name in matched:
                weight_slots[name].add(slot[1])
                if f"{name}.bias" in parameters:
                    bias_slots[name].add(slot[1])
        else:
            matched = [name for name in names if fnmatch.fnmatchcase(name, pattern)]
            whole.update(matched)
        if not matched:
            what = "fused query_key_value module" if slot is not None else "parameter"
            raise ValueError(f"{key}[{position}]={pattern!r} matches no {what}; parameter names: {_examples(names)}")
    slots: dict[str, tuple[frozenset[int], frozenset[int]]] = {}
    for name in fused:
        weight, bias = f"{name}.weight", f"{name}.bias"
        chosen_weight = set(SLOTS) if weight in whole else weight_slots[name]
        chosen_bias = set(SLOTS) if bias in whole else bias_slots[name] if bias in parameters else set()
        partial = chosen_weight not in (set(), set(SLOTS)) or chosen_bias not in (set(), set(SLOTS))
        if partial:
            slots[name] = (frozenset(chosen_weight), frozenset(chosen_bias))
            whole -= {weight, bias}
        else:  # all or nothing: an ordinary (frozen or trainable) tensor
            whole |= {weight} if chosen_weight else set()
            whole |= {bias} if chosen_bias else set()
    trainable = sum(parameters[name].numel() for name in whole)
    for name, (weight, bias) in slots.items():
        trainable += parameters[f"{name}.weight"].numel() * len(weight) // 3
        if f"{name}.bias" in parameters:
            trainable += parameters[f"{name}.bias"].numel() * len(bias) // 3
    return Selection(whole, slots, trainable, sum(parameter.numel() for parameter in parameters.values()))


def apply_selection(model: nn.Module, selection: Selection) -> None:
    """Freeze what the stage does not train and split partly trained fused QKV modules into slots."""
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name in selection.whole)
    for name, (weight_slots, bias_slots) in selection.slots.items():
        parent_name, attribute = name.rsplit(".", 1)
        parent = model.get_submodule(parent_name)
        setattr(parent, attribute, SlotQKV(getattr(parent, attribute), parent.num_heads, weight_slots, bias_slots))


def stage_summary(stage: Stage, count: int, selection: Selection) -> str:
    """The stage's start-up line: its steps, trainable count and patterns."""
    share = 100.0 * selection.trainable / max(selection.total, 1)
    return (f"{stage.label(count)}: trainable {selection.trainable:,} of {selection.total:,} parameters "
            f"({share:.1f}%): {', '.join(stage.trainable)}; lr {stage.lr:g}")


def trainable_elements(model: nn.Module) -> int:
    """Elements the optimizer sees (unique parameters with requires_grad)."""
    return sum(parameter.numel() for parameter in model.parameters() if parameter.requires_grad)
