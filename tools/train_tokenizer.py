#!/usr/bin/env python
"""Train the SentencePiece BPE tokenizer on a sample of the config's data mix.

    python tools/train_tokenizer.py --config configs/coca_350m.yml [--vocab-size N] [--out DIR]

The sample is data.tokenizer.sample_chars characters drawn in the mix's group proportions;
the vocabulary is model.vocab_size unless --vocab-size is given. Without --out the model goes
to <data.cache_dir>/tokenizer/tokenizer.model, where preprocessing picks it up (shards made with
an older tokenizer are rebuilt); with --out DIR it is written to DIR/tokenizer.model, for use as
data.tokenizer.model. The logic lives in megatron_lite/data/tokenizer.py.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from megatron_lite import config as config_lib
from megatron_lite.cli import cli_main, run_cli
from megatron_lite.data.cache_lock import building
from megatron_lite.data.mix import load_mix
from megatron_lite.data.tokenizer import ensure_tokenizer, train_from_mix


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="run config (YAML); data.mix, data.tokenizer.*, model.vocab_size")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--vocab-size", type=int, default=None, help="pieces (default model.vocab_size)")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default <data.cache_dir>/tokenizer)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    overrides = list(args.set) + ([f"model.vocab_size={args.vocab_size}"] if args.vocab_size else [])
    config = config_lib.load(args.config, overrides)
    if args.out is None:
        if config.data.tokenizer.model:
            raise ValueError(f"data.tokenizer.model={config.data.tokenizer.model!r} is set: nothing to train "
                             "into the cache (give --out DIR to train a separate model)")
        with building(config.data.cache_dir) as build:  # not while another run builds or reads the cache
            tokenizer = ensure_tokenizer(config.data, config.model.vocab_size, retrain=True,
                                         before_change=build.before_change)
    else:
        data = config.data
        tokenizer = train_from_mix(load_mix(data.mix), args.out / "tokenizer.model", config.model.vocab_size,
                                   data.tokenizer.sample_chars, num_threads=data.num_workers)
    print(f"{tokenizer.path}: {tokenizer.vocab_size} pieces, eod={tokenizer.eod_id}, pad={tokenizer.pad_id}, "
          f"sha256={tokenizer.sha256} ({time.perf_counter() - start:.1f}s)")
    return 0


if __name__ == "__main__":
    run_cli(main)
