"""Data verification (data/verify.py): real faults in real shards made by the real preprocessing: a
flipped byte, an out-of-range token id; the stamp that makes it once per shard set; --verify-data; the
loader's own check of every sample (data/loader.py) for a byte flipped after the stamp."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_lite import config as config_lib
from megatron_lite.data.indexed import IndexedDataset
from megatron_lite.data.loader import SampleTokenError, build_blended_dataset, build_train_valid_datasets
from megatron_lite.data.manifest import Manifest, ShardRecord, load_manifest, save_manifest
from megatron_lite.data.verify import (ShardVerificationError, ensure_verified, stamp_path, unverified_shards,
                                       verify_shards)
from megatron_lite.files import file_sha256
from megatron_lite.training.data import prepare_training_data
from megatron_lite.training.deepspeed_config import resolve_batch_sizes
from megatron_lite.training.distributed import DistributedInfo
from training_helpers import run_train, tiny_train_config, write_config


@pytest.fixture
def corpus(training_corpus: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path]:
    """(mix file, a private copy of the test run's tokenised cache) to damage."""
    mix, cache = training_corpus
    shutil.copytree(cache, tmp_path / "cache", ignore=shutil.ignore_patterns("index"))
    return mix, tmp_path / "cache"


def _first_shard(cache: Path) -> tuple[Manifest, ShardRecord, Path]:
    manifest = load_manifest(cache)
    shard = next(iter(manifest.sources.values())).shards[0]
    return manifest, shard, cache / (shard.prefix + ".bin")


def _flip_byte(path: Path, offset: int, bit: int = 0x01) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= bit
    path.write_bytes(bytes(data))


def _write_token(cache: Path, position: int, token: int) -> Path:
    """Put ``token`` into the first shard's .bin and record the new hash in the manifest, as a shard made with
    another tokenizer would be (the sha256 check alone cannot catch it)."""
    manifest, shard, bin_path = _first_shard(cache)
    tokens = np.memmap(bin_path, dtype=IndexedDataset(cache / shard.prefix).dtype, mode="r+")
    tokens[position] = token
    tokens.flush()
    del tokens
    shard.bin_sha256 = file_sha256(bin_path)
    save_manifest(manifest, cache)
    return bin_path


def _one_line(error: pytest.ExceptionInfo[ShardVerificationError]) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_preprocessing_stamps_the_shards_it_wrote(corpus: tuple[Path, Path],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    _, cache = corpus
    manifest = load_manifest(cache)
    stamp = json.loads(stamp_path(cache).read_text())
    assert stamp["vocab_size"] == manifest.tokenizer.vocab_size
    assert len(stamp["shards"]) == sum(len(record.shards) for record in manifest.sources.values())
    assert unverified_shards(cache, manifest) == [] and ensure_verified(cache, manifest) == []  # nothing to read
    checked = ensure_verified(cache, manifest, force=True)
    assert len(checked) == len(stamp["shards"])
    assert f"data: verified {len(checked)} shard(s)" in capsys.readouterr().out


def test_flipped_bytes_name_the_file(corpus: tuple[Path, Path]) -> None:
    _, cache = corpus
    manifest, shard, bin_path = _first_shard(cache)
    _flip_byte(bin_path, bin_path.stat().st_size // 2)
    with pytest.raises(ShardVerificationError) as error:
        verify_shards(cache, manifest, [shard], progress=False)
    assert _one_line(error) == (f"{bin_path}: sha256 differs from the manifest (corrupted or changed since "
                                "preprocessing); re-run preprocessing with --force or restore the file")
    idx_path = cache / (shard.prefix + ".idx")
    _flip_byte(idx_path, idx_path.stat().st_size - 3)
    with pytest.raises(ShardVerificationError) as error:
        verify_shards(cache, manifest, [shard], progress=False)
    assert _one_line(error).startswith(f"{idx_path}: sha256 differs from the manifest")


def test_out_of_range_token_id_is_found_and_a_changed_manifest_voids_the_stamp(corpus: tuple[Path, Path]) -> None:
    _, cache = corpus
    vocab = load_manifest(cache).tokenizer.vocab_size
    bin_path = _write_token(cache, 5, vocab + 7)
    manifest = load_manifest(cache)
    assert [shard.prefix for shard in unverified_shards(cache, manifest)] == [_first_shard(cache)[1].prefix]
    with pytest.raises(ShardVerificationError) as error:
        ensure_verified(cache, manifest, progress=False)  # no force: the stamp no longer vouches for the shard
    assert _one_line(error).startswith(f"{bin_path}: token id {vocab + 7} at position 5 >= vocabulary size {vocab}")


def test_training_data_verifies_once_and_verify_data_forces(corpus: tuple[Path, Path]) -> None:
    mix, cache = corpus
    config = config_lib.from_dict(tiny_train_config(mix, cache))
    batch, rank0 = resolve_batch_sizes(config, 1), DistributedInfo(0, 0, 1, torch.device("cpu"))
    stamp_path(cache).unlink()  # a cache never verified here (copied from elsewhere)
    prepare_training_data(config, batch, rank0, None)  # verifies and stamps
    assert unverified_shards(cache, load_manifest(cache)) == []
    _, _, bin_path = _first_shard(cache)
    _flip_byte(bin_path, 1)
    prepare_training_data(config, batch, rank0, None)  # stamped: not read again
    with pytest.raises(ShardVerificationError) as error:
        prepare_training_data(config, batch, rank0, None, verify_data=True)
    assert _one_line(error).startswith(f"{bin_path}: sha256 differs from the manifest")


@pytest.mark.parametrize("workers", [0, 1], ids=["in_process", "worker_process"])
def test_byte_flipped_after_the_stamp_stops_the_loader_naming_shard_and_document(corpus: tuple[Path, Path],
                                                                                   workers: int) -> None:
    """The stamp vouches for the shard, so nothing re-reads it before training: the loader's per-sample check
    finds the id (one line through a DataLoader worker too), instead of an IndexError in the embedding."""
    mix, cache = corpus
    config = config_lib.from_dict(tiny_train_config(mix, cache))
    config.data.validation_fraction = 0.0  # every document in the training stream
    manifest, shard, bin_path = _first_shard(cache)
    assert unverified_shards(cache, manifest) == []  # stamped at preprocessing
    sizes = IndexedDataset(cache / shard.prefix).sizes.astype(np.int64)  # (documents,) one sequence each
    document = len(sizes) // 2
    position = int(sizes[:document].sum())  # its first token: the first sample to read it starts in another document
    original = int(np.fromfile(bin_path, dtype="<u2")[position])  # vocab 384: uint16 shards
    _flip_byte(bin_path, 2 * position + 1, bit=0x40)  # one bit of the high byte: id + 2**14
    assert unverified_shards(cache, load_manifest(cache)) == []  # the stamp still vouches for it

    total_tokens = sum(record.tokens for record in manifest.sources.values())
    train, _ = build_train_valid_datasets(config.data, config.model.seq_length, manifest,
                                          2 * total_tokens // config.model.seq_length, 0)  # > 1 epoch of each source
    loader = torch.utils.data.DataLoader(train, batch_size=16, num_workers=workers)
    with pytest.raises(SampleTokenError) as error:
        for _ in loader:
            pass
    vocab = manifest.tokenizer.vocab_size
    assert _one_line(error).startswith(f"{bin_path}: document {document} holds token id {original + 2**14}, "
                                       f"outside the vocabulary [0, {vocab}) (sample ")


def _first_training_sample(cache: Path, config: config_lib.Config) -> tuple[Path, int, int]:
    """(shard .bin, token position, document in the shard) where training's first sample starts, read from the
    sample index itself (the order is prefix-stable: sample 0 is the same for any run length)."""
    manifest = load_manifest(cache)
    dataset = build_blended_dataset(config.data, config.model.seq_length, manifest, "train", 1)
    source, drawn = int(dataset.blend_source[0]), int(dataset.index.arrays["blend_sample"][0])
    position, offset = (int(v) for v in dataset.index.arrays[f"sample_idx_{source}"][drawn])
    shard, document = dataset._locate(source, int(dataset.index.arrays[f"doc_order_{source}"][position]))
    start = int(shard.sizes[:document].astype(np.int64).sum()) + offset  # tokens before the sample in the .bin
    return Path(shard.bin_path), start, document


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["flipped_byte", "token_id", "flipped_after_stamp"])
def test_train_py_reports_a_bad_shard_in_one_line(fault: str, corpus: tuple[Path, Path], tmp_path: Path) -> None:
    mix, cache = corpus
    vocab = load_manifest(cache).tokenizer.vocab_size
    if fault == "flipped_byte":
        bin_path, extra, problem = _first_shard(cache)[2], ["--verify-data"], "sha256 differs from the manifest"
        _flip_byte(bin_path, 9)
    elif fault == "flipped_after_stamp":  # nothing re-reads a stamped shard: the loader finds it at step 1
        run_config = config_lib.from_dict(tiny_train_config(mix, cache))
        bin_path, position, document = _first_training_sample(cache, run_config)
        _flip_byte(bin_path, 2 * position + 1, bit=0x40)
        extra, problem = [], f"document {document} holds token id"
    else:  # a changed manifest entry is verified without --verify-data
        bin_path, extra, problem = _write_token(cache, 2, vocab), [], f"token id {vocab} at position 2"
    config = write_config(tmp_path / "run.yml", tiny_train_config(mix, cache))
    result = run_train(config, tmp_path / "run", *extra, check=False)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    if fault == "flipped_after_stamp":  # found in step 1: the progress bar's line (redrawn after \r) ends first
        bar = [line for line in lines if line.startswith("train:")]
        assert bar and lines[:len(bar)] == bar and "error:" not in "".join(bar), result.stderr
        lines = lines[len(bar):]
    assert len(lines) == 1 and lines[0].startswith(f"error: {bin_path}: {problem}"), result.stderr
    assert "Traceback" not in result.stdout + result.stderr
