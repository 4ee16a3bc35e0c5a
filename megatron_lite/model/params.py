"""Parameter-count report: analytic formula next to the count of an instantiated (meta) model.

    python -m megatron_lite.model.params configs/coca_350m.yml [more.yml ...]
"""

from __future__ import annotations

import argparse

import torch

from megatron_lite import config as config_lib
from megatron_lite.config import ModelConfig
from megatron_lite.model.gpt import GPT
from megatron_lite.model.variants import variant_of_position


def analytic_parameter_count(model: ModelConfig) -> int:
    """Closed form for either block family; position schemes add only the learned table."""
    h, f, vocab = model.hidden_size, model.ffn_size, model.padded_vocab_size
    if model.is_llama:
        query, kv = model.num_attention_heads * model.head_dim, model.kv_heads * model.head_dim
        per_layer = (
            h * query + 2 * h * kv  # q_proj, k_proj (CoCA's T), v_proj
            + ((query + 2 * kv) if model.qkv_bias else 0)
            + query * h  # o_proj
            + 3 * h * f  # gate_proj, up_proj, down_proj
            + 2 * h  # two RMSNorms
        )
        final_norm = h
    else:
        per_layer = (
            3 * h * h + 3 * h  # query_key_value (q, k-or-t, v)
            + h * h + h  # attention.dense
            + h * f + f + f * h + h  # mlp
            + 4 * h  # two LayerNorms
        )
        final_norm = 2 * h
    total = vocab * h + model.num_layers * per_layer + final_norm
    if model.no_weight_tying:
        total += vocab * h
    if variant_of_position(model.position).position_table:
        total += model.max_positions * h
    return total


def counted_parameter_count(model: ModelConfig) -> int:
    """Instantiate on the meta device (no memory) and count unique parameters."""
    with torch.device("meta"):
        instance = GPT(model)
    return sum(parameter.numel() for parameter in instance.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("configs", nargs="+", help="YAML config files")
    args = parser.parse_args()
    print("| config | scheme | layers | hidden | heads | padded vocab | analytic | counted |")
    print("|---|---|---|---|---|---|---|---|")
    for path in args.configs:
        model = config_lib.load(path).model
        scheme = model.position.label
        analytic, counted = analytic_parameter_count(model), counted_parameter_count(model)
        print(f"| {path} | {scheme} | {model.num_layers} | {model.hidden_size} | {model.num_attention_heads} | "
              f"{model.padded_vocab_size} | {analytic:,} | {counted:,} |")


if __name__ == "__main__":
    main()
