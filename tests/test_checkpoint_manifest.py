"""The manifest covers every file under a step dir, recursively (megatron_lite/checkpoint_integrity.py), on
small step dirs made here: nested conversion folders with their own manifest, planted and unlisted files,
staging folders, version 1 manifests, and the split of the checks over ranks. Real trained checkpoints:
tests/test_checkpoint_safety.py and tests/test_universal_resume.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_lite import checkpoint_dirs
from megatron_lite.checkpoint_integrity import (MANIFEST_FILE, UnsafeCheckpointError, read_manifest, record_file,
                                                record_tree, save_hashed, verify_checkpoint, write_manifest)
from megatron_lite.convert.universal import convert_step_to_universal
from megatron_lite.files import file_sha256
from test_checkpoint_safety import Payload


def make_step_dir(root: Path) -> Path:
    """Two ranks' files at the top (one in a subfolder), a COMPLETE marker, and a ``universal/`` folder with its
    own manifest, as a conversion leaves it."""
    step_dir = root / "step_00000004"
    (step_dir / "extra").mkdir(parents=True)
    records = [save_hashed({"weights": torch.arange(6.0)}, step_dir / "mp_rank_00_model_states.pt", 0),
               save_hashed({"moments": torch.ones(3)}, step_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt", 1)]
    torch.save({"more": torch.zeros(2)}, step_dir / "extra" / "state.pt")
    records.append(record_file(step_dir / "extra" / "state.pt", 1, root=step_dir))
    write_manifest(step_dir, records)
    (step_dir / "COMPLETE").write_text("{}\n")
    universal = step_dir / "universal"
    for name in ("embed_in.weight", "final_norm.bias"):
        (universal / "zero" / name).mkdir(parents=True)
        for key in ("fp32", "exp_avg"):
            torch.save({"param": torch.full((4,), 2.0)}, universal / "zero" / name / f"{key}.pt")
    torch.save({"param_groups": [{"lr": 1e-3}]}, universal / "zero" / "optimizer_state.pt")
    write_manifest(universal, record_tree(universal))
    return step_dir


def plant(directory: Path, name: str, payload: object, listed: bool = True) -> None:
    """Replace ``name`` under ``directory`` by a crafted pickle; with ``listed``, rewrite its manifest to match
    (an attacker with write access would)."""
    torch.save({"param": payload}, directory / name)
    if listed:
        records = read_manifest(directory)
        assert records is not None and name in records
        records[name].bytes, records[name].sha256 = (directory / name).stat().st_size, file_sha256(directory / name)
        write_manifest(directory, list(records.values()))


def test_every_file_under_the_step_dir_is_checked_once_over_the_ranks(tmp_path: Path) -> None:
    step_dir = make_step_dir(tmp_path)
    manifest = json.loads((step_dir / MANIFEST_FILE).read_text())
    assert manifest["version"] == 2 and "extra/state.pt" in manifest["files"]
    assert sorted(read_manifest(step_dir / "universal") or {}) == [
        "zero/embed_in.weight/exp_avg.pt", "zero/embed_in.weight/fp32.pt", "zero/final_norm.bias/exp_avg.pt",
        "zero/final_norm.bias/fp32.pt", "zero/optimizer_state.pt"]
    alone = verify_checkpoint(step_dir)
    assert alone.ok and alone.files_checked == 3 + 5
    for world_size in (2, 3):
        shares = [verify_checkpoint(step_dir, rank, world_size) for rank in range(world_size)]
        assert all(share.ok for share in shares)
        assert sum(share.files_checked for share in shares) == alone.files_checked


@pytest.mark.parametrize("name", ["zero/embed_in.weight/exp_avg.pt", "zero/optimizer_state.pt"])
def test_a_crafted_pickle_in_the_universal_folder_is_refused_unrun(tmp_path: Path, name: str) -> None:
    step_dir = make_step_dir(tmp_path)
    marker = tmp_path / "owned"
    plant(step_dir / "universal", name, Payload(marker))
    result = verify_checkpoint(step_dir)
    assert result.unsafe and result.problems == [
        f"{step_dir / 'universal' / name}: refused to unpickle posix.system (not a type megatron_lite checkpoints "
        "contain; the file may be malicious or from another program): not loaded"]
    assert not marker.exists()


@pytest.mark.parametrize("name", ["universal/zero/final_norm.bias/exp_avg_sq.pt", "extra/rng.pt",
                                  "universal/notes.txt"])
def test_a_file_no_manifest_lists_is_refused_unread(tmp_path: Path, name: str) -> None:
    step_dir = make_step_dir(tmp_path)
    marker = tmp_path / "owned"
    torch.save({"param": Payload(marker)}, step_dir / name)
    manifest = step_dir / ("universal" if name.startswith("universal/") else "") / MANIFEST_FILE
    assert verify_checkpoint(step_dir).problems == [
        f"{step_dir / name}: not listed in {manifest} (added after the save?)"]
    assert verify_checkpoint(step_dir, rank=1, world_size=2).ok  # rank 0 looks for unlisted files
    assert not marker.exists()


def test_a_changed_file_in_a_nested_folder_is_found_by_its_hash(tmp_path: Path) -> None:
    step_dir = make_step_dir(tmp_path)
    damaged = step_dir / "universal" / "zero" / "embed_in.weight" / "fp32.pt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01
    damaged.write_bytes(bytes(data))
    assert verify_checkpoint(step_dir).problems == [
        f"{damaged}: sha256 differs from {MANIFEST_FILE} (corrupted or changed since it was saved)"]


def test_staging_folders_of_an_interrupted_conversion_are_skipped(tmp_path: Path) -> None:
    step_dir = make_step_dir(tmp_path)
    staging = step_dir / ".universal.partial-4242" / "universal" / "zero"
    staging.mkdir(parents=True)
    marker = tmp_path / "owned"
    torch.save({"param": Payload(marker)}, staging / "optimizer_state.pt")
    assert verify_checkpoint(step_dir).ok and not marker.exists()
    (step_dir / ".hidden").mkdir()  # any other folder is checked
    (step_dir / ".hidden" / "x.pt").write_bytes(b"")
    assert verify_checkpoint(step_dir).problems[0].startswith(f"{step_dir / '.hidden' / 'x.pt'}: not listed")


def test_version_1_manifests_still_read_and_unknown_ones_are_one_line(tmp_path: Path) -> None:
    step_dir = make_step_dir(tmp_path)
    (step_dir / "extra" / "state.pt").unlink()
    (step_dir / "extra").rmdir()
    data = json.loads((step_dir / MANIFEST_FILE).read_text())
    del data["files"]["extra/state.pt"]
    data["version"] = 1  # what checkpoints saved before subfolders were listed carry
    (step_dir / MANIFEST_FILE).write_text(json.dumps(data))
    assert verify_checkpoint(step_dir).ok
    data["version"] = 3
    (step_dir / MANIFEST_FILE).write_text(json.dumps(data))
    assert verify_checkpoint(step_dir).problems == [
        f"{step_dir / MANIFEST_FILE}: unreadable manifest (version 3, expected one of (1, 2))"]
    data["version"], data["files"]["../elsewhere.pt"] = 2, data["files"]["mp_rank_00_model_states.pt"]
    (step_dir / MANIFEST_FILE).write_text(json.dumps(data))
    problem = verify_checkpoint(step_dir).problems[0]
    assert "unreadable manifest (path '../elsewhere.pt' leaves the checkpoint)" in problem


def test_the_universal_conversion_refuses_a_crafted_step_dir_before_deepspeed_reads_it(tmp_path: Path) -> None:
    step_dir = make_step_dir(tmp_path)
    marker = tmp_path / "owned"
    plant(step_dir, "zero_pp_rank_1_mp_rank_00_optim_states.pt", Payload(marker))
    with pytest.raises(UnsafeCheckpointError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt: refused to unpickle"):
        convert_step_to_universal(step_dir, tmp_path / "out")
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_a_universal_folder_is_named_as_such_and_points_at_its_step_dir(tmp_path: Path) -> None:
    """``tools/convert_checkpoint.py STEP/universal OUT`` or ``--resume STEP/universal``: one line, not
    DeepSpeed's zero_to_fp32 traceback about missing *_optim_states.pt files."""
    step_dir = tmp_path / "checkpoints" / "step_00000004"
    universal = step_dir / checkpoint_dirs.UNIVERSAL_DIR
    (universal / "zero" / "embed_in.weight").mkdir(parents=True)
    (universal / "mp_rank_00_model_states.pt").write_bytes(b"")
    for rank in range(2):
        (step_dir / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"")
    (step_dir / "mp_rank_00_model_states.pt").write_bytes(b"")
    assert checkpoint_dirs.checkpoint_kind(step_dir) == "step"
    with pytest.raises(ValueError, match=rf"universal checkpoint .* made from \({step_dir}\) instead$"):
        checkpoint_dirs.resolve_checkpoint(universal)
