#!/usr/bin/env python
"""Training-throughput benchmark: our tiny RoPE GPT vs Hugging Face GPTNeoXForCausalLM of identical
dimensions and batch (target >= 1.0x), our CoCA slack/strict vs our RoPE (target >= 0.95x); every
position scheme's training step compiled (model.compile(), inductor) vs eager (target >= 1.0x); with a
GPU, tokens/s, TFLOP/s and MFU of the 350M config in bf16.

    python tools/bench_train.py [--json OUT.json] [--config configs/tiny/rope.yml] [--rounds 5] [--no-compile]

Sequence-parallel mode: per-rank peak memory and tokens/s of a wide tiny model at one long sequence, for
each sequence-parallel size (one launch of P ranks each; megatron_lite/bench/sequence_parallel_bench.py):

    python tools/bench_train.py --sequence-parallel 1,2,4 [--sequence-length 8192] [--json OUT.json]

The logic lives in megatron_lite/bench/train_bench.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from megatron_lite.bench.train_bench import (
    COMPILE_SCHEMES,
    TrainBenchSettings,
    format_report,
    run_cpu_comparison,
    run_gpu_mfu,
)
from megatron_lite.cli import cli_main, run_cli


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None, metavar="OUT.json")
    parser.add_argument("--config", default="configs/tiny/rope.yml", help="model dimensions for the CPU comparison")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (median reported)")
    parser.add_argument("--steps-per-round", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--gpu-config", default="configs/coca_350m.yml", help="config timed on the GPU, if any")
    parser.add_argument("--gpu-batch-size", type=int, default=16)
    parser.add_argument("--no-gpu", action="store_true", help="skip the GPU measurement")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled-vs-eager rows")
    parser.add_argument("--compile-schemes", nargs="+", default=list(COMPILE_SCHEMES), choices=list(COMPILE_SCHEMES),
                        metavar="SCHEME", help=f"schemes timed compiled vs eager (default all: {' '.join(COMPILE_SCHEMES)})")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the compiled rows")
    parser.add_argument("--sequence-parallel", default=None, metavar="P,P,...",
                        help="sequence-parallel mode: these sizes (e.g. 1,2,4), nothing else")
    parser.add_argument("--sequence-length", type=int, default=8192, help="sequence-parallel mode: the length")
    parser.add_argument("--sequence-parallel-steps", type=int, default=2,
                        help="sequence-parallel mode: timed steps per size (median reported)")
    args = parser.parse_args(argv)
    if args.sequence_parallel is not None:
        return _sequence_parallel_mode(args)
    for name in ("batch_size", "rounds", "steps_per_round", "gpu_batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    settings = TrainBenchSettings(config_path=args.config, batch_size=args.batch_size, rounds=args.rounds,
                                  steps_per_round=args.steps_per_round, threads=args.threads,
                                  gpu_config_path=args.gpu_config, gpu_batch_size=args.gpu_batch_size,
                                  compile_schemes=[] if args.no_compile else args.compile_schemes,
                                  compile_backend=args.compile_backend)
    result = run_cpu_comparison(settings, progress=lambda line: print(line, file=sys.stderr, flush=True))
    if torch.cuda.is_available() and not args.no_gpu:
        result.gpu = run_gpu_mfu(settings)
    print(format_report(result), end="")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result.__dict__, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


def _sequence_parallel_mode(args: argparse.Namespace) -> int:
    import tempfile

    from megatron_lite.bench.sequence_parallel_bench import format_sequence_parallel, run_sequence_parallel_bench

    try:
        sizes = [int(size) for size in args.sequence_parallel.split(",")]
    except ValueError:
        raise ValueError(f"--sequence-parallel {args.sequence_parallel!r}: must be sizes like 1,2,4") from None
    if args.sequence_parallel_steps < 1:
        raise ValueError(f"--sequence-parallel-steps {args.sequence_parallel_steps}: must be >= 1")
    with tempfile.TemporaryDirectory() as scratch:
        rows = run_sequence_parallel_bench(sizes, args.sequence_length, args.sequence_parallel_steps, Path(scratch))
    print(format_sequence_parallel(rows), end="")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([row.__dict__ for row in rows], indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    run_cli(main)
