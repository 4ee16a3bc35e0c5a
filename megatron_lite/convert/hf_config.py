"""megatron_lite ``ModelConfig`` <-> Hugging Face ``config.json`` fields (transformers v5 names), both families.

GPT-NeoX family (here): export writes the fields ``GPTNeoXConfig`` writes (hidden_size,
num_attention_heads, ..., ``rope_parameters``) plus ``position_scheme`` and ``coca_constraint``; import
reads ``gpt_neox`` (e.g. Pythia) and ``megatron_lite_gpt`` configs. LLaMA family: ``hf_llama``. RoPE
fields both ways: ``hf_rope``. The public functions dispatch on ``model.architecture`` / ``model_type``.
"""

from __future__ import annotations

from typing import Any

from megatron_lite.config import ModelConfig
from megatron_lite.convert import hf_llama
from megatron_lite.convert.hf_rope import position_section, rope_fields, rope_settings
from megatron_lite.model.variants import variant_of_position

STOCK_MODEL_TYPE = "gpt_neox"
REMOTE_MODEL_TYPE = "megatron_lite_gpt"
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}
ACTIVATIONS_FROM_HF = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "relu": "relu"}
GPT_NEOX_DEFAULT_ROTARY_PCT = 0.25  # what GPTNeoXConfig assumes when a config names none


def uses_stock_model(model: ModelConfig) -> bool:
    """Whether a stock transformers class (GPTNeoX, Llama, Qwen2) expresses the model, or remote code must."""
    return hf_llama.uses_stock_model(model) if model.is_llama else variant_of_position(model.position).stock_gpt_neox


def hf_config_fields(model: ModelConfig) -> dict[str, Any]:
    """The architecture fields of config.json (without token ids, dtype, auto_map)."""
    if model.is_llama:
        return hf_llama.llama_config_fields(model)
    rope_parameters, max_position_embeddings = rope_fields(model)
    return {
        "vocab_size": model.padded_vocab_size,
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "intermediate_size": model.ffn_size,
        "hidden_act": HF_ACTIVATIONS[model.activation],
        "layer_norm_eps": model.layernorm_epsilon,
        "use_parallel_residual": model.gpt_j_residual,
        "tie_word_embeddings": not model.no_weight_tying,
        "max_position_embeddings": max_position_embeddings,
        "rope_parameters": rope_parameters,
        "attention_bias": True,
        "attention_dropout": model.attention_dropout,
        "hidden_dropout": model.hidden_dropout,
        "initializer_range": model.init_method_std,
        "position_scheme": model.position.scheme,
        "coca_constraint": model.position.constraint,
    }


# ----------------------------------------------------------------------------------------------
# Import


def model_section_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The ``model:`` mapping of a megatron_lite config for an HF config.json of either family."""
    model_type = hf.get("model_type")
    if model_type in hf_llama.LLAMA_MODEL_TYPES:
        return hf_llama.llama_model_section(hf)
    if model_type not in (STOCK_MODEL_TYPE, REMOTE_MODEL_TYPE):
        supported = ", ".join(repr(name) for name in (STOCK_MODEL_TYPE, REMOTE_MODEL_TYPE, *hf_llama.LLAMA_MODEL_TYPES))
        raise ValueError(f"config.json model_type={model_type!r}: supported are {supported} (GPT-NeoX/Pythia, "
                         "LLaMA, Mistral, Qwen2 and megatron_lite exports)")
    if not hf.get("attention_bias", True):
        raise ValueError("config.json attention_bias=false: megatron_lite attention always has biases")
    activation = hf.get("hidden_act", "gelu")
    if activation not in ACTIVATIONS_FROM_HF:
        raise ValueError(f"config.json hidden_act={activation!r}: supported are {', '.join(ACTIVATIONS_FROM_HF)}")
    rope = rope_settings(hf, GPT_NEOX_DEFAULT_ROTARY_PCT)
    scheme = hf.get("position_scheme") or ("none" if float(rope["partial_rotary_factor"]) == 0 else "rope")
    position, seq_length, max_positions = position_section(hf, rope, scheme)
    vocab_size = int(hf["vocab_size"])
    return {
        "num_layers": int(hf["num_hidden_layers"]),
        "hidden_size": int(hf["hidden_size"]),
        "num_attention_heads": int(hf["num_attention_heads"]),
        "intermediate_size": int(hf["intermediate_size"]),
        "seq_length": seq_length,
        "max_position_embeddings": max_positions if max_positions != seq_length else None,
        "vocab_size": vocab_size,
        "make_vocab_size_divisible_by": 128 if vocab_size % 128 == 0 else 1,
        "gpt_j_residual": bool(hf.get("use_parallel_residual", True)),
        "layernorm_epsilon": float(hf.get("layer_norm_eps", 1e-5)),
        "activation": ACTIVATIONS_FROM_HF[activation],
        "no_weight_tying": not hf.get("tie_word_embeddings", False),
        "init_method_std": float(hf.get("initializer_range", 0.02)),
        "attention_dropout": float(hf.get("attention_dropout", 0.0)),
        "hidden_dropout": float(hf.get("hidden_dropout", 0.0)),
        "position": position,
    }
