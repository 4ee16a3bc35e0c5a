#!/usr/bin/env python
"""Build the offline sample corpus (tokenizer + MMIDIDX shards) for the tiny configs, nanoGPT-style.

    python data/sample/prepare.py [--config configs/tiny/coca_slack.yml] [--workers N]

Text = the Python installation's licence, pydoc topic pages and stdlib docstrings; code = the
stdlib's .py sources (configs/data/sample_mix.yml). Output goes to the config's data.cache_dir
(default data/cache/sample); paths in the config are taken relative to the repository root.
Re-running is a no-op while nothing changed. All logic is in megatron_lite.data.preprocess.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs/tiny/coca_slack.yml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--workers", type=int, default=None, help="tokeniser processes (default data.num_workers)")
    parser.add_argument("--strict", action="store_true", help="abort at the first bad record")
    parser.add_argument("--force", action="store_true", help="rebuild the shards even if cached")
    args = parser.parse_args(argv)
    config_path = args.config.resolve()  # before chdir: relative to where the user ran us
    os.chdir(ROOT)  # data.mix / data.cache_dir defaults are repository-relative

    from megatron_lite import config as config_lib
    from megatron_lite.data.preprocess import prepare_data

    start = time.perf_counter()
    try:
        config = config_lib.load(config_path, args.set)
        manifest = prepare_data(config.data, config.model.vocab_size, workers=args.workers, strict=args.strict,
                                force=args.force)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    groups: dict[str, list[int]] = {}
    for record in manifest.sources.values():
        totals = groups.setdefault(record.group, [0, 0])
        totals[0] += record.documents
        totals[1] += record.tokens
    summary = ", ".join(f"{group}: {docs:,} documents / {tokens:,} tokens" for group, (docs, tokens) in groups.items())
    print(f"sample corpus in {config.data.cache_dir}: {summary} ({time.perf_counter() - start:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
