"""Command-line flags the evaluation tools share (tools/eval_long_context.py, tools/attention_diagnostics.py):
how documents are read and how a checkpoint is loaded and run."""

from __future__ import annotations

import argparse

from megatron_lite.model.gpt import DTYPES


def add_document_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--strip-gutenberg", action="store_true",
                        help="strip Project Gutenberg headers/footers (raw Gutenberg files)")
    parser.add_argument("--split", default="test",
                        help="split of a datasets id given without :SPLIT (and of a save_to_disk dataset dict)")
    parser.add_argument("--text-field", default="text",
                        help="text column of parquet files and of a datasets id given without :COLUMN")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    parser.add_argument("--attention-backend", default="auto",
                        help="auto (chunked for ALiBi, fused causal sdpa otherwise) | sdpa | chunked | flash | "
                             "reference")
    parser.add_argument("--chunk-size", type=int, default=1024, help="query block of the chunked backend")
    parser.add_argument("--tokenizer", default=None,
                        help="SentencePiece .model, tokenizer.json or a directory holding one (default: the checkpoint's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a key of every checkpoint's config (must keep parameter shapes), "
                             "e.g. --set model.position.constraint=strict")
    parser.add_argument("--quiet", action="store_true", help="no progress bars or log lines")
