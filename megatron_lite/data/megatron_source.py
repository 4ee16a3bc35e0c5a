"""Mix sources of ``type: megatron``: existing Megatron-LM / GPT-NeoX MMIDIDX shards, trained on in place.

Nothing is copied or re-tokenised. Each shard is opened (its index validated), its ``.bin`` read once
for the sha256 and the token-id range, and it is recorded in the manifest under its absolute prefix;
preprocessing stamps it as verified, so training does not read it again. Token ids mean something
only with the tokenizer that made them, so the source declares that tokenizer (``tokenizer``: a
SentencePiece model, a tokenizer.json or a directory holding one) and it must be the run's
``data.tokenizer.model``, byte for byte (a tokenizer.json together with its tokenizer_config.json). A merged set without document boundaries
(doc_idx = [0], GPT-NeoX ``merge_datasets.py``) is read as one document per sequence, with a notice.
"""

from __future__ import annotations

import os

from tqdm import tqdm

from megatron_lite.config import DataConfig, MixConfig, SourceConfig
from megatron_lite.console import notice
from megatron_lite.data.hf_tokenizer import tokenizer_sha256
from megatron_lite.data.indexed import IndexedDataset, data_file_path
from megatron_lite.data.manifest import ShardRecord, SourceRecord
from megatron_lite.data.mix import megatron_sources
from megatron_lite.data.sources import megatron_prefixes
from megatron_lite.data.verify import PROGRESS_BYTES, id_range_problem, scan_bin
from megatron_lite.files import file_sha256


def _identity(path: str, origin: str) -> str:
    if not os.path.exists(path):
        raise ValueError(f"{origin}={path!r}: file does not exist")
    try:
        return tokenizer_sha256(path)
    except ValueError as error:
        raise ValueError(f"{origin}={path!r}: {error}") from None


def check_tokenizer(data: DataConfig, mix: MixConfig) -> None:
    """Every megatron source's declared tokenizer is the same file content as ``data.tokenizer.model``
    (which must be set: no tokenizer can be trained from token ids). One-line ValueError otherwise."""
    names = megatron_sources(mix)
    if not names:
        return
    model = data.tokenizer.model
    if not model:
        raise ValueError(f"data.tokenizer.model is required by the type megatron source(s) {', '.join(names)}: set "
                         "it to the tokenizer the shards were made with (none can be trained from token ids)")
    run_sha = _identity(model, "data.tokenizer.model")
    hashes: dict[str, str] = {}  # declared path -> sha256, each file hashed once
    for group in mix.groups.values():
        for name, source in group.sources.items():
            if source.type != "megatron":
                continue
            declared = str(source.tokenizer)
            if declared not in hashes:
                hashes[declared] = _identity(declared, f"source {name}: tokenizer")
            if hashes[declared] != run_sha:
                raise ValueError(f"source {name}: tokenizer {declared} differs from data.tokenizer.model {model} "
                                 f"(sha256 {hashes[declared][:12]} vs {run_sha[:12]}); the shards' token ids need "
                                 "the tokenizer that made them as the run's tokenizer")


def _open_shard(prefix: str) -> IndexedDataset:
    """The shard, index validated; a merged doc_idx=[0] set is read as one document per sequence."""
    shard = IndexedDataset(prefix, unindexed_as_sequences=True)
    if shard.unindexed:
        notice(f"{shard.idx_path}: doc_idx=[0] (a merged set without document boundaries, e.g. GPT-NeoX "
               f"merge_datasets.py): reading each of its {len(shard):,} sequences as one document", stacklevel=3)
    return shard


def _ingest_shard(prefix: str, vocab_size: int, tokenizer: str, bar: tqdm | None) -> ShardRecord:
    """One pass over the .bin (sha256 + id range); ValueError naming the file for an id outside the vocabulary."""
    shard = _open_shard(prefix)
    scan = scan_bin(shard.bin_path, shard.dtype, bar)
    problem = id_range_problem(scan, vocab_size)
    if problem:
        raise ValueError(f"{shard.bin_path}: {problem} (declared tokenizer {tokenizer}): the shards were made "
                         "with another tokenizer")
    return ShardRecord(prefix=shard.prefix, documents=shard.num_documents, tokens=shard.num_tokens,
                       bin_sha256=scan.sha256, idx_sha256=file_sha256(shard.idx_path))


def ingest_source(name: str, group: str, source: SourceConfig, *, config_hash: str, vocab_size: int,
                  progress: bool) -> SourceRecord:
    """The manifest entry of one megatron source: its shards under their absolute prefixes (not copied).

    ``vocab_size`` is the run tokenizer's (== the declared one's, see check_tokenizer); a progress bar
    over the bytes read appears for large sets when ``progress``.
    """
    prefixes = megatron_prefixes(str(source.path), name)
    total = sum(os.path.getsize(data_file_path(prefix)) for prefix in prefixes)
    show = progress and total >= PROGRESS_BYTES
    shards = []
    with tqdm(total=total, desc=f"{name} (megatron shards)", unit="B", unit_scale=True, disable=not show,
              dynamic_ncols=True) as bar:
        for prefix in prefixes:
            try:
                shards.append(_ingest_shard(prefix, vocab_size, str(source.tokenizer), bar if show else None))
            except ValueError as error:  # IndexedDatasetError and range errors already name the file
                raise ValueError(f"source {name}: {error}") from None
    record = SourceRecord(group=group, config_hash=config_hash, shards=shards, complete=True,
                          documents=sum(shard.documents for shard in shards),
                          tokens=sum(shard.tokens for shard in shards))
    if record.tokens == 0:
        raise ValueError(f"source {name}: its {len(shards)} shard(s) at path={source.path!r} hold no tokens")
    return record
