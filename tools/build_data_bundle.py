#!/usr/bin/env python
"""Build the speedrun's data bundle: tokenizer + pre-tokenised shards (75% books, 25% Python) + held-out books, .tar.xz.

    python tools/build_data_bundle.py --books emozilla/pg19:train --eval-books data/eval \\
        --out bundles/speedrun_bundle.tar.xz --wheels wheels

--books and --eval-books take directories of .txt books or datasets ids ID[:SPLIT[:COLUMN]] (streamed,
at most --dataset-max-books books each, written out as .txt under --work-dir/books or a temporary dir);
data/eval holds two PG-19 test books shipped with the repository.

The same inputs give the same bytes (fixed order, mtimes, owners and lzma filters). Prints the tokens per
group (at least --min-tokens in all, or it fails), the bundle's size and sha256, and what must travel to
an offline node: the bundle + the repository's tracked files + --wheels, against the 64 MiB limit. Writes
BUNDLE and BUNDLE.sha256 (sha256sum format). Unpack and verify with megatron_lite.repro.bundle.unpack_bundle
(tools/reproduce.py --profile gpu-speedrun --bundle BUNDLE does it).
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

from megatron_lite.cli import cli_main, run_cli
from megatron_lite.data.book_specs import books_directory
from megatron_lite.repro.bundle import BundleSpec, build_bundle, default_code_dirs, timed_unpack

REPO_ROOT = Path(__file__).resolve().parents[1]
TRAVEL_LIMIT_MIB = 64.0
MIB = float(1 << 20)


def repository_bytes(root: Path) -> int:
    """Bytes of the repository's tracked files (what a copy of the working tree carries)."""
    try:
        listing = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        raise ValueError(f"git ls-files failed in {root} ({error}); the repository size is unknown") from None
    names = [name for name in listing.decode().split("\0") if name]
    return sum((root / name).stat().st_size for name in names if (root / name).is_file())


def wheels_bytes(directory: Path | None) -> int:
    if directory is None:
        return 0
    if not directory.is_dir():
        raise ValueError(f"--wheels {directory}: no such directory (make it with tools/fetch_wheels.py --out DIR)")
    return sum(path.stat().st_size for path in directory.glob("*.whl"))


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--books", nargs="+", required=True,
                        help="directories of Gutenberg .txt books or datasets ids (split train), e.g. emozilla/pg19")
    parser.add_argument("--eval-books", required=True,
                        help="held-out evaluation books, shipped as text and excluded from training: a directory of "
                             ".txt books (e.g. data/eval) or a datasets id (split test), e.g. emozilla/pg19-test")
    parser.add_argument("--dataset-max-books", type=int, default=400,
                        help="a datasets id given to --books or --eval-books: stream at most this many books")
    parser.add_argument("--out", type=Path, required=True, help="the bundle, BUNDLE.tar.xz")
    parser.add_argument("--code", type=Path, nargs="+", default=None,
                        help="directories of .py files for the code group (default: the standard library and "
                             "site-packages)")
    parser.add_argument("--vocab-size", type=int, default=16_000, help="SentencePiece vocabulary")
    parser.add_argument("--min-tokens", type=int, default=30_000_000, help="tokens the bundle must hold at least")
    parser.add_argument("--sample-chars", type=int, default=10_000_000, help="tokenizer training sample")
    parser.add_argument("--workers", type=int, default=2, help="tokenisation processes")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="keep the staging and data cache here (reused by a rebuild); default: a temporary dir")
    parser.add_argument("--wheels", type=Path, default=None, help="wheels that travel too (tools/fetch_wheels.py)")
    parser.add_argument("--no-verify", action="store_true", help="skip the test unpack + verify of the result")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    for flag, value in (("--vocab-size", args.vocab_size), ("--min-tokens", args.min_tokens),
                        ("--sample-chars", args.sample_chars), ("--workers", args.workers),
                        ("--dataset-max-books", args.dataset_max_books)):
        if value < 1:
            raise ValueError(f"{flag} {value}: must be positive")
    if args.out.name.endswith(".sha256") or args.out.is_dir():
        raise ValueError(f"--out {args.out}: expected a file name such as speedrun_bundle.tar.xz")
    extra = wheels_bytes(args.wheels)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".books-", dir=args.out.parent) as scratch:
        books_cache = args.work_dir / "books" if args.work_dir is not None else Path(scratch)
        books = tuple(books_directory(given, "--books", books_cache, "train", args.dataset_max_books)
                      for given in args.books)
        eval_books = books_directory(args.eval_books, "--eval-books", books_cache, "test", args.dataset_max_books)
        spec = BundleSpec(books=books, eval_books=eval_books, out=args.out,
                          code=tuple(args.code) if args.code else default_code_dirs(), vocab_size=args.vocab_size,
                          min_tokens=args.min_tokens, sample_chars=args.sample_chars, workers=args.workers,
                          work_dir=args.work_dir, progress=not args.no_progress)
        result = build_bundle(spec)
    tokens = result.manifest["tokens"]
    for excluded in result.excluded:
        print(f"excluded from training (an evaluation book has its content): {excluded}")
    print(f"tokens: text {tokens['text']:,} + code {tokens['code']:,} = {tokens['total']:,} "
          f"(text {result.manifest['text_share']:.1%}; vocab {result.manifest['vocab_size']:,}; "
          f"min {args.min_tokens:,})")
    print(f"bundle: {result.archive} {result.bytes / MIB:.2f} MiB, sha256 {result.sha256} (built in {result.seconds:.0f} s)")
    if not args.no_verify:
        with tempfile.TemporaryDirectory(prefix=".verify-", dir=args.out.parent) as scratch:
            _, seconds = timed_unpack(result.archive, Path(scratch) / "bundle")
        print(f"unpack + verify: {seconds:.1f} s")
    repository = repository_bytes(REPO_ROOT)
    total = result.bytes + repository + extra
    wheels = f" + wheels {extra / MIB:.2f} MiB ({args.wheels})" if args.wheels else " (no --wheels given)"
    verdict = "within" if total <= TRAVEL_LIMIT_MIB * MIB else "OVER"
    print(f"travels: bundle {result.bytes / MIB:.2f} MiB + repository {repository / MIB:.2f} MiB{wheels} = "
          f"{total / MIB:.2f} MiB, {verdict} the {TRAVEL_LIMIT_MIB:g} MiB limit")
    return 0 if verdict == "within" else 1


if __name__ == "__main__":
    run_cli(main)
