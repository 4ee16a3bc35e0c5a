#!/usr/bin/env python
"""Attention diagnostics of a checkpoint on real text: initial angles Theta_j, the anomalous fraction and tau
(rotary schemes), attention mass by distance, entropy and sink mass, per layer x head x length.

    python tools/attention_diagnostics.py runs/coca_slack --docs emozilla/pg19-test --strip-gutenberg \\
        --out eval/diagnostics --queries 64 --max-length 16384

Lengths default to the training length x 1, 2, 4, 8, 16, 32 (capped by --max-length). Writes
OUT/diagnostics.json, OUT/anomalous_fraction_heatmap.png, OUT/attention_mass_vs_distance.png and
OUT/theta_histogram.png. What each number means: docs/diagnostics.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_lite.cli import cli_main, run_cli
from megatron_lite.eval.arguments import add_document_arguments, add_model_arguments
from megatron_lite.eval.diagnostics import DiagnosticsSettings, run_attention_diagnostics
from megatron_lite.eval.scaling import parse_int_list


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("checkpoint", help="run dir (latest checkpoint), step dir or consolidated dir")
    parser.add_argument("--docs", required=True,
                        help="documents: a directory of .txt books, parquet file/dir, or a HF hub id (test split)")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--lengths", default=None,
                        help="sequence lengths, comma-separated (default: training length x 1,2,4,8,16,32)")
    parser.add_argument("--max-length", type=int, default=16384, help="cap on the lengths")
    parser.add_argument("--queries", type=int, default=64,
                        help="query rows sampled per length and document (3/4 from the last quarter, 1/4 spread)")
    parser.add_argument("--max-docs", type=int, default=1, help="documents averaged over")
    add_document_arguments(parser)
    add_model_arguments(parser)
    return parser.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> DiagnosticsSettings:
    return DiagnosticsSettings(
        checkpoint=args.checkpoint, docs=args.docs, out_dir=args.out,
        lengths=parse_int_list(args.lengths, "--lengths") if args.lengths else None, max_length=args.max_length,
        queries=args.queries, max_docs=args.max_docs, strip_gutenberg=args.strip_gutenberg, split=args.split,
        text_field=args.text_field, tokenizer=args.tokenizer, device=args.device, dtype=args.dtype,
        attention_backend=args.attention_backend, chunk_size=args.chunk_size, overrides=args.set,
        progress=not args.quiet,
    )


@cli_main
def main(argv: list[str] | None = None) -> int:
    run_attention_diagnostics(settings_from_args(parse_args(argv)))
    return 0


if __name__ == "__main__":
    run_cli(main)
