"""Verify a data cache's shards before training on them: each ``.bin``/``.idx`` against the sha256 the
manifest recorded, and every token id below the tokenizer's vocabulary size.

Silent corruption (a flipped byte on disk, a file replaced by hand) would otherwise train on
garbage, or end deep inside the embedding with an ``IndexError``. Checking costs one read of every
shard, so it runs once per shard set: ``<cache>/verified.json`` records the (prefix, bin sha256,
idx sha256) of every shard verified and the vocabulary size they were checked against. A shard is
checked again when its manifest entry changes (re-tokenised, another tokenizer) or is not in the
stamp; ``train.py --verify-data`` checks everything regardless. Preprocessing stamps the shards it
has just written and hashed, so a first run on a fresh cache reads nothing twice.

A bad shard is a ``ShardVerificationError`` (a ``ValueError``): one line naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from megatron_lite.data.indexed import IndexedDataset, data_file_path, index_file_path
from megatron_lite.data.manifest import Manifest, ShardRecord, manifest_path
from megatron_lite.files import file_sha256, write_json_atomic

STAMP_FILE = "verified.json"
STAMP_VERSION = 1
_CHUNK_BYTES = 16 << 20  # per read of a .bin: hash and range-check the same bytes
PROGRESS_BYTES = 256 << 20  # show a progress bar when there is at least this much to read


class ShardVerificationError(ValueError):
    """A shard that differs from its manifest entry or holds an id outside the vocabulary."""


def stamp_path(cache_dir: str | os.PathLike[str]) -> Path:
    return Path(cache_dir) / STAMP_FILE


def _entry(shard: ShardRecord) -> list[str]:
    return [shard.bin_sha256, shard.idx_sha256]


def _all_shards(manifest: Manifest) -> list[ShardRecord]:
    return [shard for record in manifest.sources.values() for shard in record.shards]


def read_stamp(cache_dir: str | os.PathLike[str], vocab_size: int) -> dict[str, list[str]]:
    """prefix -> [bin sha256, idx sha256] of the shards verified against ``vocab_size``; empty when
    there is no stamp, it is unreadable, or it was made for another vocabulary size."""
    try:
        data = json.loads(stamp_path(cache_dir).read_text())
        if data.get("version") != STAMP_VERSION or data.get("vocab_size") != vocab_size:
            return {}
        return {str(prefix): list(entry) for prefix, entry in data["shards"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def write_stamp(cache_dir: str | os.PathLike[str], manifest: Manifest, verified: list[ShardRecord]) -> None:
    """Record ``verified`` (plus what the stamp already holds for shards still in the manifest, unchanged)."""
    vocab = manifest.tokenizer.vocab_size
    current = {shard.prefix: _entry(shard) for shard in _all_shards(manifest)}
    shards = {prefix: entry for prefix, entry in read_stamp(cache_dir, vocab).items() if current.get(prefix) == entry}
    shards.update({shard.prefix: _entry(shard) for shard in verified})
    write_json_atomic(stamp_path(cache_dir), {"version": STAMP_VERSION, "vocab_size": vocab, "shards": shards},
                      indent=1, sort_keys=True)


def unverified_shards(cache_dir: str | os.PathLike[str], manifest: Manifest) -> list[ShardRecord]:
    """The manifest's shards the stamp does not vouch for (with these hashes and this vocabulary size)."""
    stamped = read_stamp(cache_dir, manifest.tokenizer.vocab_size)
    return [shard for shard in _all_shards(manifest) if stamped.get(shard.prefix) != _entry(shard)]


def _changed(path: str) -> str:
    return (f"{path}: sha256 differs from the manifest (corrupted or changed since preprocessing); "
            "re-run preprocessing with --force or restore the file")


@dataclass(frozen=True)
class BinScan:
    """What one pass over a .bin found: its sha256 and the extreme token ids with their positions."""

    sha256: str
    tokens: int
    low: int  # smallest id (0 when there are no tokens)
    low_at: int
    high: int  # largest id (-1 when there are no tokens)
    high_at: int


def scan_bin(bin_path: str | os.PathLike[str], dtype: np.dtype, bar: tqdm | None = None) -> BinScan:
    """Read ``bin_path`` once in chunks: sha256 plus min/max token id (vectorised per chunk)."""
    digest = hashlib.sha256()
    low, high, low_at, high_at = 0, -1, 0, 0
    position = 0  # tokens before the current chunk
    chunk_bytes = _CHUNK_BYTES - _CHUNK_BYTES % dtype.itemsize
    with open(bin_path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
            tokens = np.frombuffer(chunk, dtype=dtype, count=len(chunk) // dtype.itemsize)  # (chunk tokens,)
            if tokens.size:
                at_max, at_min = int(tokens.argmax()), int(tokens.argmin())
                if int(tokens[at_max]) > high:
                    high, high_at = int(tokens[at_max]), position + at_max
                if int(tokens[at_min]) < low:
                    low, low_at = int(tokens[at_min]), position + at_min
            position += tokens.size
            if bar is not None:
                bar.update(len(chunk))
    return BinScan(digest.hexdigest(), position, low, low_at, high, high_at)


def id_range_problem(scan: BinScan, vocab_size: int) -> str | None:
    """What is wrong with the ids a scan found (one outside [0, vocab_size)), or None."""
    if scan.high >= vocab_size:
        return f"token id {scan.high} at position {scan.high_at} >= vocabulary size {vocab_size}"
    if scan.low < 0:
        return f"negative token id {scan.low} at position {scan.low_at}"
    return None


def verify_shard(cache_dir: str | os.PathLike[str], shard: ShardRecord, vocab_size: int,
                 bar: tqdm | None = None) -> None:
    """Check one shard: .idx sha256, then one pass over the .bin computing its sha256 and the range
    of its token ids. Raises ShardVerificationError naming the file."""
    prefix = Path(cache_dir) / shard.prefix
    bin_path, idx_path = data_file_path(prefix), index_file_path(prefix)
    for path in (bin_path, idx_path):
        if not os.path.isfile(path):
            raise ShardVerificationError(f"{path}: missing (listed in {manifest_path(cache_dir)}); "
                                         "re-run preprocessing or restore the file")
    if file_sha256(idx_path) != shard.idx_sha256:
        raise ShardVerificationError(_changed(idx_path))
    try:  # the header's dtype; also validates the index's structure (an index matching the manifest's
        # sha256 was accepted at preprocessing, merged doc_idx=[0] sets of type megatron included)
        dtype = IndexedDataset(prefix, unindexed_as_sequences=True).dtype
    except ValueError as error:
        raise ShardVerificationError(str(error)) from error
    scan = scan_bin(bin_path, dtype, bar)
    if scan.sha256 != shard.bin_sha256:
        raise ShardVerificationError(_changed(bin_path))
    problem = id_range_problem(scan, vocab_size)
    if problem:
        raise ShardVerificationError(f"{bin_path}: {problem} (the shard was made with another tokenizer?); re-run "
                                     "preprocessing with --force")


def verify_shards(cache_dir: str | os.PathLike[str], manifest: Manifest, shards: list[ShardRecord],
                  progress: bool = True) -> int:
    """Verify ``shards`` of ``manifest``; the bytes read. A progress bar (when ``progress``) for large sets."""
    vocab = manifest.tokenizer.vocab_size
    total = sum(os.path.getsize(data_file_path(Path(cache_dir) / s.prefix))
                for s in shards if os.path.isfile(data_file_path(Path(cache_dir) / s.prefix)))
    show = progress and total >= PROGRESS_BYTES
    with tqdm(total=total, desc="verifying shards", unit="B", unit_scale=True, disable=not show,
              dynamic_ncols=True) as bar:
        for shard in shards:
            verify_shard(cache_dir, shard, vocab, bar if show else None)
    return total


def ensure_verified(cache_dir: str | os.PathLike[str], manifest: Manifest, *, force: bool = False,
                    progress: bool = True) -> list[ShardRecord]:
    """Verify the shards not yet stamped (all of them when ``force``) and stamp them; the shards checked."""
    shards = _all_shards(manifest) if force else unverified_shards(cache_dir, manifest)
    if not shards:
        return []
    total = verify_shards(cache_dir, manifest, shards, progress)
    write_stamp(cache_dir, manifest, shards)
    if progress:
        from megatron_lite.console import console

        console(f"data: verified {len(shards)} shard(s) ({total / 2**20:,.1f} MiB) in {cache_dir}: sha256 as in "
                f"the manifest, token ids < {manifest.tokenizer.vocab_size}")
    return shards
