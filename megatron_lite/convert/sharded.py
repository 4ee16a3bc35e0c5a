"""Shard-by-shard conversion: weights are read one file at a time, renamed, cast and written before the
next file is read, so converting a 7B model never holds two copies of it (nor a whole fp32 copy of a
bf16 checkpoint next to the original).

Sources (``open_shards``): a Hugging Face dir (its ``model.safetensors`` / sharded index / legacy
``pytorch_model.bin`` files), a consolidated dir (``model.safetensors`` or ``model-0000i-of-0000N``
shards + ``model.safetensors.index.json``), or a DeepSpeed step/run dir (one state: DeepSpeed's
consolidation returns the whole model at once). Outputs keep the source's split, with HF's file names
and index (``ShardWriter``). Names and shapes are checked against the config over all shards; a
mismatch raises before the staged output is moved into place, so nothing half-converted is left.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_lite import checkpoint_dirs
from megatron_lite import config as config_lib
from megatron_lite.config import Config
from megatron_lite.convert.hf_import import hf_tokenizer_file, hf_weight_files, read_hf_config
from megatron_lite.convert.hf_names import cast, rename_from_hf, rename_to_hf, untie
from megatron_lite.weights import (
    WEIGHTS_INDEX_FILE, check_shapes, expected_shapes, load_state_dict, read_weight_file, save_safetensors, weight_files,
)

TensorShard = dict[str, torch.Tensor]


@dataclass
class ShardedSource:
    """A checkpoint's config and tokenizer, and its weights as a stream of shards under megatron_lite names."""

    config: Config
    tokenizer_path: Path | None
    kind: str  # run | step | consolidated | hf
    step: int | None
    _read: Callable[[], Iterator[TensorShard]]
    label: str

    def shards(self) -> Iterator[TensorShard]:
        """megatron_lite-named shards; after the last, every name and shape has been checked against the config."""
        seen: dict[str, tuple[int, ...]] = {}
        for shard in self._read():
            seen.update({name: tuple(tensor.shape) for name, tensor in shard.items()})
            yield shard
        check_shapes(seen, expected_shapes(self.config.model), self.label)


def open_shards(path: str | Path) -> ShardedSource:
    """Any checkpoint (run, step, consolidated or HF dir) as a ``ShardedSource``."""
    resolved = checkpoint_dirs.resolve_checkpoint(path)
    kind = checkpoint_dirs.checkpoint_kind(resolved)
    step = checkpoint_dirs.checkpoint_step(resolved) if kind == "step" else None
    if kind == "hf":
        config = read_hf_config(resolved)
        files = hf_weight_files(resolved)
        return ShardedSource(config, hf_tokenizer_file(resolved), kind, step,
                             lambda: (rename_from_hf(read_weight_file(file), config.model) for file in files),
                             str(resolved))
    if kind == "consolidated":
        config = config_lib.load(resolved / checkpoint_dirs.CONFIG_FILE)
        files = weight_files(resolved)
        return ShardedSource(config, checkpoint_dirs.find_tokenizer(resolved), kind, step,
                             lambda: (read_weight_file(file) for file in files), str(resolved))
    state, config, tokenizer = load_state_dict(resolved)  # DeepSpeed consolidation: the whole model at once
    return ShardedSource(config, tokenizer, kind, step, lambda: iter([state]), str(resolved))


class ShardWriter:
    """Writes shards as they come: ``model.safetensors`` for one, else ``model-0000i-of-0000N.safetensors`` and
    ``model.safetensors.index.json`` (HF's layout, which transformers and ``weights.weight_files`` read)."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.written: list[tuple[Path, list[str], int]] = []  # (temporary file, names, bytes)

    def write(self, tensors: TensorShard) -> None:
        path = self.out_dir / f".shard-{len(self.written):05d}.safetensors"
        save_safetensors(tensors, path, metadata={"format": "pt"})
        size = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
        self.written.append((path, list(tensors), size))

    def finish(self) -> list[Path]:
        count = len(self.written)
        if count == 1:
            final = self.out_dir / checkpoint_dirs.WEIGHTS_FILE
            self.written[0][0].rename(final)
            return [final]
        weight_map, finals = {}, []
        for index, (path, names, _) in enumerate(self.written):
            final = self.out_dir / f"model-{index + 1:05d}-of-{count:05d}.safetensors"
            path.rename(final)
            finals.append(final)
            weight_map.update({name: final.name for name in names})
        total = sum(size for _, _, size in self.written)
        index_text = json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2)
        (self.out_dir / WEIGHTS_INDEX_FILE).write_text(index_text + "\n")
        return finals


def write_consolidated_shards(source: ShardedSource, out_dir: Path, dtype: torch.dtype) -> None:
    """The weights of ``source`` as consolidated shards (megatron_lite names) in ``dtype``."""
    writer = ShardWriter(out_dir)
    for shard in source.shards():
        writer.write(untie(cast(shard, dtype)))
    writer.finish()


def write_hf_shards(source: ShardedSource, config: Config, out_dir: Path, dtype: torch.dtype) -> None:
    """The weights of ``source`` under Hugging Face names in ``dtype``; a tied head is left out, as save_pretrained does."""
    writer = ShardWriter(out_dir)
    for shard in source.shards():
        writer.write(untie(cast(rename_to_hf(shard, config.model), dtype)))
    writer.finish()
