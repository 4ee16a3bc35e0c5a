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
