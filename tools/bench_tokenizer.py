#!/usr/bin/env python
"""Tokenizer benchmark: bytes per token on held-out text and code for tokenizers trained on samples of
different sizes, and for tokenizers you give (a tokenizer.json or SentencePiece .model).

    python tools/bench_tokenizer.py --text DIR_OF_BOOKS [--text DIR ...] [--code STDLIB_DIR] \\
        --sample-chars 20000000 200000000 --vocab-size 50000 --tokenizer gpt-neox-20b/tokenizer.json \\
        --out bench_tokenizer --json bench_tokenizer.json

text: directories of .txt books (Project Gutenberg headers stripped, encodings detected); code: a
directory of .py files (default: this Python's standard library, its tests left out). Every 20th
document of each group is held out. Prints a Markdown table. The logic lives in
megatron_lite/bench/tokenizer_bench.py.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_lite.cli import cli_main, run_cli


@cli_main
def main(argv: list[str] | None = None) -> int:
    from megatron_lite.bench.tokenizer_bench import format_report, run_benchmark, split_group
    from megatron_lite.config import SourceConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--text", type=Path, action="append", required=True, metavar="DIR",
                        help="directory (or file/glob) of .txt documents, one per file; repeatable")
    parser.add_argument("--code", type=Path, default=None, metavar="DIR",
                        help=".py sources (default this Python's standard library)")
    parser.add_argument("--sample-chars", type=int, nargs="*", default=[20_000_000],
                        help="training sample sizes in characters, 75/25 text/code (default 20000000)")
    parser.add_argument("--vocab-size", type=int, default=50_000, help="pieces (default 50000, the 350M configs')")
    parser.add_argument("--tokenizer", type=Path, action="append", default=[], metavar="PATH",
                        help="a tokenizer to measure as well (tokenizer.json, .model or a directory); repeatable")
    parser.add_argument("--holdout-every", type=int, default=20, help="hold out every N-th document (default 20)")
    parser.add_argument("--threads", type=int, default=2, help="SentencePiece training threads (default 2)")
    parser.add_argument("--out", type=Path, default=Path("bench_tokenizer"), help="where trained models go")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT.json", help="write the figures here")
    args = parser.parse_args(argv)
    for path in [*args.text, *args.tokenizer, *([args.code] if args.code else [])]:
        if not path.exists() and not any(ch in str(path) for ch in "*?["):
            raise ValueError(f"{path}: does not exist")
    text_sources = [SourceConfig(type="text", path=str(path), strip_gutenberg=True, encoding="auto")
                    for path in args.text]
    code_source = SourceConfig(type="python_code", path=str(args.code) if args.code else None)
    groups = {"text": split_group(text_sources, args.holdout_every),
              "code": split_group([code_source], args.holdout_every)}
    print("pool chars: " + ", ".join(f"{name} {split.pool_chars:,}" for name, split in groups.items()), flush=True)
    result = run_benchmark(groups, args.sample_chars, args.vocab_size, args.out, args.tokenizer,
                           num_threads=args.threads, progress=lambda line: print(line, flush=True))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(format_report(result))
    return 0


if __name__ == "__main__":
    run_cli(main)
