"""Staged fine-tuning (``train.stages``): which parameters train in which stage, and the model surgery
that gives frozen parameters -- and frozen rows of a fused QKV weight -- no optimizer state.

Frozen whole tensors get ``requires_grad=False`` and stay out of the optimizer, so DeepSpeed (ZeRO 0-3)
holds no fp32 copy, gradient or Adam moments for them. A fused GPT-NeoX ``query_key_value`` of which only
some slots train is replaced for the stage by ``SlotQKV`` (``megatron_lite.model.qkv_slots``): the three
per-head-interleaved slots as separate parameters (the trainable ones in the optimizer, the others frozen),
assembled into the fused weight in forward, with the fused names and layout in its state_dict.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from megatron_lite.config import TrainConfig
from megatron_lite.model.qkv_slots import SLOTS, SlotQKV

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
