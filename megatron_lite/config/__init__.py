"""Typed configuration: the schema of every section (``schema``) and reading/checking it (``loading``).

``from megatron_lite.config import Config, load`` is the public surface; ``python -m
megatron_lite.config --doc`` prints docs/config.md.
"""

from megatron_lite.config.loading import (
    apply_overrides,
    documentation,
    documentation_page,
    from_dict,
    load,
    parse_dataclass,
    parse_override,
    save,
    to_dict,
    validate,
    with_overrides,
)
from megatron_lite.config.schema import (
    BACKENDS,
    CONSTRAINTS,
    ROTARY_SCHEMES,
    SCALING_TYPES,
    SCHEMES,
    AttentionConfig,
    Config,
    DataConfig,
    ExtrapolationEvalConfig,
    FaultInjectionConfig,
    GroupConfig,
    MixConfig,
    ModelConfig,
    PositionConfig,
    ProfileConfig,
    RopeScalingConfig,
    SourceConfig,
    TokenizerConfig,
    TrainConfig,
    WandbConfig,
)

__all__ = [
    "BACKENDS", "CONSTRAINTS", "ROTARY_SCHEMES", "SCALING_TYPES", "SCHEMES",
    "AttentionConfig", "Config", "DataConfig", "ExtrapolationEvalConfig", "FaultInjectionConfig", "GroupConfig",
    "MixConfig", "ModelConfig", "PositionConfig", "ProfileConfig", "RopeScalingConfig", "SourceConfig",
    "TokenizerConfig", "TrainConfig", "WandbConfig",
    "apply_overrides", "documentation", "documentation_page", "from_dict", "load", "parse_dataclass",
    "parse_override", "save", "to_dict", "validate", "with_overrides",
]
