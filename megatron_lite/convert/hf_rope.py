"""RoPE settings both ways: megatron_lite ``model.position`` <-> HF ``rope_parameters`` (both families).

HF computes scalings from config fields rather than from a training length, which decides the values:

* dynamic NTK grows the base relative to ``max_position_embeddings``; ours grows it relative to the
  training length L_train (``scaling.original_max_position_embeddings`` or ``seq_length``), so a
  dynamic export sets ``max_position_embeddings = L_train``;
* YaRN reads ``rope_parameters.original_max_position_embeddings`` (= L_train) and expects
  ``max_position_embeddings = factor * L_train``; ``attention_factor`` (or the mscale / mscale_all_dim
  pair it is computed from) and ``truncate`` are read on import and written on export;
* llama3 reads ``original_max_position_embeddings`` (= L_train), ``low_freq_factor``, ``high_freq_factor``;
* HF has no static NTK type: ``ntk`` is exported as the equivalent ``rope_theta``
  base * factor^(r/(r-2)) with ``rope_type: default``.

Import reads v5 (``rope_parameters``) and v4 (``rope_scaling``, ``rope_theta``, ``rotary_pct``,
``rotary_emb_base``) configs.
"""

from __future__ import annotations

import math
from typing import Any

from megatron_lite.config import ModelConfig
from megatron_lite.model.variants import variant_of, variant_of_position


def rope_fields(model: ModelConfig) -> tuple[dict[str, Any], int]:
    """(rope_parameters, max_position_embeddings) as HF must see them to compute our frequencies."""
    position, scaling = model.position, model.position.scaling
    if variant_of_position(model.position).positionless:  # stock GPT-NeoX with zero rotary dims = no positions at all
        return {"rope_type": "default", "rope_theta": position.rotary_emb_base, "partial_rotary_factor": 0.0}, model.max_positions
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": position.rotary_emb_base,
                              "partial_rotary_factor": position.rotary_pct}
    kind = scaling.type if model.uses_rotary else "none"
    max_positions = model.max_positions
    train_length = model.rotary_train_length
    if kind == "linear":
        params.update(rope_type="linear", factor=scaling.factor)
    elif kind == "ntk":
        dims = model.rotary_dims
        params["rope_theta"] = position.rotary_emb_base * scaling.factor ** (dims / (dims - 2))
    elif kind == "dynamic":
        params.update(rope_type="dynamic", factor=scaling.factor)
        max_positions = train_length
    elif kind == "yarn":
        params.update(rope_type="yarn", factor=scaling.factor, original_max_position_embeddings=train_length,
                      beta_fast=scaling.beta_fast, beta_slow=scaling.beta_slow, truncate=scaling.truncate)
        if scaling.attention_factor is not None:  # absent: HF's default, the same as ours
            params["attention_factor"] = scaling.attention_factor
        max_positions = math.ceil(train_length * scaling.factor)
    elif kind == "llama3":
        params.update(rope_type="llama3", factor=scaling.factor, original_max_position_embeddings=train_length,
                      low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor)
    return params, max_positions


def rope_settings(hf: dict[str, Any], default_rotary_pct: float) -> dict[str, Any]:
    """rope_parameters of a v5 config, or the equivalent built from v4 keys."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", hf.get("rope_theta", hf.get("rotary_emb_base", 10000.0)))
    params.setdefault("partial_rotary_factor", hf.get("partial_rotary_factor", hf.get("rotary_pct", default_rotary_pct)))
    return params


def yarn_scaling(rope: dict[str, Any], implicit_factor: float) -> dict[str, Any]:
    """``model.position.scaling`` for HF YaRN parameters, as _compute_yarn_parameters reads them: a null
    factor is max_position_embeddings / original_max_position_embeddings; the attention factor is
    ``attention_factor``, else mscale / mscale_all_dim's ratio when both are set, else HF's default (null)."""
    factor = float(rope["factor"]) if rope.get("factor") is not None else implicit_factor
    attention_factor = rope.get("attention_factor")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if attention_factor is None and mscale and mscale_all_dim and factor > 1:
        attention_factor = (0.1 * mscale * math.log(factor) + 1.0) / (0.1 * mscale_all_dim * math.log(factor) + 1.0)
    return {"type": "yarn", "factor": factor, "beta_fast": float(rope.get("beta_fast") or 32),
            "beta_slow": float(rope.get("beta_slow") or 1), "truncate": bool(rope.get("truncate", True)),
            "attention_factor": float(attention_factor) if attention_factor is not None else None}


def position_section(hf: dict[str, Any], rope: dict[str, Any], scheme: str) -> tuple[dict[str, Any], int, int]:
    """(``model.position`` mapping, seq_length, max_position_embeddings) for an HF config's rope settings."""
    max_positions = int(hf.get("max_position_embeddings", 2048))
    seq_length, scaling = max_positions, {"type": "none"}
    kind = rope["rope_type"]
    variant = variant_of(scheme, hf.get("coca_constraint", "slack"))
    if variant.rotary:
        if kind in ("linear", "dynamic"):
            scaling = {"type": kind, "factor": float(rope["factor"])}
        elif kind == "yarn":
            seq_length = int(rope.get("original_max_position_embeddings") or max_positions)
            scaling = yarn_scaling(rope, max_positions / seq_length)
        elif kind == "llama3":
            # Llama-3.1: trained at 8K, declared for 128K; train at the original length by default.
            seq_length = int(rope["original_max_position_embeddings"])
            scaling = {"type": "llama3", "factor": float(rope["factor"]), "original_max_position_embeddings": seq_length,
                       "low_freq_factor": float(rope.get("low_freq_factor", 1.0)),
                       "high_freq_factor": float(rope.get("high_freq_factor", 4.0))}
        elif kind != "default":
            raise ValueError(f"config.json rope_parameters.rope_type={kind!r}: supported are default, linear, dynamic, "
                             "yarn, llama3")
    position: dict[str, Any] = {"scheme": variant.scheme, "constraint": variant.constraint, "scaling": scaling,
                                "rotary_emb_base": float(rope["rope_theta"])}
    if not variant.positionless:  # written for every scheme by our exporter; only rotary schemes use it
        position["rotary_pct"] = float(rope["partial_rotary_factor"])
    return position, seq_length, max_positions
