#!/usr/bin/env python
"""CPU figures that predict a GPU step: the step census, inductor's bytes, compile time and gradient sums.

    python -m dev.cpu_figures --census [--census-devices cpu,meta] [--census-config configs/coca_350m.yml]
    python -m dev.cpu_figures --compiled-bytes [--compiled-bytes-batch-size 2]
    python -m dev.cpu_figures --compiled-bytes-kernels [--compiled-bytes-schemes rope --compiled-bytes-batch-size 16]
    python -m dev.cpu_figures --compile-time [--compile-layers 24 --compile-hidden 128]
    python -m dev.cpu_figures --grad-sums [--grad-sums-config configs/coca_350m.yml]

Run from the repository root (dev/ is not installed). ``--census``: for our schemes and the Hugging Face twin, one
bf16 training step counted under a dispatch mode: the share of GEMM FLOPs with float32 operands, sync-class
operations, dispatched operators (step_census.py, census_bench.py). ``--compiled-bytes``: inductor's bytes per token
of the compiled block and of the rest, ours vs the twin (compiled_bytes.py); ``--compiled-bytes-kernels`` each kernel
of one regionally compiled block instead. ``--compile-time``: first step and compiled step, compile_model "whole" vs
"regional", each in a fresh process (compile_time.py). ``--grad-sums``: the memory traffic DeepSpeed's backward and
step add when a bf16 run sums its gradients in float32 (train.grad_accum_dtype, grad_sums.py). Each prints its table
and ratios from one run; ``--json`` writes the results.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dev.census_bench import CENSUS_DEVICES, CENSUS_SCHEMES, CensusSettings, format_census, run_census
from dev.compiled_bytes import (
    COMPILED_BYTES_SCHEMES,
    CompiledBytesSettings,
    block_kernels,
    format_block_kernels,
    format_compiled_bytes,
    run_compiled_bytes,
)
from dev.compile_time import (DEFAULT_MODES, GROUPED_PREFIX, MODES, CompileTimeSettings, blocks_per_region,
                              format_compile_time, run_compile_time)
from dev.grad_sums import GradSumsSettings, format_grad_sums, run_grad_sums
from megatron_lite.cli import cli_main, run_cli

LOSS_GEMMS = ("mixed", "input_dtype", "fp32")


def _names(value: str, known: tuple[str, ...], flag: str) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise ValueError(f"{flag} {value!r}: expected a comma-separated list of {', '.join(known)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    census = parser.add_argument_group("step census (--census)")
    census.add_argument("--census", action="store_true",
                        help="print the step census of ours and the HF twin (fp32-operand GEMM share, sync ops, "
                             "dispatched ops per step) instead of the throughput comparison")
    census.add_argument("--census-config", default="configs/tiny/rope.yml", help="model dimensions of the census")
    census.add_argument("--census-batch-size", type=int, default=2)
    census.add_argument("--census-devices", default=",".join(CENSUS_DEVICES),
                        help="where to count: cpu (CPU kernels), meta (the CUDA path's operators, any size)")
    census.add_argument("--census-schemes", default=",".join(CENSUS_SCHEMES), help="our schemes counted")
    census.add_argument("--census-gemm", nargs="+", choices=LOSS_GEMMS, default=None, metavar="MODE",
                        help="loss-head GEMM modes counted for our models (default: the model's own)")
    census.add_argument("--census-precision", default="bf16", choices=("bf16", "fp16", "fp32"))
    census.add_argument("--census-optimizer", action="store_true", help="count the AdamW step too (reported apart)")
    compiled = parser.add_argument_group("compiled step traffic (--compiled-bytes)")
    compiled.add_argument("--compiled-bytes", action="store_true",
                          help="print inductor's bytes per token of the compiled block and of the rest (embedding, "
                               "head, loss), ours vs the HF twin, from whole-model compiles at two depths on CPU")
    compiled_defaults = CompiledBytesSettings()
    compiled.add_argument("--compiled-bytes-config", default=compiled_defaults.config_path)
    compiled.add_argument("--compiled-bytes-schemes", default=",".join(COMPILED_BYTES_SCHEMES),
                          help="our schemes measured")
    compiled.add_argument("--compiled-bytes-batch-size", type=int, default=compiled_defaults.batch_size)
    compiled.add_argument("--compiled-bytes-kernels", action="store_true",
                          help="list each kernel of one regionally compiled block per scheme (forward, backward: "
                               "bytes per token, the operators fused into it) instead of the per-layer table")
    compile_time = parser.add_argument_group("compile time (--compile-time)")
    compile_time.add_argument("--compile-time", action="store_true",
                              help="time the first step and the compiled step, compile_model whole vs regional, "
                                   "each in a fresh process (uses --compile-backend)")
    defaults = CompileTimeSettings()
    compile_time.add_argument("--compile-layers", type=int, default=defaults.layers)
    compile_time.add_argument("--compile-hidden", type=int, default=defaults.hidden)
    compile_time.add_argument("--compile-heads", type=int, default=defaults.heads)
    compile_time.add_argument("--compile-seq-length", type=int, default=defaults.seq_length)
    compile_time.add_argument("--compile-vocab", type=int, default=defaults.vocab)
    compile_time.add_argument("--compile-batch-size", type=int, default=defaults.batch_size)
    compile_time.add_argument("--compile-scheme", default=defaults.scheme)
    compile_time.add_argument("--compile-steps", type=int, default=defaults.steps,
                              help="timed steps after the first two (median)")
    compile_time.add_argument("--compile-modes", default=",".join(DEFAULT_MODES),
                              help="eager (reference), whole, regional, regional-cpp-wrapper (inductor's C++ "
                                   "wrapper; at --compile-hidden 16 --compile-seq-length 8 --compile-batch-size 1 the "
                                   "step is the host's floor), regional-blocks-K (K blocks per compiled region)")
    compile_time.add_argument("--compile-repeats", type=int, default=defaults.repeats,
                              help="fresh processes per mode, interleaved (medians reported)")
    compile_time.add_argument("--compile-threads", type=int, default=defaults.threads,
                              help="torch threads per worker (0: torch's default)")
    compile_time.add_argument("--compile-backend", default=defaults.backend,
                              help="torch.compile backend (eager or aot_eager: dynamo only, a quick smoke)")
    sums = parser.add_argument_group("gradient sums (--grad-sums)")
    sums.add_argument("--grad-sums", action="store_true",
                      help="count the memory traffic and operators of DeepSpeed's backward and step at ZeRO 1 in bf16, "
                           "and time them on the host, with bf16 sums, DeepSpeed's per-tensor float32 hooks and the "
                           "run's float32 sums")
    sums_defaults = GradSumsSettings()
    sums.add_argument("--grad-sums-config", default=sums_defaults.config_path)
    sums.add_argument("--grad-sums-set", action="append", default=[], metavar="KEY=VALUE",
                      help="a config override for the counted model (repeatable), e.g. model.num_layers=2")
    sums.add_argument("--grad-sums-tokens", type=int, default=sums_defaults.tokens, help="tokens per micro batch")
    sums.add_argument("--grad-sums-micro-batches", type=int, default=sums_defaults.micro_batches,
                      help="micro batches per counted optimizer step")
    sums.add_argument("--grad-sums-accumulation", type=int, default=sums_defaults.accumulation,
                      help="micro batches per step in the per-step projection (the paper config on one GPU: 16)")
    sums.add_argument("--grad-sums-timed-steps", type=int, default=sums_defaults.timed_steps,
                      help="optimizer steps timed on the host after the counted one (medians reported)")


def census_settings(args: argparse.Namespace) -> CensusSettings:
    if args.census_batch_size < 1:
        raise ValueError(f"--census-batch-size {args.census_batch_size}: must be >= 1")
    return CensusSettings(config_path=args.census_config, batch_size=args.census_batch_size,
                          precision=args.census_precision,
                          devices=_names(args.census_devices, (*CENSUS_DEVICES, "cuda"), "--census-devices"),
                          schemes=_names(args.census_schemes, CENSUS_SCHEMES, "--census-schemes"),
                          gemms=args.census_gemm, optimizer=args.census_optimizer)


def compile_time_settings(args: argparse.Namespace) -> CompileTimeSettings:
    for name in ("layers", "hidden", "heads", "seq_length", "vocab", "batch_size", "steps", "repeats"):
        if getattr(args, f"compile_{name}") < 1:
            raise ValueError(f"--compile-{name.replace('_', '-')} {getattr(args, f'compile_{name}')}: must be >= 1")
    return CompileTimeSettings(layers=args.compile_layers, hidden=args.compile_hidden, heads=args.compile_heads,
                               seq_length=args.compile_seq_length, vocab=args.compile_vocab,
                               batch_size=args.compile_batch_size, scheme=args.compile_scheme,
                               backend=args.compile_backend, steps=args.compile_steps,
                               modes=_compile_modes(args.compile_modes),
                               repeats=args.compile_repeats, threads=args.compile_threads)


def _compile_modes(value: str) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    if not names or any(name not in MODES and blocks_per_region(name) is None for name in names):
        raise ValueError(f"--compile-modes {value!r}: expected a comma-separated list of {', '.join(MODES)}, "
                         f"{GROUPED_PREFIX}K (K >= 2)")
    return names


def compiled_bytes_settings(args: argparse.Namespace) -> CompiledBytesSettings:
    settings = CompiledBytesSettings(config_path=args.compiled_bytes_config, batch_size=args.compiled_bytes_batch_size,
                                     schemes=_names(args.compiled_bytes_schemes, CENSUS_SCHEMES,
                                                    "--compiled-bytes-schemes"))
    settings.validate()
    return settings


def grad_sums_settings(args: argparse.Namespace) -> GradSumsSettings:
    settings = GradSumsSettings(config_path=args.grad_sums_config, overrides=list(args.grad_sums_set),
                                tokens=args.grad_sums_tokens, micro_batches=args.grad_sums_micro_batches,
                                accumulation=args.grad_sums_accumulation, timed_steps=args.grad_sums_timed_steps)
    settings.validate()
    return settings


@cli_main
def main(argv: list[str] | None = None) -> int:
    """--census, --compiled-bytes (or its kernels), --compile-time and/or --grad-sums: tables on stdout, progress on
    stderr, results to --json."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None, metavar="OUT.json")
    add_arguments(parser)
    args = parser.parse_args(argv)
    if not (args.census or args.compiled_bytes or args.compiled_bytes_kernels or args.compile_time or args.grad_sums):
        raise ValueError("nothing to run: give --census, --compiled-bytes, --compiled-bytes-kernels, --compile-time "
                         "and/or --grad-sums")
    census = census_settings(args) if args.census else None  # every flag checked before anything runs
    compiled_bytes = compiled_bytes_settings(args) if args.compiled_bytes or args.compiled_bytes_kernels else None
    compile_time = compile_time_settings(args) if args.compile_time else None
    grad_sums = grad_sums_settings(args) if args.grad_sums else None
    if compile_time is not None:
        compile_time.overrides()  # an unknown --compile-scheme stops here
    progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    output: dict[str, object] = {}
    if census is not None:
        rows = run_census(census, progress)
        print(format_census(rows, census), end="")
        output["census"] = {"settings": census.__dict__, "rows": rows}
    if compiled_bytes is not None and args.compiled_bytes_kernels:
        kernels = {scheme: block_kernels(scheme, compiled_bytes) for scheme in compiled_bytes.schemes}
        print(("\n" if output else "") + "\n".join(format_block_kernels(scheme, rows, compiled_bytes)
                                                   for scheme, rows in kernels.items()), end="")
        output["block_kernels"] = {"settings": compiled_bytes.__dict__, "schemes": kernels}
    elif compiled_bytes is not None:
        rows = run_compiled_bytes(compiled_bytes, progress)
        print(("\n" if output else "") + format_compiled_bytes(rows, compiled_bytes), end="")
        output["compiled_bytes"] = {"settings": compiled_bytes.__dict__, "rows": rows}
    if compile_time is not None:
        result = run_compile_time(compile_time, progress)
        print(("\n" if output else "") + format_compile_time(result), end="")
        output["compile_time"] = result
    if grad_sums is not None:
        rows = run_grad_sums(grad_sums, progress)
        print(("\n" if output else "") + format_grad_sums(rows, grad_sums), end="")
        output["grad_sums"] = {"settings": grad_sums.__dict__, "rows": rows}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(output, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    run_cli(main)
