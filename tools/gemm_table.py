#!/usr/bin/env python
"""The GEMMs of a profiler trace, shape by shape: calls, time and the TFLOP/s each shape ran at.

    python tools/gemm_table.py TRACE.json[.gz] [TRACE ...] [--per N] [--per-label "per micro batch"]
        [--peak-tflops 989]

TRACE: a trace torch.profiler exported with record_shapes (train.profile with train.profile.record_shapes: true
writes one beside its _gemms.txt; tools/gpu_check.py's users' command rows are profiled so). On a GPU trace each
shape is timed by the kernels its operator launched; kernels replayed from CUDA graphs have no operator and are
counted apart. --per divides calls and times (the steps or micro batches the trace holds). The peak defaults to the
trace's device (H100/H200: 989 TFLOP/s dense bf16). The logic lives in megatron_lite/training/gemm_shapes.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_lite.cli import cli_main, run_cli
from megatron_lite.training.gemm_shapes import trace_gemm_text


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", type=Path, nargs="+", metavar="TRACE")
    parser.add_argument("--per", type=int, default=1, help="divide calls and times by N (default 1)")
    parser.add_argument("--per-label", default=None, help='what one Nth is, e.g. "per micro batch"')
    parser.add_argument("--peak-tflops", type=float, default=None, help="default: the trace's device's, if known")
    args = parser.parse_args(argv)
    label = args.per_label or ("per trace" if args.per == 1 else f"per 1/{args.per} of the trace")
    tables = [f"{path.name}\n{trace_gemm_text(path, args.per, label, args.peak_tflops)}" for path in args.traces]
    print("\n\n".join(tables))
    return 0


if __name__ == "__main__":
    run_cli(main)
