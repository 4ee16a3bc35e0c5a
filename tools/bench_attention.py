#!/usr/bin/env python
"""Attention benchmark: CoCA (slack, strict) and ALiBi vs RoPE, time and peak memory per backend.

    python tools/bench_attention.py --json bench_attention.json

One attention layer (QKV projection + position transform + kernel + output projection, plus the
rotary tables) at the 350M width; prints a Markdown table and the target checks, and writes every
record (skipped ones included) to --json. The logic lives in megatron_lite/bench/attention_bench.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_lite.bench.attention_bench import BenchSettings, format_report, run_benchmark
from megatron_lite.cli import cli_main, run_cli


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 512,2048") from None
    if not values or any(value <= 0 for value in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected one or more positive integers")
    return values


def _name_list(text: str) -> tuple[str, ...]:
    values = tuple(part.strip() for part in text.split(",") if part.strip())
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated names, e.g. sdpa,chunked")
    return values


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=None, metavar="OUT.json", help="write the records and run metadata here")
    parser.add_argument("--seq-lens", type=_int_list, default=(512, 2048, 8192), help="comma-separated (default 512,2048,8192)")
    parser.add_argument("--batch-size", type=int, default=1, help="default 1")
    parser.add_argument("--backends", type=_name_list, default=None,
                        help="comma-separated out of sdpa,chunked,reference,flex,flash (default sdpa,chunked,reference, "
                             "plus flex where torch has FlexAttention, plus flash with CUDA + flash-attn)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default cuda if available)")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None, help="default fp32 on cpu, bf16 on cuda")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps; the median is reported (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    parser.add_argument("--mem-budget-gb", type=float, default=None,
                        help="skip configurations whose estimated peak exceeds this (default 8 on cpu, 0.8 x GPU memory)")
    parser.add_argument("--hidden-size", type=int, default=1024, help="default 1024 (the 350M model)")
    parser.add_argument("--num-heads", type=int, default=16, help="default 16 (the 350M model)")
    parser.add_argument("--chunk-size", type=int, default=1024, help="query block of the chunked backend (default 1024)")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)

    settings = BenchSettings(**{name: getattr(args, name) for name in (
        "seq_lens", "batch_size", "backends", "device", "dtype", "repeats", "warmup", "hidden_size", "num_heads",
        "mem_budget_gb", "chunk_size", "seed")})
    if args.json is not None:  # fail now, not after a long run
        args.json.parent.mkdir(parents=True, exist_ok=True)
    result = run_benchmark(settings, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(format_report(result), end="")
    if args.json is not None:
        args.json.write_text(json.dumps(result.to_json(), indent=2) + "\n")
        print(f"\nwrote {len(result.records)} records to {args.json}")
    return 0


if __name__ == "__main__":
    run_cli(main)
