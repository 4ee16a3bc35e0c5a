"""Training and validation datasets over the cached blend index (megatron_lite.data.blend).

    train, valid = build_train_valid_datasets(config.data, config.model.seq_length, manifest,
                                              num_train_samples=iters * global_batch, num_valid_samples=...,
                                              rank=dp_rank, world_size=dp_size,
                                              consumed_samples=samples_seen_before_resume)
    loader = sample_loader(train, micro_batch, seed=config.seed, rank=dp_rank, purpose="train")

Each item is ``{"input_ids": (S,) int64, "labels": (S,) int64, "source": int, "group": int,
"index": int}``: the sample's S+1 tokens split into inputs and next-token labels (already shifted:
the trainer must not shift again; no loss mask at document boundaries, as in GPT-NeoX), the ids of
its source and group (names in ``dataset.source_names`` / ``dataset.group_names``) for logging
shares, and its global sample index.

Token ids: every sample is checked on the host against the tokenizer's vocabulary size (the
manifest's, not the padded embedding size): one vectorised argmax over its S+1 ids (~2% of loader
throughput, docs/data.md). A shard changed after data/verify.py stamped it (a flipped byte) is a
``SampleTokenError`` naming the shard and the document, not an ``IndexError`` in the embedding.

Ranks: global sample k goes to data-parallel rank k % world_size, in order (validation too, padded so
that every rank's share has the same length: ``ValidationShare``). Resume: with
``consumed_samples=c`` (global, all ranks together) each rank continues at the first k >= c of
its own, so the union of the ranks' streams is exactly the single-rank stream from c.

Loaders (``sample_loader``) draw nothing from torch's global generator, which dropout draws from: each
has its own generator, seeded from (seed, rank, purpose), so an iterator built on resume or at each
evaluation leaves the training step's random stream exactly as it was.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from megatron_lite.config import DataConfig, MixConfig
from megatron_lite.console import notice
from megatron_lite.data import blend
from megatron_lite.data.batch_documents import documents_per_batch
from megatron_lite.data.indexed import IndexedDataset
from megatron_lite.data.manifest import Manifest
from megatron_lite.data.mix import group_weights, load_mix
from megatron_lite.model.loss import IGNORE_INDEX
from megatron_lite.data.verify import ShardVerificationError


class SampleTokenError(ShardVerificationError):
    """A sample holding a token id outside [0, vocabulary size): one line naming the shard and document.

    torch's DataLoader re-raises a worker's exception as ``type(error)(formatted worker traceback)``;
    the constructor keeps only the original message then, so train.py still prints one line."""

    def __init__(self, message: str) -> None:
        last_line = message.rstrip().rsplit("\n", 1)[-1]
        original = f"{type(self).__module__}.{type(self).__qualname__}: "
        if "\n" in message and last_line.startswith(original):
            message = last_line[len(original):]
        super().__init__(message)


@dataclass(frozen=True)
class SourceShards:
    """One mix source as found in the manifest."""

    name: str
    group: str
    weight: float | None  # explicit weight inside the group; None = natural token proportion
    prefixes: tuple[str, ...]  # absolute shard prefixes (no .bin/.idx)
    fingerprint: tuple[tuple[str, int, int, str, str], ...]  # per shard: prefix, documents, tokens, sha256s
    unindexed_as_sequences: bool = False  # type megatron: a doc_idx=[0] merged shard is one document per sequence

    def open_shard(self, prefix: str) -> IndexedDataset:
        return IndexedDataset(prefix, unindexed_as_sequences=self.unindexed_as_sequences)


def resolve_sources(data: DataConfig, manifest: Manifest, mix: MixConfig) -> tuple[list[SourceShards], dict[str, float]]:
    """The mix's sources (in mix order) matched to the manifest, and the normalised group weights."""
    cache_dir = Path(data.cache_dir)
    sources = []
    for group_name, group in mix.groups.items():
        for name, source_config in group.sources.items():
            record = manifest.sources.get(name)
            hint = f"run tools/preprocess_data.py --config CONFIG (data.cache_dir={str(cache_dir)!r})"
            if record is None:
                raise ValueError(f"source {name!r} of data.mix={data.mix!r} is not in the manifest: {hint}")
            if record.group != group_name:
                raise ValueError(f"source {name!r}: group {record.group!r} in the manifest, {group_name!r} in the mix: {hint}")
            if not record.complete or not record.shards:
                raise ValueError(f"source {name!r}: preprocessing is incomplete (no finished shards): {hint}")
            sources.append(SourceShards(
                name=name, group=group_name, weight=source_config.weight,
                prefixes=tuple(str(cache_dir / shard.prefix) for shard in record.shards),
                fingerprint=tuple((s.prefix, s.documents, s.tokens, s.bin_sha256, s.idx_sha256) for s in record.shards),
                unindexed_as_sequences=source_config.type == "megatron",
            ))
    return sources, group_weights(mix)


def document_lengths(source: SourceShards) -> np.ndarray:
    """(documents,) int64 tokens per document over all shards; checked against the manifest."""
    parts = []
    for prefix, (_, documents, tokens, _, _) in zip(source.prefixes, source.fingerprint):
        shard = source.open_shard(prefix)
        if (shard.num_documents, shard.num_tokens) != (documents, tokens):
            raise ValueError(
                f"{shard.idx_path}: {shard.num_documents} documents / {shard.num_tokens} tokens, the manifest "
                f"says {documents} / {tokens}: the shard changed after preprocessing; rerun it"
            )
        cumulative = np.concatenate([[0], np.cumsum(shard.sizes, dtype=np.int64)])  # (N+1,)
        parts.append(cumulative[shard.doc_idx[1:]] - cumulative[shard.doc_idx[:-1]])
    return np.concatenate(parts)


class BlendedDataset(Dataset):
    """Global sample k of one split (all ranks); memory-maps the index and the shards.
    ``vocab_size``: the tokenizer's (manifest), every sample's ids are checked against it."""

    def __init__(self, index: blend.BlendIndex, sources: Sequence[SourceShards], vocab_size: int) -> None:
        self.index = index
        self.sources = list(sources)
        self.vocab_size = vocab_size
        meta = index.meta
        self.seq_length: int = meta["seq_length"]
        self.source_names: list[str] = [s["name"] for s in meta["sources"]]
        self.group_names: list[str] = list(meta["groups"])
        self.source_group = np.array([self.group_names.index(s["group"]) for s in meta["sources"]], dtype=np.int64)
        self.blend_source: np.ndarray = index.arrays["blend_source"]  # (N,) source id of each sample
        self._blend_sample: np.ndarray = index.arrays["blend_sample"]  # (N,) index within the source
        self._shards: list[tuple[list[IndexedDataset], np.ndarray]] | None = None  # opened lazily
        self._signed: list[bool] = []  # per source: a signed shard dtype, so negative ids are possible

    def __len__(self) -> int:
        return int(self.blend_source.shape[0])

    def documents(self, source: str) -> np.ndarray:
        """Document ids of ``source`` in this split (validation documents for the valid split)."""
        return np.asarray(self.index.arrays[f"documents_{self.source_names.index(source)}"])

    def _open_shards(self) -> list[tuple[list[IndexedDataset], np.ndarray]]:
        opened = []
        for source in self.sources:
            shards = [source.open_shard(prefix) for prefix in source.prefixes]
            first_document = np.cumsum([0] + [s.num_documents for s in shards])  # (shards+1,)
            opened.append((shards, first_document))
        return opened

    def _locate(self, source: int, document: int) -> tuple[IndexedDataset, int]:
        """The shard holding ``document`` of ``source`` and the document's index within it."""
        if self._shards is None:
            self._shards = self._open_shards()
            self._signed = [any(shard.dtype.kind == "i" for shard in shards) for shards, _ in self._shards]
        shards, first_document = self._shards[source]
        if len(shards) == 1:
            return shards[0], document
        shard = int(np.searchsorted(first_document, document, side="right")) - 1
        return shards[shard], document - int(first_document[shard])

    def _bad_id_error(self, k: int, source: int, sample: np.ndarray) -> SampleTokenError:
        """The error for sample k, naming the document of its first id outside the vocabulary (found by walking
        the sample's documents again: this runs once, the walk in ``tokens`` stays lean)."""
        at = int(np.flatnonzero((sample < 0) | (sample >= self.vocab_size))[0])  # position in the sample
        bad = int(sample[at])
        doc_order = self.index.arrays[f"doc_order_{source}"]
        position, offset = (int(v) for v in self.index.arrays[f"sample_idx_{source}"][int(self._blend_sample[k])])
        while True:
            shard, local = self._locate(source, int(doc_order[position]))
            length = len(shard.document(local)) - offset  # the document's tokens from where the sample reads it
            if at < length:
                break
            at, position, offset = at - length, position + 1, 0
        return SampleTokenError(
            f"{shard.bin_path}: document {local} holds token id {bad}, outside the vocabulary [0, {self.vocab_size}) "
            f"(sample {k}, source {self.source_names[source]}): the shard changed after it was verified; run "
            "train.py --verify-data, then re-run preprocessing with --force or restore the file")

    def tokens(self, k: int) -> np.ndarray:
        """(seq_length + 1,) int64 tokens of global sample k (packed across documents)."""
        if not 0 <= k < len(self):
            raise IndexError(f"sample {k} out of range for {len(self)} samples")
        source, j = int(self.blend_source[k]), int(self._blend_sample[k])
        doc_order = self.index.arrays[f"doc_order_{source}"]
        position, offset = (int(v) for v in self.index.arrays[f"sample_idx_{source}"][j])
        needed, pieces = self.seq_length + 1, []
        while needed > 0:
            shard, local = self._locate(source, int(doc_order[position]))
            piece = shard.document(local)[offset : offset + needed]
            pieces.append(piece)
            needed -= len(piece)
            position, offset = position + 1, 0
        sample = (pieces[0] if len(pieces) == 1 else np.concatenate(pieces)).astype(np.int64)  # (S+1,)
        # argmax + item: ~0.25 us against ~1.7 us for max() on a sample this small (numpy's reduce overhead)
        if sample.item(sample.argmax()) >= self.vocab_size or (
                self._signed[source] and sample.item(sample.argmin()) < 0):
            raise self._bad_id_error(k, source, sample)
        return sample

    def __getitem__(self, k: int) -> dict[str, Any]:
        tokens = torch.from_numpy(self.tokens(int(k)))  # (S+1,)
        source = int(self.blend_source[k])
        return {"input_ids": tokens[:-1], "labels": tokens[1:], "source": source,
                "group": int(self.source_group[source]), "index": int(k)}

    # DataLoader workers: send the index directory and re-mmap instead of pickling the arrays.
    def __getstate__(self) -> dict[str, Any]:
        return {"directory": str(self.index.directory), "sources": self.sources, "vocab_size": self.vocab_size}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(blend.open_index(state["directory"]), state["sources"], state["vocab_size"])  # type: ignore[misc]


class RankSlice(Dataset):
    """One rank's samples: global k >= start with k % world_size == rank, in increasing order."""

    def __init__(self, dataset: BlendedDataset, rank: int = 0, world_size: int = 1, start: int = 0) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank}, world_size={world_size}: need 0 <= rank < world_size")
        if not 0 <= start <= len(dataset):
            raise ValueError(f"consumed_samples={start}: must be in [0, {len(dataset)}] (the split's samples)")
        self.dataset = dataset
        self.global_indices = range(start + (rank - start) % world_size, len(dataset), world_size)

    def __len__(self) -> int:
        return len(self.global_indices)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.dataset[self.global_indices[i]]

    @property
    def source_names(self) -> list[str]:
        return self.dataset.source_names

    @property
    def group_names(self) -> list[str]:
        return self.dataset.group_names


class ValidationShare(Dataset):
    """One rank's share of a fixed validation set: global k = rank + i * world_size for i < ceil(N / world_size).

    Every rank gets the same number of items, so every rank runs the same number of forward passes (ZeRO-3
    gathers parameters collectively in each); the k >= N that even the shares out repeat sample k - N with
    every label ``IGNORE_INDEX`` and index -1, so they add nothing to the loss. The union of the ranks' real
    items is samples 0..N-1 whatever the world size."""

    def __init__(self, dataset: BlendedDataset, rank: int = 0, world_size: int = 1) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank}, world_size={world_size}: need 0 <= rank < world_size")
        self.dataset = dataset
        self.global_indices = range(rank, world_size * math.ceil(len(dataset) / world_size), world_size)

    def __len__(self) -> int:
        return len(self.global_indices)

    def __getitem__(self, i: int) -> dict[str, Any]:
        k = self.global_indices[i]
        if k < len(self.dataset):
            return self.dataset[k]
        item = self.dataset[k - len(self.dataset)]
        return {**item, "labels": torch.full_like(item["labels"], IGNORE_INDEX), "index": -1}


def loader_generator(seed: int, rank: int, purpose: str) -> torch.Generator:
    """A loader's own generator: each iterator draws its base seed (its workers' seeds) from it, never from
    torch's global generator. Seeded from (seed, rank, purpose), so every run and resume draws the same."""
    digest = hashlib.sha256(f"{seed}/{rank}/{purpose}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def seed_worker(worker_id: int) -> None:
    """numpy's generator in a loader worker, from the seed torch gave the worker (torch seeds its own and
    Python's ``random`` there)."""
    np.random.seed(torch.initial_seed() % 2**32)


def sample_loader(dataset: Dataset, batch_size: int, *, seed: int, rank: int, purpose: str,
                  num_workers: int = 0, drop_last: bool = True, pin_memory: bool = False,
                  batches_ahead: int = 0) -> DataLoader:
    """Batches of ``dataset`` in order (the blend index fixed the order), complete batches only unless
    ``drop_last`` is off; iterating it draws from its own generator (``loader_generator``), never from the
    global one. ``pin_memory`` (for a CUDA device): batches in page-locked memory, so that a ``non_blocking``
    copy to the GPU is asynchronous (from pageable memory it may wait for the GPU's queue to drain first).
    ``batches_ahead``: with workers, at least this many batches prepared ahead (a step's micro batches, which
    the loop takes at once; the DataLoader's default keeps two per worker)."""
    prefetch = {"prefetch_factor": max(2, -(-batches_ahead // num_workers))} if num_workers else {}
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, drop_last=drop_last, num_workers=num_workers,
                      persistent_workers=False, worker_init_fn=seed_worker if num_workers else None,
                      generator=loader_generator(seed, rank, purpose), pin_memory=pin_memory, **prefetch)


def _is_index_builder(rank: int) -> bool:
    """Global rank 0 builds (data-parallel rank 0 may exist once per model-parallel group)."""
    import torch.distributed as dist

    return dist.get_rank() == 0 if dist.is_available() and dist.is_initialized() else rank == 0


def build_blended_dataset(
    data: DataConfig,
    seq_length: int,
    manifest: Manifest,
    split: str,
    num_samples: int,
    *,
    mix: MixConfig | None = None,
    is_builder: bool = True,
    shuffle_block: int = blend.DEFAULT_SHUFFLE_BLOCK,
    wait_timeout_s: float = 3600.0,
) -> BlendedDataset:
    """All ``num_samples`` samples of ``split``; the order is cached under <cache_dir>/index/<hash>/.
    ``mix`` is data.mix parsed (parsed here when not given)."""
    sources, weights = resolve_sources(data, manifest, mix if mix is not None else load_mix(data.mix))
    inputs = {
        "split": split, "num_samples": num_samples, "seq_length": seq_length, "seed": data.seed,
        "validation_fraction": data.validation_fraction, "shuffle_block": shuffle_block, "group_weights": weights,
        "sources": [{"name": s.name, "group": s.group, "weight": s.weight, "shards": [list(f) for f in s.fingerprint]}
                    for s in sources],
    }

    def build() -> blend.BlendArrays:
        blend_sources = [blend.BlendSource(s.name, s.group, document_lengths(s), s.weight) for s in sources]
        return blend.build_blend(
            blend_sources, weights, split=split, num_samples=num_samples, seq_length=seq_length,
            seed=data.seed, validation_fraction=data.validation_fraction, shuffle_block=shuffle_block,
        )

    root = Path(data.cache_dir) / "index"
    index = blend.load_or_build(root, inputs, build, is_builder=is_builder, wait_timeout_s=wait_timeout_s)
    return BlendedDataset(index, sources, manifest.tokenizer.vocab_size)


def build_train_valid_datasets(
    data: DataConfig,
    seq_length: int,
    manifest: Manifest,
    num_train_samples: int,
    num_valid_samples: int,
    rank: int = 0,
    world_size: int = 1,
    consumed_samples: int = 0,
    *,
    mix: MixConfig | None = None,
    wait_timeout_s: float = 3600.0,
) -> tuple[RankSlice, ValidationShare | None]:
    """This rank's training stream (from ``consumed_samples``) and its share of the validation set
    (``ValidationShare``: samples 0..num_valid_samples-1 over all ranks, padded to equal shares).

    Sample counts are global (all ranks). The validation dataset is None when num_valid_samples
    is 0 or data.validation_fraction is 0.
    """
    if num_train_samples <= 0:
        raise ValueError(f"num_train_samples={num_train_samples}: must be positive")
    if num_valid_samples < 0:
        raise ValueError(f"num_valid_samples={num_valid_samples}: must be >= 0")
    is_builder = _is_index_builder(rank)
    mix = mix if mix is not None else load_mix(data.mix)
    common = {"mix": mix, "is_builder": is_builder, "wait_timeout_s": wait_timeout_s}
    train = build_blended_dataset(data, seq_length, manifest, "train", num_train_samples, **common)
    train_slice = RankSlice(train, rank, world_size, consumed_samples)
    if num_valid_samples == 0:
        return train_slice, None
    if data.validation_fraction == 0:
        notice(f"num_valid_samples={num_valid_samples} ignored: data.validation_fraction is 0", stacklevel=2)
        return train_slice, None
    valid = build_blended_dataset(data, seq_length, manifest, "valid", num_valid_samples, **common)
    return train_slice, ValidationShare(valid, rank, world_size)


def data_report(data: DataConfig, seq_length: int, manifest: Manifest, num_samples: int, *,
                mix: MixConfig | None = None, global_batch: int | None = None) -> dict[str, Any]:
    """What tools/inspect_data.py prints: token shares of the first ``num_samples`` training samples
    (all samples have seq_length tokens, so sample shares are token shares), per-source counts,
    the distinct documents per global batch of ``global_batch`` samples (min and mean over the
    complete batches among them), and sample 0."""
    dataset = build_blended_dataset(data, seq_length, manifest, "train", num_samples, mix=mix)
    counts = np.bincount(np.asarray(dataset.blend_source), minlength=len(dataset.source_names))  # (sources,)
    source_share = {name: float(c) / num_samples for name, c in zip(dataset.source_names, counts)}
    group_share = {group: 0.0 for group in dataset.group_names}
    for name, share, group in zip(dataset.source_names, source_share.values(), dataset.source_group):
        group_share[dataset.group_names[group]] += share
    train_meta = {s["name"]: s for s in dataset.index.meta["sources"]}
    sources = {}
    for name in dataset.source_names:
        record = manifest.sources[name]
        meta = train_meta[name]
        sources[name] = {
            "group": record.group, "documents": record.documents, "tokens": record.tokens,
            "train_documents": meta["documents"], "train_tokens": meta["tokens"],
            "validation_documents": record.documents - meta["documents"],
            "weight_in_group": meta["weight_in_group"], "epochs": meta["epochs"], "skipped": record.skipped,
        }
    first = dataset[0]
    batch = min(global_batch or num_samples, num_samples)  # fewer samples than a batch: one short batch
    lengths = [document_lengths(source) for source in dataset.sources]
    per_batch = documents_per_batch(dataset.index.arrays, lengths, dataset.seq_length, batch).sum(axis=1)  # (batches,)
    return {
        "documents_per_batch": {"global_batch": batch, "batches": len(per_batch), "min": int(per_batch.min()),
                                "mean": float(per_batch.mean())},
        "num_samples": num_samples, "seq_length": dataset.seq_length, "index": str(dataset.index.directory),
        "group_token_share": group_share, "source_token_share": source_share,
        "group_weights": dataset.index.meta["group_weights"], "sources": sources,
        "tokenizer": {"path": manifest.tokenizer.path, "vocab_size": manifest.tokenizer.vocab_size,
                      "eod_id": manifest.tokenizer.eod_id},
        "sample": {"index": 0, "source": dataset.source_names[first["source"]],
                   "group": dataset.group_names[first["group"]], "input_ids": first["input_ids"].tolist()},
    }


def decode_tokens(token_ids: Sequence[int], cache_dir: str | os.PathLike[str], manifest: Manifest) -> str | None:
    """Text of ``token_ids`` with the manifest's tokenizer (SentencePiece or tokenizer.json); None when the
    cache has none."""
    path = Path(cache_dir) / manifest.tokenizer.path
    if not path.is_file():
        return None
    from megatron_lite.data.tokenizer import load_tokenizer

    return load_tokenizer(path).decode(token_ids)
