#!/usr/bin/env python
"""Entry point: python train.py --config FILE [--set KEY=VALUE ...].

Until the DeepSpeed training loop lands (issue: training), this runs the CPU demo trainer
(megatron_lite/demo.py): byte-level training on Python's own prose, a KV-cache check, and
greedy generation.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_lite import config as config_lib
from megatron_lite.demo import run_demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="YAML config, e.g. configs/tiny/coca_slack.yml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set model.position.scheme=rope (repeatable)")
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--run-dir", type=Path, default=None, help="output directory (default runs/<config name>)")
    args = parser.parse_args(argv)
    try:
        config = config_lib.load(args.config, args.set)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    run_dir = args.run_dir or Path("runs") / Path(args.config).stem
    result = run_demo(config, args.steps, args.batch_size, args.lr, run_dir)
    print(f"loss {result.first_loss:.3f} -> {result.final_loss:.3f} (validation {result.validation_loss:.3f}), "
          f"{result.tokens_per_sec:,.0f} tokens/s")
    print(f"KV-cache decoding vs full forward: max |diff| = {result.cache_max_abs_diff:.2e}")
    print(f"greedy sample: {result.sample!r}")
    print(f"saved model.safetensors, config.yml, demo_result.json to {run_dir}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
