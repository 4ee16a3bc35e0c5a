#!/usr/bin/env python
"""CoCA reproduction: train ALiBi, RoPE, CoCA slack and CoCA strict models that differ only in the position
scheme, then evaluate long-context perplexity and passkey retrieval. Three profiles:

    # cpu-tiny: 2.9M-parameter models on CPU, books tokenised here (the default profile); --books and
    # --eval-books take a directory of .txt books or a datasets id ID[:SPLIT[:COLUMN]] (written out once
    # under OUT/data/books); data/eval holds two PG-19 test books shipped with the repository
    python tools/reproduce.py --profile cpu-tiny --books emozilla/pg19:train --eval-books data/eval \\
        --out runs/repro_tiny
    # gpu-speedrun: 25M-parameter models on one GPU from a data bundle (tools/build_data_bundle.py), <= 9 min
    python tools/reproduce.py --profile gpu-speedrun --bundle speedrun_bundle.tar.xz --out runs/speedrun
    # paper-350m: the paper's four 350M models on all local GPUs (deepspeed launcher), its mix and schedule,
    # 2 epochs of ~50B tokens each unless --tokens; the budget (tokens, hours on 8 A100 / 8 H100) printed first
    python tools/reproduce.py --profile paper-350m --eval-books emozilla/pg19-test --out runs/paper350m

Resumable: a finished model is skipped, an interrupted one resumes from its latest checkpoint, and
evaluation results are cached per cell; --only runs some phases (a run split into calls). Writes
OUT/results.json, OUT/tables.md (the paper's Tables 1-3 layout), OUT/perplexity_vs_window.png,
OUT/perplexity_ntk_factors.png, OUT/passkey_heatmap.png and OUT/wall_times.json; see docs/reproduction.md.
A call that writes the report appends one row to the results board OUT/results_board.md (--board PATH elsewhere,
--repo-board the repository's docs/results.md, --no-board none).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from megatron_lite import results_board
from megatron_lite.cli import cli_main, print_error, run_cli
from megatron_lite.data.book_specs import books_directory
from megatron_lite.eval.scaling import parse_int_list
from megatron_lite.repro.paper import parse_tokens
from megatron_lite.repro.settings import (DEFAULT_NTK_FACTORS, DEFAULT_PASSKEY_LENGTHS, DEFAULT_WINDOWS,
                                          PAPER_CONFIG_DIR, PHASES, PROFILES, SCHEMES, SPEEDRUN_CONFIG_DIR,
                                          SPEEDRUN_PAIR, PaperRunSettings, ReproSettings, SpeedrunBudget)

# Per-profile defaults of the flags that differ (None in argparse means "the profile's").
PROFILE_DEFAULTS: dict[str, dict[str, object]] = {
    "cpu-tiny": {"windows": DEFAULT_WINDOWS, "passkey_lengths": DEFAULT_PASSKEY_LENGTHS, "passkey_cases": 100,
                 "max_doc_tokens": 8192, "max_docs": 100, "batch_size": 4, "threads": 1},
    # the paper's evaluation: windows 512 ... 16K (1x ... 32x), stride 512; passkey 512 ... 8K
    "gpu-speedrun": {"windows": [512 * 2**i for i in range(6)], "passkey_lengths": [512 * 2**i for i in range(5)],
                     "passkey_cases": 50, "max_doc_tokens": 16384, "max_docs": 20, "batch_size": 8, "threads": 4},
    # the speedrun's phases at toy size on CPU (a 32-token model: windows 1x ... 4x)
    "gpu-speedrun dry run": {"windows": [32, 64, 128], "passkey_lengths": [256, 512], "passkey_cases": 1,
                             "max_doc_tokens": 128, "max_docs": 2, "batch_size": 4, "threads": 1},
    # the paper's Tables 1-2: windows 512 ... 32K (1x ... 64x), stride 512, 100 books truncated to 32K;
    # passkey 512 ... 32K, 100 cases; batch 1 (a 32K window's logits alone are 6.6 GB in fp32)
    "paper-350m": {"windows": [512 * 2**i for i in range(7)], "passkey_lengths": [512 * 2**i for i in range(7)],
                   "passkey_cases": 100, "max_doc_tokens": 32768, "max_docs": 100, "batch_size": 1, "threads": 4},
}
PROFILE_DEFAULTS["paper-350m dry run"] = PROFILE_DEFAULTS["gpu-speedrun dry run"]
DRY_RUN_PROFILES = ("gpu-speedrun", "paper-350m")


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
    parser.add_argument("--profile", choices=PROFILES, default="cpu-tiny",
                        help="cpu-tiny: 2.9M-parameter models on CPU; gpu-speedrun: 25M-parameter models on one GPU "
                             "from a data bundle, the step count from a throughput probe; paper-350m: the paper's "
                             "350M models through the deepspeed launcher on all local GPUs (or a hostfile)")
    parser.add_argument("--books", default=None,
                        help="cpu-tiny: training books, a directory of raw Project Gutenberg .txt files (headers are "
                             "stripped) or a datasets id ID[:SPLIT[:COLUMN]] (split train), e.g. "
                             "emozilla/pg19:train")
    parser.add_argument("--eval-books", default=None,
                        help="cpu-tiny, paper-350m: evaluation books, held out: a directory of .txt books (data/eval: "
                             "two PG-19 test books shipped with the repository) or a datasets id (split test), e.g. "
                             "emozilla/pg19-test (gpu-speedrun: the bundle's)")
    parser.add_argument("--dataset-max-books", type=int, default=100,
                        help="a datasets id given to --books or --eval-books: stream at most this many books")
    parser.add_argument("--bundle", type=Path, default=None,
                        help="gpu-speedrun: the data bundle (tools/build_data_bundle.py), unpacked into OUT/data/bundle "
                             "and verified")
    parser.add_argument("--bundle-sha256", default=None, metavar="HEX",
                        help="gpu-speedrun: the sha256 the bundle must have (default: the one in BUNDLE.sha256 beside "
                             "it, as the builder wrote it; a bundle with neither is refused)")
    parser.add_argument("--out", type=Path, required=True, help="output directory (data, runs, eval, results)")
    parser.add_argument("--dry-run", action="store_true",
                        help="gpu-speedrun, paper-350m: every phase at toy size on CPU (a 2-layer model, a few steps; "
                             "paper-350m: 2 ranks through the deepspeed launcher)")
    paper = parser.add_argument_group("paper-350m")
    paper.add_argument("--mix", type=Path, default=None,
                       help="the mix file every model trains on, read in place: yours, e.g. type: megatron sources "
                            "for your own shards (default: configs/data/paper_mix.yml, the paper's, streamed from "
                            "the HF hub; a dry run: configs/data/sample_mix.yml, offline)")
    paper.add_argument("--tokens", default=None,
                       help="training tokens per model, e.g. 10B (default: the paper's 2 epochs of its ~50B-token "
                            "sample = 100B)")
    paper.add_argument("--num-gpus", type=int, default=None,
                       help="ranks on this node (default: every local GPU; a dry run: 2 CPU ranks)")
    paper.add_argument("--hostfile", type=Path, default=None,
                       help="a DeepSpeed hostfile ('HOST slots=N' lines), passed to the launcher: several nodes")
    paper.add_argument("--master-port", type=int, default=None,
                       help="the launcher's --master_port (default: DeepSpeed's 29500; a dry run: a free port)")
    paper.add_argument("--mfu", type=float, default=None,
                       help="MFU the budget assumes, a fraction (default: measured by --gpu-check or a paper-350m "
                            "results-board row, else the users' command's on one H200: run_length.MEASURED)")
    paper.add_argument("--gpu-check", type=Path, default=None,
                       help="a gpu_check.json (tools/gpu_check.py) whose users' command (else throughput rows) gives "
                            "the budget a measured MFU")
    parser.add_argument("--only", default=",".join(PHASES),
                        help="comma list of phases to run (probe: gpu-speedrun only); the earlier ones must be done")
    parser.add_argument("--budget-seconds", type=float, default=SpeedrunBudget.total_seconds,
                        help="gpu-speedrun: wall time for training + evaluation of all four models")
    parser.add_argument("--eval-seconds", type=float, default=SpeedrunBudget.eval_seconds_per_model,
                        help="gpu-speedrun: evaluation allowance per model inside the budget")
    parser.add_argument("--probe-steps", type=int, default=SpeedrunBudget.probe_steps,
                        help="gpu-speedrun: steps per scheme in the throughput probe")
    parser.add_argument("--schemes", nargs="+", default=None, choices=SCHEMES,
                        help="models to train (default: all four; gpu-speedrun: the pair rope coca_slack, which fits "
                             "one 9-minute job with twice the tokens per model)")
    parser.add_argument("--train-iters", type=int, default=None,
                        help="optimizer steps per model (default: cpu-tiny train.train_iters of "
                             "configs/repro/tiny/*.yml; gpu-speedrun: from the probe)")
    parser.add_argument("--windows", default=None, help="perplexity context windows (default: the profile's)")
    parser.add_argument("--stride", type=int, default=None, help="sliding-window stride (default: the training length)")
    parser.add_argument("--max-doc-tokens", type=int, default=None,
                        help="evaluation books are truncated to this many tokens (shorter ones skipped)")
    parser.add_argument("--max-docs", type=int, default=None, help="evaluation books used at most")
    parser.add_argument("--passkey-lengths", default=None,
                        help="passkey prompt lengths in tokens; empty: no passkey test")
    parser.add_argument("--passkey-cases", type=int, default=None, help="passkey cases per length (the paper: 100)")
    parser.add_argument("--ntk-factors", default=_joined(DEFAULT_NTK_FACTORS),
                        help="dynamic NTK factors evaluated besides no scaling (rotary models); empty: none")
    parser.add_argument("--headline-ntk-factor", type=float, default=4.0,
                        help="the dynamic NTK factor shown in Tables 1 and 2 (one of --ntk-factors)")
    parser.add_argument("--batch-size", type=int, default=None, help="evaluation windows / passkey cases per forward")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for training and evaluation (cpu-tiny: 1, fastest when other jobs share "
                             "the cores)")
    parser.add_argument("--seed", type=int, default=1234, help="passkey keys and depths")
    parser.add_argument("--code-max-documents", type=int, default=None,
                        help="cpu-tiny: read at most this many stdlib source files (default: all)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override applied to every model, e.g. --set train.lr=1e-3")
    parser.add_argument("--config-dir", type=Path, default=None,
                        help="directory holding <scheme>.yml (default: the repository's configs/repro/tiny or "
                             "configs/repro/speedrun)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars or log lines (logs still written)")
    results_board.add_board_arguments(parser)
    return parser.parse_args(argv)


def _profile_default(args: argparse.Namespace, name: str) -> object:
    value = getattr(args, name)
    if value is not None:
        return value
    profile = args.profile + (" dry run" if args.profile in DRY_RUN_PROFILES and args.dry_run else "")
    default = PROFILE_DEFAULTS[profile][name]
    return _joined(default) if isinstance(default, list) else default  # type: ignore[arg-type]


def settings_from_args(args: argparse.Namespace) -> ReproSettings:
    if args.dry_run and args.profile not in DRY_RUN_PROFILES:
        raise ValueError(f"--dry-run: only the {' and '.join(DRY_RUN_PROFILES)} profiles have one "
                         f"(--profile {args.profile})")
    speedrun, paper_run = args.profile == "gpu-speedrun", args.profile == "paper-350m"
    if speedrun and (args.books is not None or args.eval_books is not None):
        raise ValueError("--books/--eval-books: the gpu-speedrun profile reads its books from --bundle")
    if paper_run and args.books is not None:
        raise ValueError("--books: the paper-350m profile trains on --mix")
    if not speedrun and (args.bundle is not None or args.bundle_sha256 is not None):
        raise ValueError(f"--bundle/--bundle-sha256: only the gpu-speedrun profile reads a bundle "
                         f"(--profile {args.profile})")
    paper_flags = {"--mix": args.mix, "--tokens": args.tokens, "--num-gpus": args.num_gpus,
                   "--hostfile": args.hostfile, "--master-port": args.master_port, "--mfu": args.mfu,
                   "--gpu-check": args.gpu_check}
    given = [flag for flag, value in paper_flags.items() if value is not None]
    if given and not paper_run:
        raise ValueError(f"{given[0]}: only the paper-350m profile takes it (--profile {args.profile})")
    if args.dataset_max_books < 1:
        raise ValueError(f"--dataset-max-books {args.dataset_max_books}: must be >= 1")
    passkey_lengths = str(_profile_default(args, "passkey_lengths"))
    windows = str(_profile_default(args, "windows"))
    budget = SpeedrunBudget(total_seconds=args.budget_seconds, eval_seconds_per_model=args.eval_seconds,
                            probe_steps=args.probe_steps)
    if args.probe_steps < 2:
        raise ValueError(f"--probe-steps {args.probe_steps}: must be >= 2 (the first interval holds the compile)")
    phases = [phase.strip() for phase in args.only.split(",") if phase.strip()]
    settings = ReproSettings(
        books=_as_path(args.books), eval_books=_as_path(args.eval_books), out_dir=args.out, profile=args.profile,
        bundle=args.bundle, bundle_sha256=args.bundle_sha256,
        dry_run=args.dry_run, phases=phases if speedrun else [p for p in phases if p != "probe"], budget=budget,
        schemes=args.schemes or list(SPEEDRUN_PAIR if speedrun else SCHEMES), train_iters=args.train_iters,
        windows=parse_int_list(windows, "--windows"),
        stride=args.stride, max_doc_tokens=int(_profile_default(args, "max_doc_tokens")),  # type: ignore[arg-type]
        max_docs=int(_profile_default(args, "max_docs")),  # type: ignore[arg-type]
        passkey_lengths=parse_int_list(passkey_lengths, "--passkey-lengths") if passkey_lengths.strip() else [],
        passkey_cases=int(_profile_default(args, "passkey_cases")),  # type: ignore[arg-type]
        ntk_factors=parse_float_list(args.ntk_factors, "--ntk-factors"),
        headline_ntk_factor=args.headline_ntk_factor,
        batch_size=int(_profile_default(args, "batch_size")),  # type: ignore[arg-type]
        threads=int(_profile_default(args, "threads")),  # type: ignore[arg-type]
        seed=args.seed, code_max_documents=args.code_max_documents, overrides=args.overrides,
        progress=not args.quiet,
        paper=PaperRunSettings(mix=args.mix, tokens=None if args.tokens is None else parse_tokens(args.tokens),
                               num_gpus=args.num_gpus, hostfile=args.hostfile, master_port=args.master_port,
                               mfu=args.mfu, gpu_check=args.gpu_check, board=mfu_board(args)))
    if args.config_dir is not None:
        settings.config_dir = args.config_dir
    elif speedrun:
        settings.config_dir = SPEEDRUN_CONFIG_DIR
    elif paper_run:
        settings.config_dir = PAPER_CONFIG_DIR
    return settings


def mfu_board(args: argparse.Namespace) -> Path | None:
    """The board whose rows may give paper-350m's budget a measured MFU: the --board named, else the repository's
    docs/results.md (read, never written unless --repo-board); none with --no-board."""
    if args.no_board:
        return None
    return args.board if args.board is not None else results_board.REPOSITORY_BOARD


def _as_path(spec: str | None) -> Path | None:
    return None if spec is None else Path(spec)


def with_books_on_disk(settings: ReproSettings, args: argparse.Namespace) -> ReproSettings:
    """The settings with --books / --eval-books as directories of .txt books: a datasets id's books are
    streamed and written out once under OUT/data/books (parsing alone never downloads)."""
    cache = args.out / "data" / "books"
    books = None if args.books is None else books_directory(args.books, "--books", cache, "train",
                                                             args.dataset_max_books)
    eval_books = None if args.eval_books is None else books_directory(args.eval_books, "--eval-books", cache,
                                                                      "test", args.dataset_max_books)
    return replace(settings, books=books, eval_books=eval_books)


@cli_main
def main(argv: list[str] | None = None) -> int:
    from megatron_lite.eval.long_context import EvalOutOfMemory
    from megatron_lite.repro import TrainingFailed, run_reproduction
    from megatron_lite.repro.pipeline import print_paper_budget

    args = parse_args(argv)
    settings = settings_from_args(args)
    board = results_board.board_from_args(args)
    if settings.profile == "paper-350m":
        settings = print_paper_budget(settings)  # before anything runs, the eval books' download included
    try:
        results = run_reproduction(with_books_on_disk(settings, args))
    except (TrainingFailed, EvalOutOfMemory) as error:
        print_error(error)
        return 1
    except KeyboardInterrupt:
        print("interrupted: run the same command again to resume (finished models and results are kept)",
              file=sys.stderr)
        return 130
    finished = "plots" in results  # a report was written (not stopped early by --only)
    if not args.quiet and finished:
        print((args.out / "tables.md").read_text())
    if board is not None and finished:
        row = results_board.reproduction_row(results, profile=args.profile, dry_run=args.dry_run,
                                             device=results_board.device_name())
        board.append(results_board.REPRODUCTIONS, row)
        if not args.quiet:
            print(f"appended a row to {board.path}")
    return 0


if __name__ == "__main__":
    run_cli(main)
