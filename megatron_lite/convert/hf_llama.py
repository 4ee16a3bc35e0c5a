"""LLaMA family ``config.json`` fields both ways: ``LlamaConfig`` / ``Qwen2Config`` / ``MistralConfig``
(import) and ``megatron_lite_llama`` (our remote-code exports of schemes the stock classes lack).

Stock classes on export: RoPE over the whole head is ``LlamaForCausalLM``, or ``Qwen2ForCausalLM`` when
the model has q/k/v biases; every other scheme (CoCA, ALiBi, learned, sinusoidal, none) or a partial
rotary fraction needs remote code. Mistral maps onto llama when it has no sliding window
(``sliding_window: null``); a windowed Mistral or Qwen2 is refused rather than silently changed, even
when the window equals max_position_embeddings (it still acts on longer inputs).
"""

from __future__ import annotations

from typing import Any

from megatron_lite.config import ModelConfig
from megatron_lite.convert.hf_rope import position_section, rope_fields, rope_settings
from megatron_lite.model.variants import variant_of_position

STOCK_LLAMA_TYPE = "llama"
STOCK_QWEN2_TYPE = "qwen2"
REMOTE_LLAMA_TYPE = "megatron_lite_llama"
LLAMA_MODEL_TYPES = (STOCK_LLAMA_TYPE, "mistral", STOCK_QWEN2_TYPE, REMOTE_LLAMA_TYPE)


def uses_stock_model(model: ModelConfig) -> bool:
    return variant_of_position(model.position).stock_llama and model.position.rotary_pct == 1.0


def stock_model_type(model: ModelConfig) -> str:
    """qwen2 for q/k/v biases (Qwen2's attention always has them), llama otherwise."""
    return STOCK_QWEN2_TYPE if model.qkv_bias else STOCK_LLAMA_TYPE


def llama_config_fields(model: ModelConfig) -> dict[str, Any]:
    """The architecture fields of a llama-family config.json (without token ids, dtype, auto_map)."""
    rope_parameters, max_position_embeddings = rope_fields(model)
    if rope_parameters.get("partial_rotary_factor") == 1.0:
        del rope_parameters["partial_rotary_factor"]  # the stock classes' default; they reject nothing else
    return {
        "vocab_size": model.padded_vocab_size,
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.kv_heads,
        "head_dim": model.head_dim,
        "intermediate_size": model.ffn_size,
        "hidden_act": "silu",
        "rms_norm_eps": model.layernorm_epsilon,
        "tie_word_embeddings": not model.no_weight_tying,
        "max_position_embeddings": max_position_embeddings,
        "rope_parameters": rope_parameters,
        "attention_bias": False,  # Llama's flag also puts a bias on o_proj; q/k/v biases are qkv_bias
        "mlp_bias": False,
        "qkv_bias": model.qkv_bias,
        "attention_dropout": model.attention_dropout,
        "initializer_range": model.init_method_std,
        "position_scheme": model.position.scheme,
        "coca_constraint": model.position.constraint,
    }


def _refuse_unsupported(hf: dict[str, Any]) -> None:
    model_type = hf["model_type"]
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act={hf['hidden_act']!r}: the llama family here is SwiGLU (silu)")
    if hf.get("mlp_bias"):
        raise ValueError("config.json mlp_bias=true: llama-family MLPs here have no biases")
    if hf.get("attention_bias") and model_type != STOCK_QWEN2_TYPE:
        raise ValueError("config.json attention_bias=true (biases on q/k/v and o_proj): only q/k/v biases (Qwen2) are "
                         "supported")
    window = sliding_window(hf)
    if window is not None:
        raise ValueError(f"config.json sliding_window={window}: sliding-window attention is not supported (only full "
                         "attention), and the window acts on every input longer than it, whatever "
                         "max_position_embeddings says")


def sliding_window(hf: dict[str, Any]) -> int | None:
    """The attention window transformers applies for this config, None for full attention: Mistral's
    ``sliding_window`` whenever set; Qwen2's only with ``use_sliding_window`` and a ``sliding_attention``
    layer (``layer_types``, by default the layers from ``max_window_layers`` = 28 on)."""
    window = hf.get("sliding_window")
    if window is None or hf["model_type"] == "mistral":
        return window
    if not hf.get("use_sliding_window", False):
        return None
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    return window if int(hf["num_hidden_layers"]) > int(hf.get("max_window_layers", 28)) else None


def llama_model_section(hf: dict[str, Any]) -> dict[str, Any]:
    """The ``model:`` mapping of a megatron_lite config for a llama / mistral / qwen2 / megatron_lite_llama config."""
    _refuse_unsupported(hf)
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    head_dim = int(hf.get("head_dim") or hidden // heads)
    rope = rope_settings(hf, 1.0)
    position, seq_length, max_positions = position_section(hf, rope, hf.get("position_scheme") or "rope")
    vocab_size = int(hf["vocab_size"])
    return {
        "architecture": "llama",
        "num_layers": int(hf["num_hidden_layers"]),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads if kv_heads != heads else None,
        "kv_channels": head_dim if head_dim * heads != hidden else None,
        "qkv_bias": hf["model_type"] == STOCK_QWEN2_TYPE or bool(hf.get("qkv_bias", False)),
        "intermediate_size": int(hf["intermediate_size"]),
        "seq_length": seq_length,
        "max_position_embeddings": max_positions if max_positions != seq_length else None,
        "vocab_size": vocab_size,
        "make_vocab_size_divisible_by": 128 if vocab_size % 128 == 0 else 1,
        "layernorm_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
        "no_weight_tying": not hf.get("tie_word_embeddings", False),
        "init_method_std": float(hf.get("initializer_range", 0.02)),
        "attention_dropout": float(hf.get("attention_dropout", 0.0)),
        "position": position,
    }
