"""Configuration of megatron_lite models exported to Hugging Face (remote code, self-contained).

Two families, each the stock configuration (same field names, same ``rope_parameters``) plus the
position scheme:

    MegatronLiteConfig        GPT-NeoX fields  (model_type megatron_lite_gpt)
    MegatronLiteLlamaConfig   Llama fields     (model_type megatron_lite_llama), plus ``qkv_bias``
                              (biases on q/k/v only, as Qwen2; o_proj never has one). Llama's own
                              ``attention_bias`` and ``mlp_bias`` stay False; ``head_dim`` and
                              ``num_key_value_heads`` (grouped-query attention) are Llama's fields.

    position_scheme   none | learned | sinusoidal | alibi | rope | coca
    coca_constraint   slack | strict   (coca only)

This file is copied next to the weights by ``tools/convert_checkpoint.py --to hf`` and loaded with
``AutoConfig.from_pretrained(path, trust_remote_code=True)``; it needs transformers >= 5, nothing else.
"""

from __future__ import annotations

from transformers import GPTNeoXConfig, LlamaConfig

POSITION_SCHEMES = ("none", "learned", "sinusoidal", "alibi", "rope", "coca")
COCA_CONSTRAINTS = ("slack", "strict")


def check_position_fields(position_scheme: str, coca_constraint: str) -> None:
    if position_scheme not in POSITION_SCHEMES:
        raise ValueError(f"position_scheme={position_scheme!r}: must be one of {', '.join(POSITION_SCHEMES)}")
    if coca_constraint not in COCA_CONSTRAINTS:
        raise ValueError(f"coca_constraint={coca_constraint!r}: must be one of {', '.join(COCA_CONSTRAINTS)}")


class MegatronLiteConfig(GPTNeoXConfig):
    model_type = "megatron_lite_gpt"

    position_scheme: str = "coca"
    coca_constraint: str = "slack"

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        check_position_fields(self.position_scheme, self.coca_constraint)


class MegatronLiteLlamaConfig(LlamaConfig):
    model_type = "megatron_lite_llama"

    position_scheme: str = "coca"
    coca_constraint: str = "slack"
    qkv_bias: bool = False

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        check_position_fields(self.position_scheme, self.coca_constraint)
        # Each key/value head serves a whole group of query heads (grouped-query attention).
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")


__all__ = ["MegatronLiteConfig", "MegatronLiteLlamaConfig"]
