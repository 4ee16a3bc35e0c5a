"""RoPE scaling specs as written on a command line or in a config: ``none``, ``dynamic:4``, ``linear:4``,
``ntk:2``, ``yarn:4``.

A spec names an inference-time scaling (megatron_lite.model.rope) and its factor. Scalings need a
rotary scheme (rope, coca); for other schemes only ``none`` applies and the rest are skipped. Part of the
config package, so that config validation (train.extrapolation_eval.scalings) parses them as the tools do.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lite.config.schema import SCALING_TYPES, RopeScalingConfig


@dataclass(frozen=True)
class ScalingSpec:
    name: str  # as written on the command line, canonical: "none" or "<type>:<factor>"
    type: str
    factor: float

    def config(self) -> RopeScalingConfig:
        # original_max_position_embeddings stays None: the model's training length (model.seq_length).
        return RopeScalingConfig(type=self.type, factor=self.factor)  # type: ignore[arg-type]


NO_SCALING = ScalingSpec("none", "none", 1.0)


def parse_scaling(text: str, flag: str = "--scaling") -> ScalingSpec:
    """'none' or 'TYPE:FACTOR' (factor >= 1); ValueError naming the flag and the value."""
    text = text.strip()
    if text == "none":
        return NO_SCALING
    kind, _, factor_text = text.partition(":")
    if kind not in SCALING_TYPES or not factor_text:
        raise ValueError(f"{flag} {text!r}: expected none or TYPE:FACTOR with TYPE in {', '.join(SCALING_TYPES)} "
                         "(e.g. dynamic:4)")
    try:
        factor = float(factor_text)
    except ValueError:
        raise ValueError(f"{flag} {text!r}: factor {factor_text!r} is not a number") from None
    if not factor >= 1.0:
        raise ValueError(f"{flag} {text!r}: factor must be >= 1")
    return ScalingSpec(f"{kind}:{factor:g}", kind, factor)


def parse_scaling_list(text: str, flag: str = "--scaling") -> list[ScalingSpec]:
    """Comma-separated specs, duplicates removed, order kept."""
    specs: list[ScalingSpec] = []
    for item in text.split(","):
        if item.strip():
            spec = parse_scaling(item, flag)
            if spec not in specs:
                specs.append(spec)
    if not specs:
        raise ValueError(f"{flag} {text!r}: no scaling given")
    return specs
