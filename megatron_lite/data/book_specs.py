"""Where books come from: a local path, or a Hugging Face ``datasets`` id.

A book spec (``--ppl-docs``, ``--docs``, ``--books``, ``--eval-books``) is

- an existing path: a directory of ``.txt`` books (one book per file, read recursively), a directory or
  file of parquet (one book per row), a single ``.txt`` file, or a dataset written by ``save_to_disk``;
- otherwise a ``datasets`` id, ``ID[:SPLIT[:COLUMN]]`` (e.g. ``emozilla/pg19-test``, ``emozilla/pg19:train``),
  streamed with ``datasets.load_dataset`` so only the books read are fetched. The original ``deepmind/pg19``
  is a loading-script dataset that the pinned ``datasets`` cannot load; its parquet copies can.

The repository ships two PG-19 test books in ``data/eval`` (:data:`SAMPLE_BOOKS`).
Tools that need a directory of ``.txt`` files (training books, the data bundle) get one from
:func:`books_directory`, which writes a non-directory spec's books out once, one file per book.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from megatron_lite.config import SourceConfig
from megatron_lite.data.records import Document
from megatron_lite.data.sources import read_source

SAMPLE_BOOKS = Path(__file__).resolve().parents[2] / "data" / "eval"  # the shipped evaluation books
_FILE_TYPES = {".txt": "text", ".parquet": "parquet"}  # a single book file's suffix -> source type


@dataclass(frozen=True)
class DatasetId:
    """A ``datasets`` id with the split and text column to read."""

    path: str
    split: str
    column: str


def looks_local(spec: str) -> bool:
    """A spec written as a file-system path (even a missing one), never a ``datasets`` id: so a mistyped
    path (``data/evall``, its first part an existing directory) is reported, not looked up on the hub."""
    head = spec.split(":", 1)[0]
    return (spec.startswith((".", "/", "~")) or head.endswith(tuple(_FILE_TYPES)) or head.count("/") > 1
            or Path(head.split("/", 1)[0]).is_dir())


def parse_dataset_id(spec: str, flag: str, split: str, column: str) -> DatasetId:
    """``ID[:SPLIT[:COLUMN]]``; an omitted SPLIT or COLUMN takes ``split`` / ``column``."""
    parts = spec.split(":")
    if len(parts) > 3 or not all(parts):
        raise ValueError(f"{flag} {spec!r}: not an existing path, nor a datasets id ID[:SPLIT[:COLUMN]]")
    return DatasetId(parts[0], parts[1] if len(parts) > 1 else split, parts[2] if len(parts) > 2 else column)


def text_source(spec: str, flag: str, split: str = "test", text_field: str = "text", strip_gutenberg: bool = False,
                max_documents: int | None = None) -> SourceConfig:
    """The data-pipeline source a book spec stands for (``split``/``text_field``: a datasets id's defaults,
    and the split of a ``save_to_disk`` dataset dict)."""
    path = Path(spec)
    common = dict(text_field=text_field, strip_gutenberg=strip_gutenberg, normalize_newlines=True,
                  deduplicate=False, min_chars=1, max_documents=max_documents)
    if path.is_dir():
        if any(path.rglob("*.parquet")):
            return SourceConfig(type="parquet", path=spec, **common)  # type: ignore[arg-type]
        if any(path.rglob("*.txt")):
            return SourceConfig(type="text", path=spec, **common)  # type: ignore[arg-type]
        if (path / "dataset_info.json").is_file() or (path / "state.json").is_file() \
                or (path / "dataset_dict.json").is_file():
            return SourceConfig(type="hf", path=spec, split=split, **common)  # type: ignore[arg-type]
        raise ValueError(f"{flag} {spec!r}: directory holds no .txt or .parquet files")
    if path.is_file():
        if path.suffix in _FILE_TYPES:
            return SourceConfig(type=_FILE_TYPES[path.suffix], path=spec, **common)  # type: ignore[arg-type]
        raise ValueError(f"{flag} {spec!r}: a file must be .txt or .parquet")
    if looks_local(spec):
        raise ValueError(f"{flag} {spec!r}: no such file or directory")
    dataset = parse_dataset_id(spec, flag, split, text_field)
    common["text_field"] = dataset.column
    # streamed, so the first max_documents books are read without fetching the whole split
    return SourceConfig(type="hf", path=dataset.path, split=dataset.split, streaming=True,  # type: ignore[arg-type]
                        **common)


def _holds_txt_books(path: Path) -> bool:
    return path.is_dir() and not any(path.rglob("*.parquet")) and any(path.rglob("*.txt"))


def books_directory(spec: str, flag: str, cache_root: Path, split: str,
                    max_documents: int | None = None) -> Path:
    """A directory of ``.txt`` books for ``spec``: the spec itself when it is one; otherwise its books,
    raw (cleaning happens where they are read), written once as ``cache_root/<spec>/NNNNNN.txt`` and reused."""
    if _holds_txt_books(Path(spec)):
        return Path(spec)
    source = text_source(spec, flag, split=split, max_documents=max_documents)
    limit = "all" if max_documents is None else f"first{max_documents}"
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{spec}_{source.split}_{source.text_field}_{limit}").strip("_")
    target = cache_root / name
    if target.is_dir():  # only a finished copy is ever renamed into place
        return target
    partial = cache_root / f"{name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    written = 0
    for record in read_source(source, flag.lstrip("-")):
        if isinstance(record, Document):
            (partial / f"{written:06d}.txt").write_text(record.text, encoding="utf-8")
            written += 1
    if not written:
        shutil.rmtree(partial)
        raise ValueError(f"{flag} {spec!r}: no readable books (split {source.split!r}, column {source.text_field!r})")
    partial.rename(target)
    return target
