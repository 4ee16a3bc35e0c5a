"""Document readers, one per mix source type, yielding documents or bad records in a fixed order.

Every reader yields :class:`Document` (text + a location string: ``file:line``, ``file``,
``file:row N``, ``hub-id[config]:split:row N``) or :class:`BadRecord` (problem, location, detail)
instead of dropping a record it cannot use: the caller counts, reports or aborts (``--strict``).
Heavy libraries (datasets, pyarrow) are imported by the readers that need them.
"""

from __future__ import annotations

import codecs
import dataclasses
import glob
import gzip
import hashlib
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from megatron_lite.config import SourceConfig
from megatron_lite.data import sample_corpus
from megatron_lite.data.records import EMPTY, INVALID_JSON, MISSING_FIELD, NON_UTF8, BadRecord, Document, Record, make_record

# Bad-record problems (a record present in the source that cannot become a document).
# Files a directory path stands for, per local source type.
SUFFIXES: dict[str, tuple[str, ...]] = {
    "jsonl": (".jsonl", ".json", ".jsonl.gz", ".json.gz"),
    "text": (".txt",),
    "parquet": (".parquet",),
}


def expand_paths(path: str, suffixes: tuple[str, ...], name: str) -> list[Path]:
    """A file, a directory (files with ``suffixes``, recursively) or a glob; sorted for a fixed order."""
    if glob.has_magic(path):
        files = [Path(p) for p in glob.glob(path, recursive=True) if os.path.isfile(p)]
    elif os.path.isdir(path):
        files = [p for p in Path(path).rglob("*") if p.is_file() and p.name.endswith(suffixes)]
    elif os.path.isfile(path):
        files = [Path(path)]
    else:
        raise ValueError(f"source {name}: path={path!r} does not exist")
    if not files:
        raise ValueError(f"source {name}: path={path!r} matches no files (looked for {', '.join(suffixes)})")
    return sorted(files)


def _strip_shard_suffix(path: str) -> str:
    return path[:-4] if path.endswith((".bin", ".idx")) else path


def megatron_prefixes(path: str, name: str) -> list[str]:
    """Absolute MMIDIDX prefixes of a ``type: megatron`` path, sorted: a prefix (or one of its two
    files), a directory (every ``*.idx`` below it) or a glob of .bin/.idx files, directories or prefixes.
    Each prefix must have both files."""
    if glob.has_magic(path):
        matches = glob.glob(path, recursive=True) + glob.glob(path + ".idx", recursive=True)  # files or prefixes
        dirs = [m for m in matches if os.path.isdir(m)]
        found = {_strip_shard_suffix(m) for m in matches if os.path.isfile(m) and m.endswith((".bin", ".idx"))}
        found.update(str(p)[:-4] for d in dirs for p in Path(d).rglob("*.idx") if p.is_file())
    elif os.path.isdir(path):
        found = {str(p)[:-4] for p in Path(path).rglob("*.idx") if p.is_file()}
    elif os.path.isfile(_strip_shard_suffix(path) + ".idx") or os.path.isfile(_strip_shard_suffix(path) + ".bin"):
        found = {_strip_shard_suffix(path)}
    else:
        raise ValueError(f"source {name}: path={path!r} is neither a shard prefix (no {path}.idx), a directory "
                         "nor a glob")
    if not found:
        raise ValueError(f"source {name}: path={path!r} matches no MMIDIDX shards (looked for .idx/.bin files)")
    prefixes = sorted({os.path.abspath(prefix) for prefix in found})
    for prefix in prefixes:
        for suffix, other in ((".bin", ".idx"), (".idx", ".bin")):
            if not os.path.isfile(prefix + suffix):
                raise ValueError(f"source {name}: {prefix}{suffix} is missing (its {other} is there)")
    return prefixes


def source_settings(source: SourceConfig) -> dict[str, Any]:
    """The source's settings as a dict for cache keys; ``tokenizer`` (added later, megatron only) is left
    out when unset, and ``encoding`` when it is the default, so that caches keyed before they existed stay valid."""
    settings = dataclasses.asdict(source)
    if settings.get("tokenizer") is None:
        settings.pop("tokenizer", None)
    if settings.get("encoding") == "utf-8":  # likewise the default encoding (added later)
        settings.pop("encoding", None)
    return settings


# ----------------------------------------------------------------------------------------------
# Readers


def _open_binary(path: Path) -> BinaryIO:
    return gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")  # type: ignore[return-value]


def read_jsonl(source: SourceConfig, name: str) -> Iterator[Record]:
    """JSON lines (optionally .gz), one document per line, text in ``text_field``."""
    field = source.text_field
    for path in expand_paths(str(source.path), SUFFIXES["jsonl"], name):
        with _open_binary(path) as handle:
            for number, raw in enumerate(handle, start=1):
                location = f"{path}:{number}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as error:
                    yield BadRecord(NON_UTF8, location, f"invalid UTF-8 at byte {error.start} of the line")
                    continue
                if not line.strip():
                    yield BadRecord(EMPTY, location, "blank line")
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    yield BadRecord(INVALID_JSON, location, error.msg + f" at column {error.colno}")
                    continue
                if not isinstance(record, dict):
                    yield BadRecord(INVALID_JSON, location, f"expected a JSON object, got {type(record).__name__}")
                elif field not in record:
                    yield BadRecord(MISSING_FIELD, location, f"no field {field!r} (keys: {', '.join(sorted(record))})")
                else:
                    yield make_record(record[field], location, field)


# "Character set encoding: ISO-8859-1" in a Project Gutenberg header (the first few KB of the file).
_GUTENBERG_CHARSET = re.compile(rb"^\s*Character set encoding:\s*([A-Za-z0-9_.:\-]+)", re.IGNORECASE | re.MULTILINE)
GUTENBERG_HEADER_BYTES = 16384
# Latin-1 files in the wild hold Windows "smart quotes" (0x80-0x9F): read them as cp1252, as browsers do.
_SUPERSET = {"iso8859-1": "cp1252", "latin-1": "cp1252", "ascii": "cp1252"}


def declared_charset(raw: bytes) -> str | None:
    """The Python codec named by a Project Gutenberg header's charset line, or None (absent/unknown)."""
    match = _GUTENBERG_CHARSET.search(raw[:GUTENBERG_HEADER_BYTES])
    if not match:
        return None
    try:
        info = codecs.lookup(match.group(1).decode("ascii"))
    except LookupError:
        return None
    return info.name if getattr(info, "_is_text_encoding", True) else None  # not base64, rot13, ...


def decode_auto(raw: bytes) -> str:
    """``encoding: auto``: UTF-8 if valid, else the declared Gutenberg charset, else cp1252, else latin-1."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        pass
    declared = declared_charset(raw)
    candidates = [_SUPERSET.get(declared, declared)] if declared and declared != "utf-8" else []
    if declared in _SUPERSET:
        candidates.append(declared)  # bytes undefined in cp1252 (0x81, 0x8D, ...): the declared codec itself
    for encoding in candidates + ["cp1252"]:
        try:
            return raw.decode(encoding)
        except UnicodeDecodeError:
            continue
    return raw.decode("latin-1")  # every byte is a character: never fails


def read_text(source: SourceConfig, name: str) -> Iterator[Record]:
    """Plain-text files, one document per file (directories: every ``*.txt`` below them); decoded as UTF-8
    (``encoding: utf-8``, invalid -> a non_utf8 bad record) or by :func:`decode_auto`."""
    for path in expand_paths(str(source.path), SUFFIXES["text"], name):
        raw = path.read_bytes()
        yield make_record(decode_auto(raw) if source.encoding == "auto" else raw, str(path))


def read_parquet(source: SourceConfig, name: str) -> Iterator[Record]:
    """Parquet files, one document per row, reading only the text column in batches."""
    import pyarrow.parquet as pq

    field = source.text_field
    for path in expand_paths(str(source.path), SUFFIXES["parquet"], name):
        parquet = pq.ParquetFile(path)
        columns = parquet.schema_arrow.names
        if field not in columns:
            detail = f"no column {field!r} (columns: {', '.join(columns)})"
            for row in range(parquet.metadata.num_rows):
                yield BadRecord(MISSING_FIELD, f"{path}:row {row}", detail)
            continue
        row = 0
        for batch in parquet.iter_batches(batch_size=1024, columns=[field]):
            for value in batch.column(0).to_pylist():
                yield make_record(value, f"{path}:row {row}", field)
                row += 1


def _is_saved_dataset(path: str) -> bool:
    """A directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``."""
    return os.path.isfile(os.path.join(path, "state.json")) or os.path.isfile(os.path.join(path, "dataset_dict.json"))


def read_hf(source: SourceConfig, name: str) -> Iterator[Record]:
    """A ``datasets`` hub id, a local copy of a hub repo, or a ``save_to_disk`` directory.

    Hub ids and local repo copies go through the same call,
    ``load_dataset(path, name, split=..., streaming=..., data_files=...)``; ``save_to_disk``
    output is not a repo layout, so it is opened with ``load_from_disk`` instead.
    """
    import datasets

    path, field = str(source.path), source.text_field
    if os.path.isdir(path) and _is_saved_dataset(path):
        dataset: Any = datasets.load_from_disk(path)
        if isinstance(dataset, datasets.DatasetDict):
            if source.split not in dataset:
                raise ValueError(f"source {name}: split={source.split!r} not in {path} (splits: {', '.join(dataset)})")
            dataset = dataset[source.split]
        if source.streaming:
            dataset = dataset.to_iterable_dataset()
    else:
        dataset = datasets.load_dataset(
            path, source.name, split=source.split, streaming=source.streaming, data_files=source.data_files
        )
    columns = dataset.column_names  # None for some streaming datasets (features unknown)
    if columns and field in columns:
        dataset = dataset.select_columns([field])  # skip decoding unused columns
    label = path + (f"[{source.name}]" if source.name else "") + f":{source.split}"
    for row, record in enumerate(dataset):
        location = f"{label}:row {row}"
        if field not in record:
            yield BadRecord(MISSING_FIELD, location, f"no field {field!r} (fields: {', '.join(sorted(record))})")
        else:
            yield make_record(record[field], location, field)


def read_megatron(source: SourceConfig, name: str) -> Iterator[Record]:
    """Pre-tokenised shards hold token ids, not text: nothing here can read them as documents."""
    raise ValueError(f"source {name}: type megatron holds token ids (MMIDIDX shards at {source.path!r}), not text; "
                     "it can only be trained on (tools/preprocess_data.py, train.py), not read as documents")


READERS: dict[str, Callable[[SourceConfig, str], Iterator[Record]]] = {
    "jsonl": read_jsonl,
    "text": read_text,
    "parquet": read_parquet,
    "hf": read_hf,
    "python_docs": sample_corpus.read_python_docs,
    "python_code": sample_corpus.read_python_code,
    "megatron": read_megatron,
}


def read_source(source: SourceConfig, name: str = "source") -> Iterator[Record]:
    """Documents and bad records of one source in a deterministic order; at most
    ``max_documents`` documents (bad records do not count towards it)."""
    reader = READERS[source.type]
    documents = 0
    for record in reader(source, name):
        yield record
        if isinstance(record, Document):
            documents += 1
            if source.max_documents is not None and documents >= source.max_documents:
                return


def input_fingerprint(source: SourceConfig, name: str = "source") -> str:
    """Cheap change detector for local inputs: sha256 over (path, size, mtime) of every file read.

    Hub datasets cannot be fingerprinted without network access; their id/config/split (part of
    the source config hash) identify them. The built-in corpus also depends on the Python version.
    """
    files: list[Path] = []
    extra = ""
    if source.type in ("python_docs", "python_code"):
        files = sample_corpus.input_files(source)
        extra = sys.version
    elif source.type in SUFFIXES:
        files = expand_paths(str(source.path), SUFFIXES[source.type], name)
    elif source.type == "megatron":
        files = [Path(prefix + suffix) for prefix in megatron_prefixes(str(source.path), name)
                 for suffix in (".bin", ".idx")]
    elif source.type == "hf" and os.path.isdir(str(source.path)):  # a local copy
        root = Path(str(source.path))
        files = sorted(p for p in root.rglob("*") if p.is_file() and not any(
            part.startswith(".") for part in p.relative_to(root).parts))  # skip .cache/, .git/
    digest = hashlib.sha256(extra.encode())
    for path in files:
        stat = path.stat()
        digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()
