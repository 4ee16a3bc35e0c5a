"""Checkpoints that cannot run code and cannot be silently corrupt (megatron_lite/checkpoint_integrity.py).

Real faults on real checkpoints of train.py: a crafted pickle that would create a marker file, placed
in every checkpoint file position of ZeRO 0, 2 and 3 (model states, optimizer states, RNG state) with
the manifest rewritten to match, as an attacker with write access would; truncated and bit-flipped
files; a full device (/dev/full) under DeepSpeed's checkpoint engine (a full disk on one rank of two:
test_training_run.py).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from megatron_lite import checkpoint_dirs
from megatron_lite.checkpoint_integrity import (MANIFEST_FILE, CheckpointIntegrityError, UnsafeCheckpointError,
                                                read_manifest, safe_load, verify_checkpoint, write_manifest)
from megatron_lite.console import Notice
from megatron_lite.files import file_sha256
from megatron_lite.training.checkpointing import find_resume_checkpoint
from megatron_lite.training.distributed import DistributedInfo
from megatron_lite.weights import load_model, load_step_state_dict
from script_loading import load_script
from training_helpers import run_train, tiny_train_config, write_config

ONE_PROCESS = DistributedInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


class Payload:
    """Unpickling this runs ``touch marker`` (what a real attack would replace with anything)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def runs(training_corpus, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """ZeRO stage -> a finished run dir: stage 0 trains 8 steps (checkpoints 4, 8), stages 2 and 3 four (2, 4)."""
    mix, cache = training_corpus
    root = tmp_path_factory.mktemp("safety")
    found = {}
    for stage, steps in ((0, 8), (2, 4), (3, 4)):
        config = write_config(root / f"zero{stage}.yml", tiny_train_config(
            mix, cache, train_iters=steps, save_interval=steps // 2, eval_interval=0, zero_stage=stage))
        run_train(config, root / f"zero{stage}")
        found[stage] = root / f"zero{stage}"
    return found


def copy_run(run: Path, target: Path) -> tuple[Path, Path]:
    """(copied run dir, its config file rewritten to point nowhere else)."""
    shutil.copytree(run, target)
    return target, target / checkpoint_dirs.CONFIG_FILE


def latest_step(run: Path) -> Path:
    found = checkpoint_dirs.latest_complete(run / checkpoint_dirs.CHECKPOINTS_DIR)
    assert found is not None
    return found


def plant(step_dir: Path, name: str, payload: object) -> None:
    """Replace ``name`` by a torch file holding ``payload`` and update the manifest to match."""
    torch.save({"module": payload}, step_dir / name)
    records = read_manifest(step_dir)
    assert records is not None and name in records
    records[name].bytes, records[name].sha256 = (step_dir / name).stat().st_size, file_sha256(step_dir / name)
    write_manifest(step_dir, list(records.values()))


POSITIONS = [  # (ZeRO stage, file)
    (0, "mp_rank_00_model_states.pt"),
    (0, "rng_state_rank00000.pt"),
    (2, "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    (3, "zero_pp_rank_0_mp_rank_00_model_states.pt"),
    (3, "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "name"), POSITIONS)
def test_crafted_pickle_is_refused_by_resume_load_model_and_converter(runs: dict[int, Path], tmp_path: Path,
                                                                      stage: int, name: str,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    run, config = copy_run(runs[stage], tmp_path / "run")
    step_dir = latest_step(run)
    marker = tmp_path / "owned"
    plant(step_dir, name, Payload(marker))

    with pytest.raises(UnsafeCheckpointError, match=rf"{name}: refused to unpickle posix\.system"):
        load_model(step_dir)
    assert not marker.exists()

    converter = load_script("tools/convert_checkpoint.py")
    assert converter.main([str(run), str(tmp_path / "hf"), "--to", "hf"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: ") and "refused to unpickle posix.system" in error and "\n" not in error
    assert not marker.exists() and not (tmp_path / "hf").exists()

    with pytest.raises(ValueError, match=rf"--resume {step_dir}: {step_dir} fails verification: .*refused to unpickle"):
        find_resume_checkpoint(str(step_dir), run, ONE_PROCESS)
    # --resume auto: the crafted checkpoint is skipped with a warning naming the file; the previous one resumes
    resumed = run_train(config, run, "--resume", "auto")
    assert f"warning: --resume auto: skipping {step_dir}: {step_dir / name}: refused to unpickle posix.system" \
        in resumed.stdout
    assert "resumed from" in resumed.stdout and "Traceback" not in resumed.stdout + resumed.stderr
    assert not marker.exists()


@pytest.mark.slow
def test_crafted_pickle_without_a_manifest_is_refused_too(runs: dict[int, Path], tmp_path: Path) -> None:
    """A checkpoint with no manifest (an older version's, or one with the manifest deleted) is still unpickled
    safely; a plain (non-zip) pickle is refused as well."""
    run, _ = copy_run(runs[2], tmp_path / "run")
    step_dir = latest_step(run)
    (step_dir / MANIFEST_FILE).unlink()
    marker = tmp_path / "owned"
    import pickle

    (step_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(pickle.dumps(Payload(marker)))
    result = verify_checkpoint(step_dir)
    assert not result.has_manifest and len(result.problems) == 1
    assert "refused to unpickle an unsupported pickle instruction" in result.problems[0]
    with pytest.raises(UnsafeCheckpointError):
        load_step_state_dict(step_dir)
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_checkpoint_falls_back_and_finishes_bitwise_equal(runs: dict[int, Path], tmp_path: Path,
                                                                    damage: str) -> None:
    run, config = copy_run(runs[0], tmp_path / "run")
    final = latest_step(run)
    expected = load_step_state_dict(final)
    damaged = final / "mp_rank_00_model_states.pt"
    data = bytearray(damaged.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x01
    damaged.write_bytes(bytes(data))

    with pytest.raises(ValueError, match=rf"fails verification: {damaged}: "):
        find_resume_checkpoint(str(final), run, ONE_PROCESS)  # an explicit path: a clear error, no fallback
    with pytest.raises(CheckpointIntegrityError, match=str(damaged)):
        load_model(final)

    resumed = run_train(config, run, "--resume", "auto")
    assert f"warning: --resume auto: skipping {final}: {damaged}: " in resumed.stdout
    assert "resumed from" in resumed.stdout and "step_00000004" in resumed.stdout
    result = load_step_state_dict(latest_step(run))
    assert result.keys() == expected.keys() and all(torch.equal(result[k], expected[k]) for k in expected)


@pytest.mark.slow
def test_every_checkpoint_damaged_is_one_line_not_a_fresh_start(runs: dict[int, Path], tmp_path: Path) -> None:
    run, config = copy_run(runs[2], tmp_path / "run")
    for step_dir in checkpoint_dirs.complete_checkpoints(run / checkpoint_dirs.CHECKPOINTS_DIR):
        (step_dir / checkpoint_dirs.CONFIG_FILE).write_text("changed after the save\n")
    with pytest.warns(Notice, match="config.yml: 23 bytes, the manifest says"), pytest.raises(
            ValueError, match=r"--resume auto: none of the 2 complete checkpoint\(s\) in .* passes verification"):
        find_resume_checkpoint("auto", run, ONE_PROCESS)


@pytest.mark.slow
def test_manifest_lists_every_file_and_extra_pickles_are_refused(runs: dict[int, Path], tmp_path: Path) -> None:
    run, _ = copy_run(runs[3], tmp_path / "run")
    step_dir = latest_step(run)
    records = read_manifest(step_dir)
    assert records is not None
    expected = sorted(p.name for p in step_dir.iterdir() if p.name not in (MANIFEST_FILE, checkpoint_dirs.COMPLETE_MARKER))
    assert sorted(records) == expected
    assert all(records[name].sha256 == file_sha256(step_dir / name) for name in records)
    assert verify_checkpoint(step_dir).ok
    shutil.copyfile(step_dir / "rng_state_rank00000.pt", step_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert verify_checkpoint(step_dir).problems == [
        f"{step_dir / 'zero_pp_rank_1_mp_rank_00_optim_states.pt'}: not listed in {step_dir / MANIFEST_FILE} "
        "(added after the save?)"]


@pytest.mark.slow
def test_checkpoint_without_manifest_loads_with_a_notice(runs: dict[int, Path], tmp_path: Path) -> None:
    run, _ = copy_run(runs[0], tmp_path / "run")
    step_dir = latest_step(run)
    (step_dir / MANIFEST_FILE).unlink()
    with pytest.warns(Notice, match=f"{MANIFEST_FILE} .*not verified"):
        load_model(step_dir)


@pytest.mark.slow
def test_safe_load_reads_deepspeed_optimizer_states_and_names_unreadable_files(runs: dict[int, Path],
                                                                               tmp_path: Path) -> None:
    state = safe_load(latest_step(runs[2]) / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert {"optimizer_state_dict", "ds_config"} <= set(state)
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(UnsafeCheckpointError, match="garbage.pt: refused to unpickle"):
        safe_load(tmp_path / "garbage.pt")
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(CheckpointIntegrityError, match="empty.pt: unreadable"):
        safe_load(tmp_path / "empty.pt")


def test_checkpoint_engine_keeps_a_failed_write_for_the_agreement(tmp_path: Path) -> None:
    """A real ENOSPC (/dev/full) inside DeepSpeed's engine.save: no exception escapes (the rank must reach
    DeepSpeed's closing barrier), the error is kept, later saves of the same checkpoint are skipped."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    from megatron_lite.training.checkpoint_engine import VerifiedCheckpointEngine

    engine = VerifiedCheckpointEngine(zipfile_serialization=True, rank=1)
    engine.begin()
    engine.save({"weights": torch.ones(1000)}, str(tmp_path / "good.pt"))
    engine.save({"weights": torch.ones(1000)}, "/dev/full")
    assert isinstance(engine.error, OSError) and engine.error.errno == 28
    engine.save({"weights": torch.ones(1000)}, str(tmp_path / "skipped.pt"))
    assert [record.name for record in engine.written] == ["good.pt"] and not (tmp_path / "skipped.pt").exists()
    assert engine.written[0].sha256 == file_sha256(tmp_path / "good.pt") and engine.written[0].rank == 1
    assert torch.equal(engine.load(str(tmp_path / "good.pt"))["weights"], torch.ones(1000))
    engine.begin()
    assert engine.error is None and engine.written == []
