"""SDPA with ALiBi's bias in float32 (what the model passes) against the same bias rounded to bf16, bf16 q/k/v,
forward + backward on CPU, the two interleaved so that a shared machine's load falls on both alike.

    python -m dev.alibi_bias_timing [--seq-lens 512 2048] [--heads 16] [--head-dim 64] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from megatron_lite.model.masks import sdpa_mask
from megatron_lite.model.position import alibi_slopes


def time_step(q_BHTD: torch.Tensor, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor, bias_1HTT: torch.Tensor) -> float:
    start = time.perf_counter()
    F.scaled_dot_product_attention(q_BHTD, k_BHTD, v_BHTD, attn_mask=bias_1HTT).sum().backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7, help="timed pairs; the first is dropped as warm-up")
    args = parser.parse_args()
    torch.manual_seed(0)
    print("| tokens | float32 bias | bf16 bias |\n|---:|---:|---:|")
    for length in args.seq_lens:
        positions = torch.arange(length)
        float32_bias = sdpa_mask(positions, positions, torch.tensor(alibi_slopes(args.heads)), torch.bfloat16)
        biases = {"float32": float32_bias, "bf16": float32_bias.to(torch.bfloat16)}
        q_BHTD, k_BHTD, v_BHTD = (torch.randn(1, args.heads, length, args.head_dim, dtype=torch.bfloat16,
                                              requires_grad=True) for _ in range(3))
        times: dict[str, list[float]] = {name: [] for name in biases}
        for _ in range(args.repeats):
            for name, bias in biases.items():
                times[name].append(time_step(q_BHTD, k_BHTD, v_BHTD, bias))
        medians = {name: statistics.median(seconds[1:]) * 1000 for name, seconds in times.items()}
        print(f"| {length:,} | {medians['float32']:.1f} ms | {medians['bf16']:.1f} ms |", flush=True)


if __name__ == "__main__":
    main()
