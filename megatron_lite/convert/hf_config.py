"""megatron_lite ``ModelConfig`` <-> Hugging Face GPT-NeoX ``config.json`` fields (transformers v5 names).

Export writes the fields ``GPTNeoXConfig`` writes (hidden_size, num_attention_heads, ...,
``rope_parameters``) plus ``position_scheme`` and ``coca_constraint``. Two RoPE facts decide the
values, because HF computes scalings from config fields rather than from a training length:

* dynamic NTK grows the base relative to ``max_position_embeddings``; ours grows it relative to the
  training length L_train (``scaling.original_max_position_embeddings`` or ``seq_length``), so a
  dynamic export sets ``max_position_embeddings = L_train``;
* YaRN reads ``rope_parameters.original_max_position_embeddings`` (= L_train) and expects
  ``max_position_embeddings = factor * L_train``;
* HF has no static NTK type: ``ntk`` is exported as the equivalent ``rope_theta``
  base * factor^(r/(r-2)) with ``rope_type: default``.

Import reads v5 (``rope_parameters``) and v4 (``rope_scaling``, ``rotary_pct``, ``rotary_emb_base``)
configs of ``gpt_neox`` (e.g. Pythia) and ``megatron_lite_gpt`` models.
"""

from __future__ import annotations

import math
from typing import Any

from megatron_lite.config import ROTARY_SCHEMES, ModelConfig

STOCK_MODEL_TYPE = "gpt_neox"
REMOTE_MODEL_TYPE = "megatron_lite_gpt"
STOCK_SCHEMES = ("none", "rope")  # expressible by the stock GPTNeoXForCausalLM
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}
ACTIVATIONS_FROM_HF = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "relu": "relu"}
GPT_NEOX_DEFAULT_ROTARY_PCT = 0.25  # what GPTNeoXConfig assumes when a config names none


def uses_stock_model(model: ModelConfig) -> bool:
    return model.position.scheme in STOCK_SCHEMES


def rope_fields(model: ModelConfig) -> tuple[dict[str, Any], int]:
    """(rope_parameters, max_position_embeddings) as HF must see them to compute our frequencies."""
    position, scaling = model.position, model.position.scaling
    if model.position.scheme == "none":  # stock GPT-NeoX with zero rotary dims = no positions at all
        return {"rope_type": "default", "rope_theta": position.rotary_emb_base, "partial_rotary_factor": 0.0}, model.max_positions
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": position.rotary_emb_base,
                              "partial_rotary_factor": position.rotary_pct}
    kind = scaling.type if model.uses_rotary else "none"
    max_positions = model.max_positions
    if kind == "linear":
        params.update(rope_type="linear", factor=scaling.factor)
    elif kind == "ntk":
        dims = model.rotary_dims
        params["rope_theta"] = position.rotary_emb_base * scaling.factor ** (dims / (dims - 2))
    elif kind == "dynamic":
        params.update(rope_type="dynamic", factor=scaling.factor)
        max_positions = model.rotary_train_length
    elif kind == "yarn":
        train_length = model.rotary_train_length
        params.update(rope_type="yarn", factor=scaling.factor, original_max_position_embeddings=train_length,
                      beta_fast=scaling.beta_fast, beta_slow=scaling.beta_slow)
        max_positions = math.ceil(train_length * scaling.factor)
    return params, max_positions


def hf_config_fields(model: ModelConfig) -> dict[str, Any]:
    """The architecture fields of config.json (without token ids, dtype, auto_map)."""
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


def _rope_settings(hf: dict[str, Any]) -> dict[str, Any]:
    """rope_parameters of a v5 config, or the equivalent built from v4 keys."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", hf.get("rope_theta", hf.get("rotary_emb_base", 10000.0)))
    params.setdefault("partial_rotary_factor", hf.get("partial_rotary_factor", hf.get("rotary_pct", GPT_NEOX_DEFAULT_ROTARY_PCT)))
    return params


def model_section_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The ``model:`` mapping of a megatron_lite config for an HF GPT-NeoX / megatron_lite_gpt config.json."""
    model_type = hf.get("model_type")
    if model_type not in (STOCK_MODEL_TYPE, REMOTE_MODEL_TYPE):
        raise ValueError(f"config.json model_type={model_type!r}: only {STOCK_MODEL_TYPE!r} (GPT-NeoX, e.g. Pythia) "
                         f"and {REMOTE_MODEL_TYPE!r} models can be converted")
    if not hf.get("attention_bias", True):
        raise ValueError("config.json attention_bias=false: megatron_lite attention always has biases")
    activation = hf.get("hidden_act", "gelu")
    if activation not in ACTIVATIONS_FROM_HF:
        raise ValueError(f"config.json hidden_act={activation!r}: supported are {', '.join(ACTIVATIONS_FROM_HF)}")
    rope = _rope_settings(hf)
    rotary_pct = float(rope["partial_rotary_factor"])
    scheme = hf.get("position_scheme") or ("none" if rotary_pct == 0 else "rope")
    max_positions = int(hf.get("max_position_embeddings", 2048))
    seq_length, scaling = max_positions, {"type": "none"}
    kind = rope["rope_type"]
    if scheme in ROTARY_SCHEMES:
        if kind == "linear":
            scaling = {"type": "linear", "factor": float(rope["factor"])}
        elif kind == "dynamic":
            scaling = {"type": "dynamic", "factor": float(rope["factor"])}
        elif kind == "yarn":
            seq_length = int(rope.get("original_max_position_embeddings") or max_positions)
            scaling = {"type": "yarn", "factor": float(rope["factor"]), "beta_fast": float(rope.get("beta_fast") or 32),
                       "beta_slow": float(rope.get("beta_slow") or 1)}
        elif kind != "default":
            raise ValueError(f"config.json rope_parameters.rope_type={kind!r}: supported are default, linear, dynamic, yarn")
    vocab_size = int(hf["vocab_size"])
    position: dict[str, Any] = {"scheme": scheme, "scaling": scaling, "rotary_emb_base": float(rope["rope_theta"])}
    if scheme != "none":  # written for every scheme by our exporter; only rope/coca use it
        position["rotary_pct"] = rotary_pct
    if scheme == "coca":
        position["constraint"] = hf.get("coca_constraint", "slack")
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
