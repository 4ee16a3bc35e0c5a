"""megatron_lite.files: atomic writes leave the old file or the new one and no temporary, hashes are
canonical; and every file we write (atomic writes, tokenizer, shards, consolidated and HF
checkpoints) gets the umask's permissions, not mkstemp's or safetensors' 0600."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import tiny_config
from megatron_lite.data.indexed import IndexedDatasetWriter
from megatron_lite.files import (apply_umask, atomic_output, copy_file_atomic, current_umask, file_mode, file_sha256,
                                 json_sha256, temporary_sibling, write_bytes_atomic, write_json_atomic,
                                 write_text_atomic)
from megatron_lite.model import build_model
from megatron_lite.weights import save_consolidated
from test_eval_support import make_tokenizer


@pytest.fixture
def umask_022() -> Iterator[None]:
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_atomic_writes_replace_the_target_and_leave_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "out.txt"
    target.write_text("old")
    write_text_atomic(target, "new text\n")
    assert target.read_text() == "new text\n"
    write_bytes_atomic(target, b"\x00\x01")
    assert target.read_bytes() == b"\x00\x01"
    write_json_atomic(target, {"b": 1, "a": [1, 2]}, indent=2, sort_keys=True)
    assert target.read_text() == json.dumps({"a": [1, 2], "b": 1}, indent=2, sort_keys=True)
    source = tmp_path / "source.bin"
    source.write_bytes(b"copied")
    copy_file_atomic(source, target)
    assert target.read_bytes() == b"copied"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt", "source.bin"]


def test_a_failed_atomic_write_keeps_the_old_file(tmp_path: Path) -> None:
    target = tmp_path / "out.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError, match="interrupted"):
        with atomic_output(target) as handle:
            handle.write(b"half")
            raise RuntimeError("interrupted")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]
    with pytest.raises(FileNotFoundError):
        copy_file_atomic(tmp_path / "missing", target)
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_temporary_sibling_is_hidden_unique_and_beside_the_target(tmp_path: Path) -> None:
    first, second = temporary_sibling(tmp_path / "shard.bin"), temporary_sibling(tmp_path / "shard.bin")
    assert first != second and first.parent == second.parent == tmp_path
    assert first.name.startswith(".shard.bin.tmp-")


def test_hashes(tmp_path: Path) -> None:
    path = tmp_path / "data"
    path.write_bytes(b"abc" * 1000)
    assert file_sha256(path) == hashlib.sha256(b"abc" * 1000).hexdigest()
    value = {"b": [1, 2], "a": {"y": 1, "x": Path("p")}}
    reordered = {"a": {"x": Path("p"), "y": 1}, "b": [1, 2]}
    assert json_sha256(value, default=str) == json_sha256(reordered, default=str)
    assert json_sha256({"b": 1, "a": 2}) == hashlib.sha256(b'{"a": 2, "b": 1}').hexdigest()
    assert json_sha256({"b": 1, "a": 2}, separators=(",", ":")) == hashlib.sha256(b'{"a":2,"b":1}').hexdigest()


def test_umask_is_read_without_changing_it() -> None:
    previous = os.umask(0o027)
    try:
        assert current_umask() == 0o027 and file_mode() == 0o640
        assert os.umask(0o027) == 0o027  # unchanged by the read
    finally:
        os.umask(previous)


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_written_files_follow_the_umask(tmp_path: Path, umask: int) -> None:
    previous = os.umask(umask)
    try:
        expected = 0o666 & ~umask
        write_text_atomic(tmp_path / "text", "x")
        write_bytes_atomic(tmp_path / "bytes", b"x")
        write_json_atomic(tmp_path / "json", {})
        copy_file_atomic(tmp_path / "text", tmp_path / "copy")
        with IndexedDatasetWriter(tmp_path / "shard", "uint16") as writer:
            writer.add_document([1, 2, 3])
        created_0600 = tmp_path / "private"
        created_0600.touch(mode=0o600)
        apply_umask(created_0600)
        for name in ("text", "bytes", "json", "copy", "shard.bin", "shard.idx", "private"):
            assert mode(tmp_path / name) == expected, name
    finally:
        os.umask(previous)


def test_checkpoint_files_are_0644_under_umask_022(tmp_path: Path, umask_022: None) -> None:
    tokenizer = make_tokenizer(tmp_path / "tokenizer")  # train_tokenizer writes atomically
    assert mode(tokenizer.path) == 0o644
    config = tiny_config("rope")
    out = save_consolidated(build_model(config).state_dict(), config, tmp_path / "consolidated", tokenizer.path)
    for name in ("model.safetensors", "config.yml", "tokenizer.model"):
        assert mode(out / name) == 0o644, name

    pytest.importorskip("transformers")
    from megatron_lite.convert import convert_checkpoint

    convert_checkpoint(out, tmp_path / "hf", "hf")
    written = sorted(p for p in (tmp_path / "hf").iterdir() if p.is_file())
    assert "model.safetensors" in [p.name for p in written]
    assert {p.name: oct(mode(p)) for p in written} == {p.name: oct(0o644) for p in written}
