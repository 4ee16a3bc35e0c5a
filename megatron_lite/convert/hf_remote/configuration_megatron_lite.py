"""Configuration of megatron_lite GPT models exported to Hugging Face (remote code, self-contained).

A GPT-NeoX configuration (same field names, same ``rope_parameters``) plus the position scheme:

    position_scheme   none | learned | sinusoidal | alibi | rope | coca
    coca_constraint   slack | strict   (coca only)

This file is copied next to the weights by ``tools/convert_checkpoint.py --to hf`` and loaded with
``AutoConfig.from_pretrained(path, trust_remote_code=True)``; it needs transformers >= 5, nothing else.
"""

from __future__ import annotations

from transformers import GPTNeoXConfig

POSITION_SCHEMES = ("none", "learned", "sinusoidal", "alibi", "rope", "coca")
COCA_CONSTRAINTS = ("slack", "strict")


class MegatronLiteConfig(GPTNeoXConfig):
    model_type = "megatron_lite_gpt"

    position_scheme: str = "coca"
    coca_constraint: str = "slack"

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.position_scheme not in POSITION_SCHEMES:
            raise ValueError(f"position_scheme={self.position_scheme!r}: must be one of {', '.join(POSITION_SCHEMES)}")
        if self.coca_constraint not in COCA_CONSTRAINTS:
            raise ValueError(f"coca_constraint={self.coca_constraint!r}: must be one of {', '.join(COCA_CONSTRAINTS)}")


__all__ = ["MegatronLiteConfig"]
