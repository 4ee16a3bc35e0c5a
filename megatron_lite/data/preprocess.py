"""Tokenise every source of the mix into MMIDIDX shards under ``data.cache_dir`` (see manifest.py).

``prepare_data(config.data, config.model.vocab_size)`` is the one entry point
(tools/preprocess_data.py, data/*/prepare.py and the training loop call it): tokenizer first
(trained from the mix, or the configured SentencePiece model / Hugging Face tokenizer.json copied into
the cache), then each source. It is
idempotent: a source whose manifest entry is complete for the same source-config hash (settings +
local input fingerprint) and tokenizer hash is not read again, and an interrupted source resumes
after its last finished shard.

Documents are encoded by ``multiprocessing`` workers in chunks; results are consumed in
submission order, so the shards are byte-identical for any worker count.
"""

from __future__ import annotations

import copy
import dataclasses
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from megatron_lite.config import DataConfig, MixConfig, SourceConfig
from megatron_lite.data.cache_lock import CacheBuild, building
from megatron_lite.console import notice
from megatron_lite.data.cleaning import MAX_EXAMPLES, Cleaner, Tally
from megatron_lite.data.eval_overlap import EvalFingerprint, EvaluationCheck, evaluation_brief, evaluation_line
from megatron_lite.data.indexed import HEADER_SIZE, IndexedDatasetWriter, dtype_for_vocab, neox_prefix
from megatron_lite.data.manifest import (Manifest, ShardRecord, SourceRecord, TokenizerRecord, load_manifest,
                                         manifest_path, save_manifest)
from megatron_lite.data.megatron_source import ingest_source
from megatron_lite.data.mix import load_mix
from megatron_lite.data.records import BadRecord
from megatron_lite.data.sources import input_fingerprint, read_source, source_settings
from megatron_lite.data.tokenizer import AnyTokenizer, ensure_tokenizer, load_tokenizer
from megatron_lite.data.verify import write_stamp
from megatron_lite.files import file_sha256, json_sha256

PIPELINE_VERSION = 1  # bump when cleaning or sharding changes what a source config produces
DEFAULT_DOCUMENTS_PER_SHARD = 100_000
CHUNK_DOCUMENTS, CHUNK_CHARS = 256, 1 << 20  # one worker task: up to 256 documents or ~1M characters


class BadRecordError(ValueError):
    """--strict: a source contains a record that cannot become a document."""


# ----------------------------------------------------------------------------------------------
# Encoding workers


_WORKER: dict[str, Any] = {}


def _init_worker(model_path: str, dtype: str) -> None:
    _WORKER["tokenizer"], _WORKER["dtype"] = load_tokenizer(model_path), np.dtype(dtype)


def _encode_chunk(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(tokens of all documents, EOD appended to each, in the shard dtype; (documents,) lengths).
    A Hugging Face tokenizer's post-processor specials (BOS) come with each document (encode_documents)."""
    tokenizer: AnyTokenizer = _WORKER["tokenizer"]
    ids = tokenizer.encode_documents(texts)
    lengths = np.fromiter((len(doc) + 1 for doc in ids), dtype=np.int64, count=len(ids))
    tokens = np.empty(int(lengths.sum()), dtype=_WORKER["dtype"])
    ends = np.cumsum(lengths)
    for doc, end in zip(ids, ends):
        tokens[end - len(doc) - 1 : end - 1] = doc
        tokens[end - 1] = tokenizer.eod_id
    return tokens, lengths


class _Encoder:
    """Ordered, bounded parallel map of _encode_chunk; the pool starts only when there is work.

    ``Pool.imap`` would read the whole source ahead into its task queue; a window of
    ``4 * workers`` chunks in flight keeps memory flat on sources of any size.
    """

    def __init__(self, tokenizer: AnyTokenizer, dtype: np.dtype, workers: int) -> None:
        self._args = (str(tokenizer.path), dtype.str)
        self.workers = workers
        self._pool: Any = None

    def map(self, chunks: Iterator[tuple[int, list[str]]]) -> Iterator[tuple[int, tuple[np.ndarray, np.ndarray]]]:
        if self.workers <= 1:
            _init_worker(*self._args)
            for shard, texts in chunks:
                yield shard, _encode_chunk(texts)
            return
        if self._pool is None:  # spawn: safe even when the caller already runs threads (torch)
            self._pool = multiprocessing.get_context("spawn").Pool(self.workers, _init_worker, self._args)
        pending: deque[tuple[int, Any]] = deque()
        for shard, texts in chunks:
            pending.append((shard, self._pool.apply_async(_encode_chunk, (texts,))))
            if len(pending) >= 4 * self.workers:
                shard_done, result = pending.popleft()
                yield shard_done, result.get()
        while pending:
            shard_done, result = pending.popleft()
            yield shard_done, result.get()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None


# ----------------------------------------------------------------------------------------------
# One source


def source_config_hash(source: SourceConfig, name: str, evaluation_key: str = "") -> str:
    """What determines a source's shards: its settings (not its blend weight), its local inputs and the
    evaluation texts its documents were checked against."""
    settings = {k: v for k, v in source_settings(source).items() if k != "weight"}
    payload = {"version": PIPELINE_VERSION, "source": settings, "inputs": input_fingerprint(source, name)}
    if evaluation_key:
        payload["evaluation"] = evaluation_key
    return json_sha256(payload)


def shard_prefix(name: str, index: int) -> str:
    """Relative to the cache dir: shards/<source>/<source>_<k:05d>_text_document."""
    return neox_prefix(f"shards/{name}/{name}_{index:05d}", "text")


def _shard_damage(cache_dir: Path, shard: ShardRecord, itemsize: int) -> tuple[Path, str] | None:
    """Cheap check (sizes, no hashing): one sequence per document, so both sizes are known. The first file of a
    recorded (finished) shard that is missing or of another size, and why; None when both are as recorded."""
    idx_size = HEADER_SIZE + 12 * shard.documents + 8 * (shard.documents + 1)
    for suffix, expected in ((".idx", idx_size), (".bin", shard.tokens * itemsize)):
        path = cache_dir / (shard.prefix + suffix)
        if not path.is_file():
            return path, "missing"
        size = path.stat().st_size
        if size != expected:
            return path, f"{size:,} bytes, {expected:,} from the manifest's counts"
    return None


def _shard_intact(cache_dir: Path, shard: ShardRecord, itemsize: int) -> bool:
    return _shard_damage(cache_dir, shard, itemsize) is None


def _name_damage(name: str, previous: SourceRecord | None, config_hash: str, cache_dir: Path, itemsize: int) -> None:
    """One notice naming the first damaged file among the finished shards of ``previous`` (truncated, cut
    short, deleted), when the source is to be rebuilt for it rather than for a change of its settings or inputs."""
    if previous is None or previous.config_hash != config_hash:
        return
    damaged = [found for shard in previous.shards if (found := _shard_damage(cache_dir, shard, itemsize))]
    if damaged:
        (path, why), more = damaged[0], len(damaged) - 1
        state = "is missing" if why == "missing" else f"is damaged ({why})"
        notice(f"data cache: {path} {state}{f'; {more} more shard(s) too' if more else ''}; rebuilding source {name} "
               "from there", stacklevel=3)


def _is_cached(previous: SourceRecord | None, config_hash: str, source: SourceConfig, cache_dir: Path,
               itemsize: int) -> bool:
    """A complete entry for the same config hash whose shards are still there."""
    if previous is None or not previous.complete or previous.config_hash != config_hash:
        return False
    if source.type == "megatron":  # read in place: the config hash covers its files' sizes and mtimes
        return True
    return all(_shard_intact(cache_dir, shard, itemsize) for shard in previous.shards)


def _reusable_shards(previous: SourceRecord | None, config_hash: str, cache_dir: Path, itemsize: int,
                     documents_per_shard: int) -> list[ShardRecord]:
    """Finished shards of an interrupted build of the same source that can be kept as they are."""
    if previous is None or previous.config_hash != config_hash:
        return []
    keep = []
    for shard in previous.shards:
        if shard.documents != documents_per_shard or not _shard_intact(cache_dir, shard, itemsize):
            break
        keep.append(shard)
    return keep


def build_source(name: str, group: str, source: SourceConfig, *, cache_dir: Path, encoder: _Encoder,
                 dtype: np.dtype, config_hash: str, documents_per_shard: int, previous: SourceRecord | None,
                 strict: bool, progress: bool, checkpoint: Callable[[SourceRecord], None],
                 evaluation: EvalFingerprint | None = None) -> SourceRecord:
    """Read, clean, tokenise and shard one source; ``checkpoint(record)`` runs after each shard. A document
    overlapping an ``evaluation`` text is dropped and counted."""
    keep = _reusable_shards(previous, config_hash, cache_dir, dtype.itemsize, documents_per_shard)
    kept = {shard.prefix for shard in keep}
    shard_dir = cache_dir / "shards" / name
    shard_dir.mkdir(parents=True, exist_ok=True)
    for path in shard_dir.iterdir():  # stale shards and temp files of an earlier build
        if not any(path.name == Path(prefix).name + suffix for prefix in kept for suffix in (".bin", ".idx")):
            path.unlink()
    record = SourceRecord(group=group, config_hash=config_hash, shards=list(keep))
    checkpoint(record)  # on disk: incomplete from now on (its old shards may be gone)
    skipped, cleaner = Tally(), Cleaner(source, evaluation.match if evaluation is not None else None)
    skip_documents = len(keep) * documents_per_shard  # already in the kept shards: count, do not encode
    bar = tqdm(desc=name, unit="doc", total=source.max_documents, disable=not progress, dynamic_ncols=True)

    def chunks() -> Iterator[tuple[int, list[str]]]:
        """(shard index, cleaned texts) chunks in document order; a chunk never spans two shards."""
        texts: list[str] = []
        size, current, index = 0, len(keep), -1
        for item in read_source(source, name):
            if isinstance(item, BadRecord):
                if strict:
                    raise BadRecordError(f"source {name}: bad record at {item.describe()}; fix the data or run "
                                         "without --strict to skip and count bad records")
                skipped.add(item.problem, f"{item.location} ({item.detail})")
                continue
            text = cleaner(item.text, item.location)
            if text is None:
                continue
            index += 1
            if index < skip_documents:
                bar.update(1)
                continue
            shard = index // documents_per_shard
            if texts and (shard != current or len(texts) >= CHUNK_DOCUMENTS or size >= CHUNK_CHARS):
                yield current, texts
                texts, size = [], 0
            current = shard
            texts.append(text)
            size += len(text)
        if texts:
            yield current, texts

    writer: IndexedDatasetWriter | None = None
    documents = tokens = 0  # of the shard being written
    written_tokens, start = 0, time.perf_counter()

    def finish_shard() -> None:
        assert writer is not None
        writer.close()
        prefix = shard_prefix(name, len(record.shards))
        record.shards.append(ShardRecord(prefix=prefix, documents=documents, tokens=tokens,
                                         bin_sha256=file_sha256(writer.prefix + ".bin"),
                                         idx_sha256=file_sha256(writer.prefix + ".idx")))
        record.documents = sum(shard.documents for shard in record.shards)
        record.tokens = sum(shard.tokens for shard in record.shards)
        checkpoint(record)

    try:
        for shard, (chunk_tokens, lengths) in encoder.map(chunks()):
            if writer is None or shard != len(record.shards):
                if writer is not None:
                    finish_shard()
                writer, documents, tokens = IndexedDatasetWriter(cache_dir / shard_prefix(name, shard), dtype), 0, 0
            offset = 0
            for length in lengths.tolist():
                writer.add_document(chunk_tokens[offset : offset + length])
                offset += length
            documents += len(lengths)
            tokens += offset
            written_tokens += offset
            bar.update(len(lengths))
            bar.set_postfix_str(f"{written_tokens / max(time.perf_counter() - start, 1e-9):,.0f} tok/s", refresh=False)
        if writer is not None:
            finish_shard()
            writer = None
    finally:
        if writer is not None:
            writer.abort()
        bar.close()
    record.skipped, record.skipped_examples = _merge(skipped, cleaner.dropped)
    record.warnings, record.warning_examples = cleaner.warnings.as_dicts()
    record.documents = sum(shard.documents for shard in record.shards)
    record.tokens = sum(shard.tokens for shard in record.shards)
    if record.documents == 0:
        raise ValueError(f"source {name}: no documents left after skipping {sum(record.skipped.values())} "
                         f"records ({record.skipped}); check its path and text_field")
    record.complete = True
    return record


def _merge(*tallies: Tally) -> tuple[dict[str, int], dict[str, list[str]]]:
    merged = Tally()
    for tally in tallies:
        merged.counts.update(tally.counts)
        for problem, examples in tally.examples.items():
            merged.examples.setdefault(problem, []).extend(examples)
    return merged.as_dicts()


# ----------------------------------------------------------------------------------------------
# Everything


def format_report(manifest: Manifest, cache_dir: str | os.PathLike[str], status: dict[str, str] | None = None) -> str:
    """Per-source table, then every skip/warning reason with its count and first locations."""
    status = status or {}
    tok = manifest.tokenizer
    lines = [f"data cache {cache_dir}: tokenizer {tok.path} (vocab {tok.vocab_size}, eod {tok.eod_id}, "
             f"sha256 {tok.sha256[:12]})",
             f"{'source':<20} {'group':<8} {'status':<8} {'documents':>11} {'tokens':>14} {'shards':>6} {'skipped':>9}"]
    for name, record in manifest.sources.items():
        lines.append(f"{name:<20} {record.group:<8} {status.get(name, 'cached'):<8} {record.documents:>11,} "
                     f"{record.tokens:>14,} {len(record.shards):>6} {sum(record.skipped.values()):>9,}")
    external = {name: record.shards for name, record in manifest.sources.items()
                if any(Path(shard.prefix).is_absolute() for shard in record.shards)}
    if external:
        lines.append("read in place (type megatron, not copied into the cache):")
        lines.extend(f"  {name}: {len(shards)} shard(s), {shards[0].prefix}{' ...' if len(shards) > 1 else ''}"
                     for name, shards in external.items())
    lines.append(evaluation_line(manifest))
    sections = (("skipped (not in the shards)", lambda r: (r.skipped, r.skipped_examples)),
                ("warnings (kept in the shards)", lambda r: (r.warnings, r.warning_examples)))
    for title, select in sections:
        entries = [(name, problem, count, select(record)[1].get(problem, []))
                   for name, record in manifest.sources.items() for problem, count in select(record)[0].items()]
        if entries:
            lines.append(f"{title}, first {MAX_EXAMPLES} locations each:")
            for name, problem, count, examples in entries:
                lines.append(f"  {name}: {problem} x{count:,}")
                lines.extend(f"      {example}" for example in examples)
    return "\n".join(lines)


def format_reuse_line(manifest: Manifest, cache_dir: str | os.PathLike[str]) -> str:
    """One line for a cache reused as it was (nothing built): what format_report would tabulate, summed."""
    records = manifest.sources.values()
    skipped = sum(sum(record.skipped.values()) for record in records)
    return (f"data cache {cache_dir}: reused, {len(manifest.sources)} source(s) "
            f"({', '.join(manifest.sources)}), {sum(r.documents for r in records):,} documents, "
            f"{sum(r.tokens for r in records):,} tokens, {skipped:,} records skipped; {evaluation_brief(manifest)}; "
            f"tokenizer {manifest.tokenizer.path} (--verbose: the full summary)")


def _previous_manifest(cache_dir: Path) -> Manifest | None:
    if not manifest_path(cache_dir).is_file():
        return None
    try:
        return load_manifest(cache_dir)
    except (ValueError, KeyError, TypeError) as error:  # an older or damaged manifest: rebuild
        notice(f"{manifest_path(cache_dir)} is unreadable ({error}); rebuilding every source", stacklevel=3)
        return None


def prepare_data(data: DataConfig, vocab_size: int, workers: int | None = None, strict: bool = False,
                 progress: bool = True, *, documents_per_shard: int = DEFAULT_DOCUMENTS_PER_SHARD, force: bool = False,
                 mix: MixConfig | None = None, brief_when_cached: bool = False, keep_reading: bool = False) -> Manifest:
    """Tokenizer + shards + manifest for the data section; cheap when everything is cached.

    ``vocab_size`` is model.vocab_size; ``mix`` is data.mix parsed (parsed here when not given).
    ``workers`` defaults to ``data.num_workers``; ``strict`` aborts at the first bad record
    (BadRecordError naming it); ``force`` rebuilds every source. Prints the report when ``progress``;
    with ``brief_when_cached`` (train.py without --verbose) one line instead when every source was cached.
    Under the cache's build lock (data/cache_lock.py): another process building it is waited for, and a change
    while another run reads the cache is refused (CacheInUse); ``keep_reading`` (a training run) counts this
    process as a reader of the cache until it exits.
    """
    with building(data.cache_dir) as build:
        manifest = _prepare_locked(data, vocab_size, workers, strict, progress, documents_per_shard, force, mix,
                                   brief_when_cached, build)
        if keep_reading:
            build.keep_reading()
    return manifest


def _prepare_locked(data: DataConfig, vocab_size: int, workers: int | None, strict: bool, progress: bool,
                    documents_per_shard: int, force: bool, mix: MixConfig | None, brief_when_cached: bool,
                    build: CacheBuild) -> Manifest:
    if documents_per_shard < 1:
        raise ValueError(f"documents_per_shard={documents_per_shard}: must be >= 1")
    workers = data.num_workers if workers is None else workers
    if workers < 1:
        raise ValueError(f"workers={workers}: must be >= 1")
    cache_dir = Path(data.cache_dir)
    mix = mix if mix is not None else load_mix(data.mix)
    tokenizer = ensure_tokenizer(data, vocab_size, mix, progress=progress, before_change=build.before_change)
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    old = _previous_manifest(cache_dir)
    evaluation = EvaluationCheck(data.eval_texts)
    same_tokenizer = old is not None and old.tokenizer.sha256 == tokenizer.sha256 and not force
    manifest = Manifest(
        tokenizer=TokenizerRecord(path=tokenizer.path.relative_to(cache_dir).as_posix(), sha256=tokenizer.sha256,
                                  vocab_size=tokenizer.vocab_size,
                                  eod_id=tokenizer.eod_id, pad_id=tokenizer.pad_id),
        # Until rebuilt, sources keep their old entries, so an interruption loses nothing finished.
        sources=copy.deepcopy(old.sources) if same_tokenizer and old is not None else {},
        evaluation=old.evaluation if same_tokenizer and old is not None else None,
    )
    status: dict[str, str] = {}
    saved_midway = False  # a build's checkpoints wrote incomplete entries: the final manifest must be written
    encoder = _Encoder(tokenizer, dtype, workers)
    try:
        for group_name, group in mix.groups.items():
            for name, source in group.sources.items():
                config_hash = source_config_hash(source, name, "" if source.type == "megatron" else evaluation.key)
                previous = manifest.sources.get(name)
                if _is_cached(previous, config_hash, source, cache_dir, dtype.itemsize):
                    assert previous is not None
                    previous.group = group_name  # moving a source between groups needs no re-tokenising
                    status[name] = "cached"
                    continue
                build.before_change(f"{'rebuild' if previous is not None else 'build'} its source {name}")
                if source.type == "megatron":  # existing shards: recorded in place, nothing written
                    manifest.sources[name] = ingest_source(name, group_name, source, config_hash=config_hash,
                                                           vocab_size=tokenizer.vocab_size, progress=progress)
                    status[name] = "linked"
                    continue

                _name_damage(name, previous, config_hash, cache_dir, dtype.itemsize)

                def checkpoint(record: SourceRecord, name: str = name) -> None:
                    nonlocal saved_midway
                    manifest.sources[name] = record
                    save_manifest(manifest, cache_dir)
                    saved_midway = True

                resumed = bool(_reusable_shards(previous, config_hash, cache_dir, dtype.itemsize, documents_per_shard))
                manifest.sources[name] = build_source(
                    name, group_name, source, cache_dir=cache_dir, encoder=encoder, dtype=dtype,
                    config_hash=config_hash, documents_per_shard=documents_per_shard, previous=previous,
                    strict=strict, progress=progress, checkpoint=checkpoint, evaluation=evaluation.fingerprint())
                status[name] = "resumed" if resumed else "built"
    finally:
        encoder.close()
    names = [name for group in mix.groups.values() for name in group.sources]
    manifest.sources = {name: manifest.sources[name] for name in names}  # mix order; drops removed sources
    manifest.evaluation = evaluation.record(manifest.evaluation)
    # a rebuild can end equal to the manifest it started from while the file holds a checkpoint's incomplete one
    if old is None or saved_midway or dataclasses.asdict(old) != dataclasses.asdict(manifest):
        build.before_change("rewrite its manifest (sources or groups changed)")
        save_manifest(manifest, cache_dir)
    written = [shard for name, record in manifest.sources.items() if status.get(name) in ("built", "linked")
               for shard in record.shards]
    if written:  # hashed (and range-checked) just now: no need to read them again before training
        write_stamp(cache_dir, manifest, written)
    if progress:
        reused = brief_when_cached and all(state == "cached" for state in status.values())
        print(format_reuse_line(manifest, cache_dir) if reused else format_report(manifest, cache_dir, status))
    return manifest
