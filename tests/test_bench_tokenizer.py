"""tools/bench_tokenizer.py on a toy corpus: held-out documents stay out of every sample, samples are capped at
what a group holds, and trained and given tokenizers are measured on the same held-out bytes."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from megatron_lite.bench.tokenizer_bench import format_report, run_benchmark, split_group
from megatron_lite.config import SourceConfig

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches "
         "under pale yellow lamps near old harbour walls").split()


def write_corpus(root: Path) -> tuple[Path, Path]:
    """Ten prose books (Gutenberg markers around them) and ten small Python files."""
    rng = random.Random(0)
    books, code = root / "books", root / "code"
    books.mkdir(parents=True)
    code.mkdir()
    for index in range(10):
        body = "\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(300))
        (books / f"{index:02d}.txt").write_text(f"header\n*** START OF THE PROJECT GUTENBERG EBOOK {index} ***\n"
                                                f"{body}\n*** END OF THE PROJECT GUTENBERG EBOOK {index} ***\n")
        functions = "\n\n".join(f"def {rng.choice(WORDS)}_{n}(value):\n    return value + {n}\n" for n in range(60))
        (code / f"module_{index}.py").write_text(functions)
    return books, code


def test_split_holds_out_every_nth_cleaned_document(tmp_path: Path) -> None:
    books, _ = write_corpus(tmp_path)
    split = split_group([SourceConfig(type="text", path=str(books), strip_gutenberg=True)], holdout_every=5)
    assert len(split.held_out) == 2 and len(split.pool) == 8
    assert not any("PROJECT GUTENBERG" in text for text in split.pool + split.held_out)
    with pytest.raises(ValueError, match="holdout_every=1"):
        split_group([], holdout_every=1)


def test_benchmark_trains_per_sample_size_and_measures_given_tokenizers(tmp_path: Path) -> None:
    books, code = write_corpus(tmp_path / "corpus")
    groups = {"text": split_group([SourceConfig(type="text", path=str(books), strip_gutenberg=True)], 5),
              "code": split_group([SourceConfig(type="python_code", path=str(code))], 5)}
    result = run_benchmark(groups, [40_000, 10_000_000], 400, tmp_path / "out", progress=lambda line: None)
    small, capped = result["rows"]
    assert small["sample_chars"] == {"text": 30_000, "code": 10_000}
    assert capped["sample_chars"] == result["pool_chars"]  # more than the pools hold: all of them
    for row in (small, capped):
        for name, figures in row["groups"].items():
            assert figures["bytes"] == result["held_out"][name]["bytes"] > 0
            assert figures["bytes_per_token"] == figures["bytes"] / figures["tokens"] > 1.0
    given = run_benchmark(groups, [], 400, tmp_path / "unused", [tmp_path / "out" / "40000" / "tokenizer.model"],
                          progress=lambda line: None)
    assert given["rows"][0]["groups"] == small["groups"]
    report = format_report(result)
    assert "text bytes/token" in report and "30,000 + 10,000" in report
    json.dumps(result)
