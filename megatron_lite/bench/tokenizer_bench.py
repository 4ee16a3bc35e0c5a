"""Tokenizer benchmark (tools/bench_tokenizer.py): bytes per token on held-out text of each group for
SentencePiece models trained on samples of different sizes, and for a given tokenizer (GPT-NeoX-20B's
tokenizer.json, ...).

Each group's documents (cleaned as preprocessing cleans them) are split by position: every
``holdout_every``-th document is held out, the rest is the training pool. A sample of N characters
draws the group's share of N (the mix's group weights, 75/25 by default) from the start of its pool
and is capped at what the pool holds: the table states the sizes actually drawn. Training uses the
project's recipe (``megatron_lite.data.tokenizer.train_tokenizer``); bytes per token = UTF-8 bytes of
the held-out documents / their tokens (no EOD), so a higher figure packs more text into a
context window and a training token budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_lite.config import SourceConfig
from megatron_lite.data.cleaning import Cleaner
from megatron_lite.data.records import Document
from megatron_lite.data.sources import read_source
from megatron_lite.data.tokenizer import AnyTokenizer, load_tokenizer, train_tokenizer
from megatron_lite.data.tokenizer import _truncate as take_chars  # the mix sample's own cut: documents up to N chars

DEFAULT_GROUP_WEIGHTS = {"text": 0.75, "code": 0.25}  # the paper mix's groups


@dataclass
class GroupSplit:
    """One group's cleaned documents: the training pool and the held-out documents."""

    pool: list[str] = field(default_factory=list)
    held_out: list[str] = field(default_factory=list)

    @property
    def pool_chars(self) -> int:
        return sum(map(len, self.pool))

    @property
    def held_out_bytes(self) -> int:
        return sum(len(text.encode("utf-8")) for text in self.held_out)


def split_group(sources: Iterable[SourceConfig], holdout_every: int) -> GroupSplit:
    """Every ``holdout_every``-th cleaned document (counted across the group's sources) held out."""
    if holdout_every < 2:
        raise ValueError(f"holdout_every={holdout_every}: must be >= 2 (one document in N is held out)")
    split, index = GroupSplit(), 0
    for source in sources:
        cleaner = Cleaner(source)
        for record in read_source(source, str(source.path or source.type)):
            if isinstance(record, Document) and (text := cleaner(record.text, record.location)) is not None:
                (split.held_out if index % holdout_every == 0 else split.pool).append(text)
                index += 1
    return split


def bytes_per_token(tokenizer: AnyTokenizer, texts: list[str]) -> tuple[int, int]:
    """(UTF-8 bytes, tokens) of ``texts`` as the tokenizer encodes documents (no EOD)."""
    tokens = sum(len(ids) for ids in tokenizer.encode_documents(texts))
    return sum(len(text.encode("utf-8")) for text in texts), tokens


def measure(tokenizer: AnyTokenizer, groups: dict[str, GroupSplit]) -> dict[str, dict[str, float]]:
    """Per group: held-out bytes, tokens and bytes per token."""
    figures = {}
    for name, split in groups.items():
        size, tokens = bytes_per_token(tokenizer, split.held_out)
        figures[name] = {"bytes": size, "tokens": tokens, "bytes_per_token": size / max(tokens, 1)}
    return figures


def run_benchmark(groups: dict[str, GroupSplit], sample_chars: list[int], vocab_size: int, out_dir: Path,
                  given_tokenizers: Sequence[Path] = (), group_weights: dict[str, float] | None = None,
                  num_threads: int = 1, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Train one model per sample size (written to ``out_dir/<chars>/tokenizer.model``), then measure it and
    every given tokenizer on each group's held-out documents."""
    weights = group_weights or DEFAULT_GROUP_WEIGHTS
    total_weight = sum(weights[name] for name in groups)
    rows = []
    for requested in sample_chars:
        sample = {name: take_chars(split.pool, int(requested * weights[name] / total_weight))
                  for name, split in groups.items()}
        drawn = {name: sum(map(len, texts)) for name, texts in sample.items()}
        progress(f"training {vocab_size} pieces on {sum(drawn.values()):,} chars ({drawn})")
        start = time.perf_counter()
        tokenizer = train_tokenizer([text for texts in sample.values() for text in texts],
                                    out_dir / str(requested) / "tokenizer.model", vocab_size, num_threads=num_threads)
        seconds = time.perf_counter() - start
        rows.append({"tokenizer": f"SentencePiece BPE, {requested:,}-char sample", "requested_chars": requested,
                     "sample_chars": drawn, "train_seconds": round(seconds, 1), "vocab_size": tokenizer.vocab_size,
                     "groups": measure(tokenizer, groups)})
        progress(f"  trained in {seconds:.0f}s: {rows[-1]['groups']}")
    for path in given_tokenizers:
        tokenizer = load_tokenizer(path)
        rows.append({"tokenizer": str(path), "vocab_size": tokenizer.vocab_size, "groups": measure(tokenizer, groups)})
    return {"vocab_size": vocab_size, "group_weights": weights, "rows": rows,
            "pool_chars": {name: split.pool_chars for name, split in groups.items()},
            "held_out": {name: {"documents": len(split.held_out), "bytes": split.held_out_bytes}
                         for name, split in groups.items()}}


def format_report(result: dict[str, Any]) -> str:
    """Markdown table: one row per tokenizer, bytes per token per group."""
    names = list(result["held_out"])
    header = ("| tokenizer | sample chars (" + " + ".join(names) + ") | vocab | "
              + " | ".join(f"{name} bytes/token" for name in names) + " | train s |")
    lines = [header, "|---|---:|---:|" + "---:|" * len(names) + "---:|"]
    for row in result["rows"]:
        drawn = row.get("sample_chars")
        sizes = " + ".join(f"{drawn[name]:,}" for name in names) if drawn else "–"
        figures = " | ".join(f"{row['groups'][name]['bytes_per_token']:.3f}" for name in names)
        lines.append(f"| {row['tokenizer']} | {sizes} | {row['vocab_size']:,} | {figures} | "
                     f"{row.get('train_seconds', '–')} |")
    held = ", ".join(f"{name} {info['documents']} documents, {info['bytes']:,} bytes"
                     for name, info in result["held_out"].items())
    return "\n".join(lines) + f"\n\nheld out: {held}"
