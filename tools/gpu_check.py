#!/usr/bin/env python
"""One-GPU acceptance check: environment, backend parity vs the fp32 reference, training throughput and MFU
(ours eager / compiled, and Hugging Face GPT-NeoX), 32K-token forward memory, a ~60 s real train.py run,
and host-sync freedom of the training step; rows in OUT/gpu_check.json and OUT/gpu_check.md.

    python tools/gpu_check.py --out OUT [--only env,parity,...] [--force] [--smoke] [--board PATH | --no-board]

Each section's rows are written as it finishes; a re-run skips finished sections unless --force.
--smoke runs every section on the tiny config on the CPU in seconds (to check the tool itself).
A finished call appends one row to the results board, docs/results.md (megatron_lite/results_board.py).
The logic lives in megatron_lite/bench/gpu_check.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_lite import results_board
from megatron_lite.bench.gpu_check import SECTIONS, CheckSettings, load_results, parse_sections, run_check
from megatron_lite.cli import cli_main, run_cli


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for gpu_check.json / gpu_check.md")
    parser.add_argument("--only", default=None, metavar="SECTION,...", help=f"sections to run: {', '.join(SECTIONS)}")
    parser.add_argument("--force", action="store_true", help="redo sections already finished in OUT")
    parser.add_argument("--smoke", action="store_true", help="tiny config on the CPU, seconds: checks the tool")
    parser.add_argument("--max-batch", type=int, default=64, help="largest micro batch the throughput search tries")
    results_board.add_board_arguments(parser)
    args = parser.parse_args(argv)
    if args.max_batch < 1:
        raise ValueError(f"--max-batch {args.max_batch}: must be >= 1")
    settings = CheckSettings(out=args.out, sections=parse_sections(args.only), smoke=args.smoke, force=args.force,
                             max_batch=args.max_batch)
    board = results_board.board_from_args(args)
    previous = {} if args.force else load_results(args.out)
    results = run_check(settings, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(f"wrote {args.out / 'gpu_check.md'} and {args.out / 'gpu_check.json'}")
    if board is not None:
        row = results_board.gpu_check_row(
            results, smoke=args.smoke, sections=settings.sections, all_sections=SECTIONS,
            measured=[name for name in settings.sections if name not in previous],
            device=results_board.device_name(cpu=args.smoke))
        board.append(results_board.GPU_CHECKS, row)
        print(f"appended a row to {board.path}")
    return 0


if __name__ == "__main__":
    run_cli(main)
