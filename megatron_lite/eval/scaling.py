"""The evaluation tools' list flags: RoPE scaling specs (``none``, ``dynamic:4``, ...; defined in
megatron_lite.config.scaling_spec, which config validation shares) and lists of positive integers."""

from __future__ import annotations

from megatron_lite.config.scaling_spec import NO_SCALING, ScalingSpec, parse_scaling, parse_scaling_list

__all__ = ["NO_SCALING", "ScalingSpec", "parse_int_list", "parse_scaling", "parse_scaling_list"]


def parse_int_list(text: str, flag: str) -> list[int]:
    """Comma-separated positive integers, sorted and unique; ValueError naming the flag."""
    values: set[int] = set()
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            value = int(item)
        except ValueError:
            raise ValueError(f"{flag} {text!r}: {item!r} is not an integer") from None
        if value <= 0:
            raise ValueError(f"{flag} {text!r}: {value} must be positive")
        values.add(value)
    if not values:
        raise ValueError(f"{flag} {text!r}: no value given")
    return sorted(values)
