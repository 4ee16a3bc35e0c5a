#!/usr/bin/env python
"""Long-context evaluation: PG-19 perplexity, passkey retrieval and RULER-style needles, with RoPE scalings.

    python tools/eval_long_context.py --checkpoints runs/rope runs/coca_slack --out eval/long \\
        --ppl-docs emozilla/pg19-test --windows 512,1024,2048,4096,8192,16384,32768 --stride 512 \\
        --passkey-lengths 512,1024,2048,4096 --scaling none,dynamic:2,dynamic:4,dynamic:8,linear:4,yarn:4 \\
        --needles all --needle-lengths 512,1024,2048,4096 --needle-cases 20 --needle-depths 0,0.25,0.5,0.75,1
    # a smoke test from a clone: the shipped books (data/eval), a tiny model (configs/tiny), < 3 min on 2 CPU cores
    python tools/eval_long_context.py --checkpoints runs/coca_slack --out runs/eval_quick --quick

Writes OUT/results.json, OUT/tables.md, OUT/perplexity_vs_window.png, OUT/passkey_heatmap.png,
OUT/needles_heatmap.png, OUT/passkey_cases.json, OUT/needle_cases.json and OUT/run_info.json;
per-window (per-length, per-task) results are cached in OUT/cache, so an interrupted run picks up
where it stopped.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_lite.cli import cli_main, print_error, run_cli
from megatron_lite.data.book_specs import SAMPLE_BOOKS
from megatron_lite.eval.arguments import add_document_arguments, add_model_arguments
from megatron_lite.eval.long_context import DEFAULT_WINDOWS, EvalOutOfMemory, LongContextSettings, run_long_context_eval
from megatron_lite.eval.needles import DEFAULT_DEPTHS, TASKS, task_names
from megatron_lite.eval.scaling import parse_int_list, parse_scaling_list


def parse_depths(text: str) -> list[float]:
    """``--needle-depths``: comma-separated fractions in [0, 1]."""
    try:
        depths = [float(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--needle-depths {text!r}: give comma-separated numbers in [0, 1]") from None
    if not all(0.0 <= depth <= 1.0 for depth in depths):
        raise ValueError(f"--needle-depths {text!r}: each depth must be in [0, 1]")
    return depths


# Flags whose default --quick changes: a smoke test of perplexity, passkey and every needle task on the
# shipped books (data/eval), sized for the tiny configs (training length 128): windows and passkey prompts
# at 1x and 2x, needle prompts at 256 and 512 (the shortest lengths that hold every task's prompt), a case
# or two each; the needles' generation (up to 128 new tokens a case) is most of the time.
FULL_DEFAULTS: dict[str, object] = {
    "ppl_docs": None, "windows": ",".join(map(str, DEFAULT_WINDOWS)), "stride": 512, "max_doc_tokens": 32768,
    "max_docs": 100, "passkey_lengths": "", "passkey_cases": 100, "needles": "none", "needle_lengths": "",
    "needle_cases": 20,
}
QUICK_DEFAULTS: dict[str, object] = {
    "ppl_docs": str(SAMPLE_BOOKS), "windows": "128,256", "stride": 64, "max_doc_tokens": 1024, "max_docs": 2,
    "passkey_lengths": "128,256", "passkey_cases": 2, "needles": "all", "needle_lengths": "256,512",
    "needle_cases": 1,
}


def _preset(name: str, text: str, quick_shown: str | None = None) -> str:
    """Help for a flag with a --quick default (its argparse default is SUPPRESS, so a flag not given is absent
    from the namespace and apply_presets fills it)."""
    return f"{text} (default: {FULL_DEFAULTS[name]!s}; --quick: {quick_shown or QUICK_DEFAULTS[name]!s})"


def apply_presets(args: argparse.Namespace) -> argparse.Namespace:
    """Fill every preset flag not given: --quick's value with --quick, else the full default. The shipped
    books are raw Project Gutenberg files, so --quick's own --ppl-docs strips their headers."""
    preset = QUICK_DEFAULTS if args.quick else FULL_DEFAULTS
    if args.quick and not hasattr(args, "ppl_docs"):
        args.strip_gutenberg = True
    for name, value in preset.items():
        if not hasattr(args, name):
            setattr(args, name, value)
    return args


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--checkpoints", nargs="+", required=True, metavar="[NAME=]DIR",
                        help="run dirs (latest checkpoint), step dirs or consolidated dirs; NAME= labels the rows")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--quick", action="store_true", default=False,
                        help="a smoke test: the shipped books, windows and prompt lengths for a 128-token model, "
                             "a few passkey and needle cases (flags given explicitly still win)")
    parser.add_argument("--ppl-docs", default=argparse.SUPPRESS, help=_preset(
        "ppl_docs", "documents: a directory of .txt books (data/eval: two PG-19 test books shipped with the "
                    "repository), a parquet file/dir, a save_to_disk dataset, or a datasets id "
                    "ID[:SPLIT[:COLUMN]], e.g. emozilla/pg19-test", quick_shown="data/eval, --strip-gutenberg"))
    parser.add_argument("--windows", default=argparse.SUPPRESS, help=_preset("windows", "context windows L"))
    parser.add_argument("--stride", default=argparse.SUPPRESS, type=int,
                        help=_preset("stride", "sliding-window stride S"))
    parser.add_argument("--max-doc-chars", type=int, default=None,
                        help="cut each document to this many characters before tokenising, so models with "
                             "different tokenizers score the same text (bits per byte)")
    parser.add_argument("--max-doc-tokens", default=argparse.SUPPRESS, type=int, help=_preset(
        "max_doc_tokens", "keep documents with at least this many tokens, truncated to it (with "
                          "--max-doc-chars: only the minimum; the cut text is scored whole)"))
    parser.add_argument("--max-docs", default=argparse.SUPPRESS, type=int,
                        help=_preset("max_docs", "use at most this many documents (paper: 100)"))
    add_document_arguments(parser)
    parser.add_argument("--passkey-lengths", default=argparse.SUPPRESS, help=_preset(
        "passkey_lengths", "passkey prompt lengths in tokens (empty: no passkey)"))
    parser.add_argument("--passkey-cases", default=argparse.SUPPRESS, type=int,
                        help=_preset("passkey_cases", "cases per length"))
    parser.add_argument("--needles", default=argparse.SUPPRESS, help=_preset(
        "needles", f"needle-suite tasks: all | none | a comma list of {', '.join(TASKS)}"))
    parser.add_argument("--needle-lengths", default=argparse.SUPPRESS, help=_preset(
        "needle_lengths", "needle prompt lengths in tokens (needed by --needles)"))
    parser.add_argument("--needle-cases", default=argparse.SUPPRESS, type=int, help=_preset(
        "needle_cases", "cases per task x length, cycling over --needle-depths"))
    parser.add_argument("--needle-depths", default=",".join(f"{d:g}" for d in DEFAULT_DEPTHS),
                        help="depths of the answer needle, as fractions of the haystack")
    parser.add_argument("--needle-haystack", default="noise",
                        help="noise (the filler sentence repeated) | docs (the --ppl-docs documents)")
    parser.add_argument("--scaling", default="none",
                        help="RoPE scalings: none (the model as trained, with any scaling it was trained with) | "
                             "dynamic:F | linear:F | ntk:F | yarn:F | llama3:F, comma-separated")
    parser.add_argument("--seed", type=int, default=1234, help="passkey keys and depths; needle cases")
    parser.add_argument("--batch-size", type=int, default=1, help="windows (or passkey cases) per forward")
    add_model_arguments(parser)
    return apply_presets(parser.parse_args(argv))


def settings_from_args(args: argparse.Namespace) -> LongContextSettings:
    return LongContextSettings(
        checkpoints=args.checkpoints, out_dir=args.out, ppl_docs=args.ppl_docs,
        windows=parse_int_list(args.windows, "--windows"), stride=args.stride, max_doc_tokens=args.max_doc_tokens,
        max_doc_chars=args.max_doc_chars,
        max_docs=args.max_docs, strip_gutenberg=args.strip_gutenberg, split=args.split, text_field=args.text_field,
        passkey_lengths=parse_int_list(args.passkey_lengths, "--passkey-lengths") if args.passkey_lengths else [],
        passkey_cases=args.passkey_cases, needles=task_names(args.needles),
        needle_lengths=parse_int_list(args.needle_lengths, "--needle-lengths") if args.needle_lengths else [],
        needle_cases=args.needle_cases, needle_depths=parse_depths(args.needle_depths),
        needle_haystack=args.needle_haystack, scalings=parse_scaling_list(args.scaling), seed=args.seed,
        batch_size=args.batch_size, device=args.device, dtype=args.dtype, attention_backend=args.attention_backend,
        chunk_size=args.chunk_size, tokenizer=args.tokenizer, overrides=args.set, progress=not args.quiet,
    )


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        results = run_long_context_eval(settings_from_args(args))
    except EvalOutOfMemory as error:
        print_error(error)
        return 1
    if not args.quiet:
        print((args.out / "tables.md").read_text())
    return 0 if results["perplexity"] or results["passkey"] or results["needles"] else 1


if __name__ == "__main__":
    run_cli(main)
