#!/usr/bin/env python
"""Tokenise the config's data mix into MMIDIDX shards + manifest under data.cache_dir.

    python tools/preprocess_data.py --config configs/coca_350m.yml [--strict] [--workers N]

Trains the tokenizer first when data.tokenizer.model is null and none is cached. Re-running
skips finished sources and resumes interrupted ones; the report at the end lists every skipped
record reason with its first locations. The logic lives in megatron_lite/data/preprocess.py.
"""

from __future__ import annotations

import argparse
import sys
import time

from megatron_lite import config as config_lib
from megatron_lite.cli import cli_main, run_cli
from megatron_lite.data.indexed import raise_if_no_room
from megatron_lite.data.preprocess import DEFAULT_DOCUMENTS_PER_SHARD, prepare_data


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="run config (YAML); its data.* section is used")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--strict", action="store_true", help="abort at the first bad record instead of skipping it")
    parser.add_argument("--workers", type=int, default=None, help="tokeniser processes (default data.num_workers)")
    parser.add_argument("--documents-per-shard", type=int, default=DEFAULT_DOCUMENTS_PER_SHARD,
                        help=f"documents per .bin/.idx shard (default {DEFAULT_DOCUMENTS_PER_SHARD})")
    parser.add_argument("--force", action="store_true", help="rebuild every source even if cached")
    parser.add_argument("--quiet", action="store_true", help="no progress bars and no report")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    config = config_lib.load(args.config, args.set)
    try:
        prepare_data(config.data, config.model.vocab_size, workers=args.workers, strict=args.strict,
                     progress=not args.quiet, documents_per_shard=args.documents_per_shard, force=args.force)
    except OSError as error:  # a shard names its own file; the manifest and tokenizer writes name the cache
        raise_if_no_room(error, config.data.cache_dir)
        raise
    if not args.quiet:
        print(f"done in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_cli(main)
