#!/usr/bin/env python
"""Checkpoint stall benchmark: how long each save holds the step loop, synchronous against asynchronous
(train.async_save), and how much the steps overlapping a background write slow down. One train.py run per mode,
same config and steps; prints both and their ratio (a Markdown table).

    python tools/bench_checkpoint.py --config configs/tiny/coca_slack.yml --steps 20 --save-interval 4
    python tools/bench_checkpoint.py --config configs/coca_350m.yml --steps 16 --save-interval 5 \\
        --set data.mix=configs/data/sample_mix.yml --set model.seq_length=64 \\
        --set train.train_micro_batch_size_per_gpu=1 --set train.gradient_accumulation_steps=1 \\
        --set train.train_batch_size=null

The logic lives in megatron_lite/bench/checkpoint_bench.py; docs/checkpoints.md has the figures.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from megatron_lite.cli import cli_main, run_cli


@cli_main
def main(argv: list[str] | None = None) -> int:
    from megatron_lite import config as config_lib
    from megatron_lite.bench.checkpoint_bench import as_json, format_report, run_mode

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override, repeatable")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per mode")
    parser.add_argument("--save-interval", type=int, default=5, help="steps between saves")
    parser.add_argument("--run-root", type=Path, default=None, help="where the two run dirs go (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    config = config_lib.load(args.config, overrides=args.set)
    tokens_per_step = (config.model.seq_length * config.train.train_micro_batch_size_per_gpu
                       * (config.train.gradient_accumulation_steps or 1))
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint_") as scratch:
        root = args.run_root or Path(scratch)
        results = [run_mode(args.config, args.set, mode, root / mode, args.steps, args.save_interval, tokens_per_step)
                   for mode in ("sync", "async")]
    print(format_report(results, f"{args.config} ({args.steps} steps, a save every {args.save_interval})"))
    if args.json is not None:
        args.json.write_text(json.dumps(as_json(results), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    run_cli(main)
