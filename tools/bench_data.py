#!/usr/bin/env python
"""Data pipeline benchmark: preprocessing tokens/s (1 vs 2 workers) and loader samples/s.

    python tools/bench_data.py --config configs/tiny/coca_slack.yml --json bench_data.json

(a) prepare_data(config) with 1 and 2 tokenisation workers (target speed-up >= 1.7x); (b) the
sample-index build time and DataLoader samples/s against what training consumes (target >= 100x),
on synthetic shards (default 20M tokens) unless --cache-dir names a prepared cache. Prints a
Markdown table. The logic lives in megatron_lite/bench/data_bench.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_lite import config as config_lib
from megatron_lite.cli import cli_main, run_cli


@cli_main
def main(argv: list[str] | None = None) -> int:
    # Imported here, not at the top: spawned tokeniser workers re-import this script, and the
    # benchmark module pulls in torch (seconds per worker, which would be timed as preprocessing).
    from megatron_lite.bench.data_bench import DEFAULT_CONSUMED_SAMPLES_PER_S, format_report, run_benchmark

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/tiny/coca_slack.yml", help="run config (default the tiny CPU config)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT.json", help="write the figures here")
    parser.add_argument("--cache-dir", default=None, help="a prepared cache dir to read (default: synthetic shards)")
    parser.add_argument("--synthetic-tokens", type=int, default=20_000_000, help="size of the synthetic shards")
    parser.add_argument("--index-samples", type=int, default=10_000_000, help="samples in the timed index build")
    parser.add_argument("--loader-seconds", type=float, default=5.0, help="how long to read samples")
    parser.add_argument("--batch-size", type=int, default=8, help="DataLoader batch size (default 8)")
    parser.add_argument("--consumed-samples-per-s", type=float, default=DEFAULT_CONSUMED_SAMPLES_PER_S,
                        help="training consumption the loader is compared with (default 60: ~8 samples/step "
                             "x ~7 steps/s, tiny config on 2 CPU cores)")
    parser.add_argument("--skip-preprocess", action="store_true", help="time the loader only")
    args = parser.parse_args(argv)
    config = config_lib.load(args.config, args.set)
    if args.json is not None:  # fail now, not after a long run
        args.json.parent.mkdir(parents=True, exist_ok=True)
    result = run_benchmark(
        config, cache_dir=args.cache_dir, synthetic_tokens=args.synthetic_tokens, index_samples=args.index_samples,
        loader_seconds=args.loader_seconds, batch_size=args.batch_size,
        consumed_samples_per_s=args.consumed_samples_per_s, preprocess=not args.skip_preprocess,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    print(format_report(result), end="")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    run_cli(main)
