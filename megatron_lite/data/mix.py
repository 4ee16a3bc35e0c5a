"""Mix files (configs/data/*.yml): named groups with token weights, each a set of named sources.

    groups:
      text:
        weight: 0.75
        sources:
          wikipedia: {type: hf, path: wikimedia/wikipedia, name: 20231101.en, streaming: true}
      code:
        weight: 0.25
        sources:
          stdlib: {type: python_code}

Group weights are shares of training tokens. Inside a group, sources take their natural token
proportions unless every source of the group sets ``weight``. The dataclasses live in
``megatron_lite.config.schema``; this module reads and checks the files.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_lite.config import MixConfig, SourceConfig, parse_dataclass
from megatron_lite.config.loading import read_yaml_mapping


def validate_mix(mix: MixConfig, origin: str = "mix") -> MixConfig:
    if not mix.groups:
        raise ValueError(f"{origin}: groups is empty")
    for group_name, group in mix.groups.items():
        if not (group.weight > 0 and math.isfinite(group.weight)):
            raise ValueError(f"{origin}: groups.{group_name}.weight={group.weight}: must be positive")
        if not group.sources:
            raise ValueError(f"{origin}: groups.{group_name}.sources is empty")
        weighted = [name for name, source in group.sources.items() if source.weight is not None]
        if weighted and len(weighted) != len(group.sources):
            raise ValueError(
                f"{origin}: groups.{group_name}: set weight on every source or on none "
                f"(set on {', '.join(weighted)})"
            )
        for source_name, source in group.sources.items():
            key = f"groups.{group_name}.sources.{source_name}"
            if source.weight is not None and not source.weight > 0:
                raise ValueError(f"{origin}: {key}.weight={source.weight}: must be positive")
            if source.type in ("hf", "jsonl", "text", "parquet", "megatron") and not source.path:
                raise ValueError(f"{origin}: {key}.path is required for type {source.type}")
            if source.type == "megatron":
                _check_megatron(source, origin, key)
            elif source.tokenizer is not None:
                raise ValueError(f"{origin}: {key}.tokenizer applies to type megatron only (type is {source.type})")
            if source.max_documents is not None and source.max_documents <= 0:
                raise ValueError(f"{origin}: {key}.max_documents={source.max_documents}: must be positive")
    names = [name for group in mix.groups.values() for name in group.sources]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"{origin}: source names must be unique across groups: {', '.join(duplicates)}")
    return mix


def _check_megatron(source: SourceConfig, origin: str, key: str) -> None:
    """Shards carry token ids, so the tokenizer that made them must be declared (and match the run's)."""
    if not source.tokenizer:
        raise ValueError(f"{origin}: {key}.tokenizer is required for type megatron (the tokenizer "
                         "the shards were tokenised with)")
    if source.max_documents is not None:
        raise ValueError(f"{origin}: {key}.max_documents does not apply to type megatron (shards are read whole); "
                         "remove it")


def megatron_sources(mix: MixConfig) -> list[str]:
    """Names of the mix's sources of type megatron (pre-tokenised shards: no text to train a tokenizer on)."""
    return [name for group in mix.groups.values() for name, source in group.sources.items()
            if source.type == "megatron"]


def load_mix(path: str | Path) -> MixConfig:
    path = Path(path)
    data = read_yaml_mapping(path, f"data.mix={str(path)!r}: file does not exist")
    try:
        return validate_mix(parse_dataclass(MixConfig, data), str(path))
    except ValueError as error:
        message = str(error)
        raise ValueError(message if message.startswith(str(path)) else f"{path}: {message}") from None


def group_weights(mix: MixConfig) -> dict[str, float]:
    """Group token shares normalised to sum to 1."""
    total = sum(group.weight for group in mix.groups.values())
    return {name: group.weight / total for name, group in mix.groups.items()}


# A source read more than this many times while another is read less than once: the mix's sizes and weights
# disagree (repeated text overfits while the other source is not even read through).
REPEAT_WARNING_PASSES = (3.0, 1.0)


@dataclass(frozen=True)
class SourcePasses:
    """What a run draws from one source: ``tokens_drawn`` / ``tokens_held`` passes over its training tokens."""

    name: str
    group: str
    tokens_held: float
    tokens_drawn: float

    @property
    def passes(self) -> float:
        return self.tokens_drawn / self.tokens_held if self.tokens_held > 0 else math.inf


def source_passes(mix: MixConfig, tokens_held: Mapping[str, float], tokens_drawn: float) -> list[SourcePasses]:
    """Per source of ``mix`` (in mix order): the tokens a run of ``tokens_drawn`` tokens takes from it, by the
    blend's rule (group weight x weight inside the group: explicit, or the source's share of the group's tokens)."""
    weights = group_weights(mix)
    rows = []
    for group_name, group in mix.groups.items():
        held = {name: float(tokens_held.get(name, 0.0)) for name in group.sources}
        explicit = {name: source.weight for name, source in group.sources.items() if source.weight is not None}
        inside = explicit if len(explicit) == len(group.sources) else held
        total = sum(inside.values())
        for name in group.sources:
            share = inside[name] / total if total > 0 else 0.0
            rows.append(SourcePasses(name, group_name, held[name], tokens_drawn * weights[group_name] * share))
    return rows


def format_passes(rows: Sequence[SourcePasses]) -> str:
    """One line per source: tokens held, tokens drawn, passes."""
    return "\n".join(f"  {row.name} ({row.group}): {row.tokens_held:,.0f} tokens held, {row.tokens_drawn:,.0f} drawn = "
                     f"{row.passes:.2f} passes" for row in rows)


def repeat_warning(rows: Sequence[SourcePasses]) -> str | None:
    """A one-line warning when one source is read more than 3 times while another is read less than once."""
    most = max(rows, key=lambda row: row.passes, default=None)
    least = min(rows, key=lambda row: row.passes, default=None)
    high, low = REPEAT_WARNING_PASSES
    if most is None or least is None or not (most.passes > high and least.passes < low):
        return None
    return (f"data: {most.name} is read {most.passes:.1f} times while {least.name} is read {least.passes:.2f} times: "
            "the mix's weights and its sources' sizes disagree; set max_documents (or the group weights) so that "
            "every source is read about as often (docs/data_loading.md#epochs-and-passes)")
