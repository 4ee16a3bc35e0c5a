#!/usr/bin/env python
"""Tiny-scale CoCA reproduction on CPU: train ALiBi, RoPE, CoCA slack and CoCA strict models that differ
only in the position scheme, then evaluate long-context perplexity and passkey retrieval.

    python tools/reproduce_tiny.py --books ../shared/data/gutenberg --eval-books ../shared/data/pg19_test \\
        --out runs/repro_tiny

Resumable: a finished model is skipped, an interrupted one resumes from its latest checkpoint, and
evaluation results are cached per cell. Writes OUT/results.json, OUT/tables.md (the paper's Tables
1-3 layout), OUT/perplexity_vs_window.png, OUT/perplexity_ntk_factors.png, OUT/passkey_heatmap.png and
OUT/wall_times.json; see docs/reproduction.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_lite.cli import cli_main, print_error, run_cli
from megatron_lite.eval.scaling import parse_int_list
from megatron_lite.repro.settings import (DEFAULT_NTK_FACTORS, DEFAULT_PASSKEY_LENGTHS, DEFAULT_WINDOWS, SCHEMES,
                                          ReproSettings)


def _joined(values: list[int] | list[float]) -> str:
    return ",".join(f"{value:g}" for value in values)


def parse_float_list(text: str, flag: str) -> list[float]:
    """Comma-separated numbers, order kept, duplicates dropped; empty text gives []."""
    values: list[float] = []
    for item in text.split(","):
        if item.strip():
            try:
                value = float(item)
            except ValueError:
                raise ValueError(f"{flag} {text!r}: {item.strip()!r} is not a number") from None
            if value not in values:
                values.append(value)
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "),
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--books", type=Path, required=True,
                        help="training books: a directory of raw Project Gutenberg .txt files (headers are stripped)")
    parser.add_argument("--eval-books", type=Path, required=True,
                        help="evaluation books (the PG-19 test set): a directory of .txt (or parquet) books, held out")
    parser.add_argument("--out", type=Path, required=True, help="output directory (data, runs, eval, results)")
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES, help="models to train")
    parser.add_argument("--train-iters", type=int, default=None,
                        help="optimizer steps per model (default: train.train_iters of configs/tiny/repro_*.yml)")
    parser.add_argument("--windows", default=_joined(DEFAULT_WINDOWS), help="perplexity context windows")
    parser.add_argument("--stride", type=int, default=None, help="sliding-window stride (default: the training length)")
    parser.add_argument("--max-doc-tokens", type=int, default=8192,
                        help="evaluation books are truncated to this many tokens (shorter ones skipped)")
    parser.add_argument("--max-docs", type=int, default=100, help="evaluation books used at most")
    parser.add_argument("--passkey-lengths", default=_joined(DEFAULT_PASSKEY_LENGTHS),
                        help="passkey prompt lengths in tokens; empty: no passkey test")
    parser.add_argument("--passkey-cases", type=int, default=100, help="passkey cases per length (the paper: 100)")
    parser.add_argument("--ntk-factors", default=_joined(DEFAULT_NTK_FACTORS),
                        help="dynamic NTK factors evaluated besides no scaling (rotary models); empty: none")
    parser.add_argument("--headline-ntk-factor", type=float, default=4.0,
                        help="the dynamic NTK factor shown in Tables 1 and 2 (one of --ntk-factors)")
    parser.add_argument("--batch-size", type=int, default=4, help="evaluation windows / passkey cases per forward")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for training and evaluation; 1 is fastest when other jobs share the cores")
    parser.add_argument("--seed", type=int, default=1234, help="passkey keys and depths")
    parser.add_argument("--code-max-documents", type=int, default=None,
                        help="read at most this many stdlib source files (default: all)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override applied to every model, e.g. --set train.lr=1e-3")
    parser.add_argument("--config-dir", type=Path, default=None,
                        help="directory holding repro_<scheme>.yml (default: the repository's configs/tiny)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars or log lines (logs still written)")
    return parser.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> ReproSettings:
    settings = ReproSettings(
        books=args.books, eval_books=args.eval_books, out_dir=args.out, schemes=args.schemes,
        train_iters=args.train_iters, windows=parse_int_list(args.windows, "--windows"), stride=args.stride,
        max_doc_tokens=args.max_doc_tokens, max_docs=args.max_docs,
        passkey_lengths=(parse_int_list(args.passkey_lengths, "--passkey-lengths")
                         if args.passkey_lengths.strip() else []),
        passkey_cases=args.passkey_cases, ntk_factors=parse_float_list(args.ntk_factors, "--ntk-factors"),
        headline_ntk_factor=args.headline_ntk_factor, batch_size=args.batch_size, threads=args.threads, seed=args.seed,
        code_max_documents=args.code_max_documents, overrides=args.overrides, progress=not args.quiet)
    if args.config_dir is not None:
        settings.config_dir = args.config_dir
    return settings


@cli_main
def main(argv: list[str] | None = None) -> int:
    from megatron_lite.eval.long_context import EvalOutOfMemory
    from megatron_lite.repro import TrainingFailed, run_reproduction

    args = parse_args(argv)
    try:
        run_reproduction(settings_from_args(args))
    except (TrainingFailed, EvalOutOfMemory) as error:
        print_error(error)
        return 1
    except KeyboardInterrupt:
        print("interrupted: run the same command again to resume (finished models and results are kept)",
              file=sys.stderr)
        return 130
    if not args.quiet:
        print((args.out / "tables.md").read_text())
    return 0


if __name__ == "__main__":
    run_cli(main)
