"""A checkpoint's lifecycle when a step is written twice or a save fails (issue 38): real train.py runs.

1. A redone step (``--resume none`` in the same run dir, on 2 ranks) replaces its step dir as a unit: the
   earlier save's ``universal/`` conversion does not survive, and a later resume on 1 rank converts the new save
   instead of training on from the abandoned run's state (slow: 2 ranks). On 1 rank: the redone step survives
   pruning, and ``--resume auto``'s fallback never picks the abandoned history's later checkpoint.
2. A derived folder that fails verification never makes its step be skipped: a ``universal/`` without its
   manifest leaves the step usable (1 rank), and a truncated file in it is deleted and rebuilt, the resume
   continuing exactly as from the intact conversion (slow: a 2-rank checkpoint resumed on 1 rank).
3. A failed final save ends the run with exit code 4 and ``stopped_by: final_save_failed`` naming the last
   complete checkpoint (1 rank).
4. A resume at another ZeRO stage on the same rank count: 1 <-> 2 continues exactly, 0 and 3 stop in one line
   (1 rank).
5. A universal conversion on a real small filesystem (a tmpfs; skipped where it cannot be mounted) says how
   much space it needs before it starts.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import yaml

from megatron_lite import checkpoint_dirs
from megatron_lite.checkpoint_integrity import MANIFEST_FILE, read_manifest
from megatron_lite.console import Notice
from training_helpers import metrics, run_train, tiny_train_config, train_losses, write_config

SAVED = 4


def lifecycle_config(root: Path, corpus: tuple[Path, Path], name: str = "config.yml", **train: object) -> Path:
    """The tiny run of training_helpers at ZeRO 1: 4 steps of 8 samples (the accumulation derived from the rank
    count), dropout 0, no evaluation, a checkpoint every 4 steps."""
    mix, cache = corpus
    data = tiny_train_config(mix, cache, **{"train_iters": SAVED, "save_interval": SAVED, "eval_interval": 0,
                                            "zero_stage": 1, "gradient_accumulation_steps": None,
                                            "train_batch_size": 8, **train})
    data["model"].update(attention_dropout=0.0, hidden_dropout=0.0)
    return write_config(root / name, data)


def step_dir(run: Path, step: int) -> Path:
    return run / checkpoint_dirs.CHECKPOINTS_DIR / checkpoint_dirs.step_tag(step)


def unlisted_files(directory: Path) -> list[str]:
    """Files of a step dir that its manifest does not list (COMPLETE and the manifest itself aside)."""
    listed = set(read_manifest(directory) or {})
    return sorted(path.relative_to(directory).as_posix() for path in directory.rglob("*") if path.is_file()
                  and path.relative_to(directory).as_posix() not in listed | {MANIFEST_FILE, "COMPLETE"})


# ----------------------------------------------------------------------------------------------
# 1. A redone step on 1 rank: the later checkpoints are another history's


def test_a_redone_step_is_kept_and_never_falls_back_to_the_abandoned_history(training_corpus, tmp_path: Path) -> None:
    """8 steps keeping 1 checkpoint (step 8), then ``--resume none`` to step 4 in the same run dir: the new step 4
    must survive pruning (the abandoned step 8 is not counted against it), and a fallback from a damaged step 4
    must not pick the abandoned step 8."""
    from megatron_lite.training.checkpointing import find_resume_checkpoint
    from megatron_lite.training.distributed import DistributedInfo

    config = lifecycle_config(tmp_path, training_corpus, zero_stage=0, keep_last_checkpoints=1)
    run = tmp_path / "run"
    run_train(config, run, "--train-iters", "8")
    assert [path.name for path in checkpoint_dirs.complete_checkpoints(run / "checkpoints")] == ["step_00000008"]
    run_train(config, run, "--resume", "none")
    assert checkpoint_dirs.latest_complete(run / "checkpoints") == step_dir(run, SAVED)
    (step_dir(run, SAVED) / "mp_rank_00_model_states.pt").write_bytes(b"damaged")
    with pytest.warns(Notice, match="skipping"), pytest.raises(ValueError, match="none of the 1 complete checkpoint"):
        find_resume_checkpoint("auto", run, DistributedInfo(rank=0, local_rank=0, world_size=1,
                                                            device=torch.device("cpu")))


# ----------------------------------------------------------------------------------------------
# 3. A failed final save


def test_a_failed_final_save_exits_non_zero_naming_the_last_complete_checkpoint(training_corpus, tmp_path: Path
                                                                                 ) -> None:
    config = lifecycle_config(tmp_path, training_corpus, save_interval=2, zero_stage=0,
                              fault_injection={"fail_save_step": SAVED})
    result = run_train(config, tmp_path / "run", check=False)
    last_good = step_dir(tmp_path / "run", 2)
    assert result.returncode == 4, result.stdout[-2000:] + result.stderr[-2000:]
    assert "warning: checkpoint at step 4 failed" in result.stdout
    assert f"steps after step 2 are in no checkpoint; last complete checkpoint: {last_good}" in result.stdout
    assert "done: final save failed at step 4/4" in result.stdout
    assert metrics(tmp_path / "run")[-1] == {"step": SAVED, "stopped_by": "final_save_failed",
                                             "last_checkpoint": str(last_good)}
    assert checkpoint_dirs.latest_complete(tmp_path / "run" / checkpoint_dirs.CHECKPOINTS_DIR) == last_good


# ----------------------------------------------------------------------------------------------
# 2. A damaged derived folder keeps its step


def test_a_universal_folder_without_its_manifest_does_not_skip_its_step(training_corpus, tmp_path: Path) -> None:
    """A ``universal/`` whose manifest is gone (a removal or copy cut short) sits in the newest step dir; the
    same-size resume, which never reads it, resumes from that step, not from the one before."""
    config = lifecycle_config(tmp_path, training_corpus, save_interval=2)
    run_train(config, tmp_path / "run")
    damaged = step_dir(tmp_path / "run", SAVED) / checkpoint_dirs.UNIVERSAL_DIR / "zero" / "embed_in.weight"
    damaged.mkdir(parents=True)
    torch.save({"param": torch.zeros(3)}, damaged / "fp32.pt")
    resumed = run_train(config, tmp_path / "run", "--train-iters", str(SAVED + 1))
    assert f"resumed from {step_dir(tmp_path / 'run', SAVED)} at step {SAVED}" in resumed.stdout, resumed.stdout
    assert "skipping" not in resumed.stdout + resumed.stderr


# ----------------------------------------------------------------------------------------------
# 4. Another ZeRO stage on the same rank count


@pytest.fixture(scope="module")
def zero1_run(training_corpus, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(config, a run dir: 1 rank, ZeRO 1, checkpoint at step 4)."""
    root = tmp_path_factory.mktemp("zero1")
    config = lifecycle_config(root, training_corpus)
    run_train(config, root / "run")
    return config, root / "run"


def test_a_zero_stage_change_continues_exactly_or_stops_in_one_line(zero1_run, tmp_path: Path) -> None:
    """ZeRO 1 -> 2 (the same files) continues with the losses of the run that stayed at ZeRO 1; ZeRO 1 -> 3 and
    1 -> 0, which DeepSpeed's load fails on with a traceback, stop in one line before DeepSpeed starts."""
    config, run = zero1_run
    shutil.copytree(run, tmp_path / "zero1")
    saved = step_dir(tmp_path / "zero1", SAVED)
    shutil.copytree(tmp_path / "zero1", tmp_path / "zero2")
    run_train(config, tmp_path / "zero1", "--train-iters", "6")
    run_train(config, tmp_path / "zero2", "--train-iters", "6", "--set", "train.zero_stage=2")
    assert train_losses(tmp_path / "zero2") == train_losses(tmp_path / "zero1")
    for stage in (3, 0):
        refused = run_train(config, tmp_path / f"zero{stage}", "--resume", str(saved), "--train-iters", "6", "--set",
                            f"train.zero_stage={stage}", check=False)
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
        assert (f"error: cannot resume {saved} at ZeRO {stage}: it was saved at ZeRO 1, and a checkpoint changes its "
                "ZeRO stage only between 1 and 2") in refused.stderr
        assert not (tmp_path / f"zero{stage}" / checkpoint_dirs.CHECKPOINTS_DIR).exists()


# ----------------------------------------------------------------------------------------------
# 5. The conversion on a small disk


def test_a_conversion_without_the_space_it_needs_says_so_before_it_starts(zero1_run, tmp_path: Path) -> None:
    """A real small filesystem (tmpfs) holding the step dir and 200 kB more: the conversion names the space it
    needs and the space free, in one line, and leaves nothing behind."""
    import subprocess

    from megatron_lite.convert.universal import convert_step_to_universal

    _, run = zero1_run
    source = step_dir(run, SAVED)
    size = sum(path.stat().st_size for path in source.rglob("*") if path.is_file())
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size + 200_000}", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        copy = disk / source.name
        shutil.copytree(source, copy)
        with pytest.raises(ValueError) as raised:
            convert_step_to_universal(copy, copy / checkpoint_dirs.UNIVERSAL_DIR)
        message = str(raised.value)
        needed = 1.5 * sum(path.stat().st_size for path in copy.glob("*_states.pt"))  # the DeepSpeed files
        assert "\n" not in message and message.startswith(f"{copy}: not enough free disk space for the universal "
                                                          f"conversion: it needs about {needed / 1e6:.1f} MB"), message
        assert sorted(path.name for path in copy.iterdir()) == sorted(path.name for path in source.iterdir())
    finally:
        subprocess.run(["umount", str(disk)], check=True)


# ----------------------------------------------------------------------------------------------
# 1 and 2 on another rank count (slow): one 2-rank checkpoint, its 1-rank resumes


@pytest.fixture(scope="module")
def two_rank_run(training_corpus, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, float]]:
    """(a run dir: 2 ranks to step 4, then 1 rank to step 5, converting step 4; that resume's losses)."""
    if shutil.which("deepspeed") is None:
        pytest.skip("the deepspeed launcher is not on PATH")
    root = tmp_path_factory.mktemp("lifecycle")
    config = lifecycle_config(root, training_corpus)
    run_train(config, root / "run", ranks=2, timeout=300)
    resumed = run_train(config, root / "run", "--train-iters", str(SAVED + 1))
    assert "(saved by 2 rank(s)) on 1 rank(s)" in resumed.stderr + resumed.stdout and "converted it in" in (
        resumed.stderr + resumed.stdout)
    return root, train_losses(root / "run")


@pytest.mark.slow
def test_a_truncated_universal_file_is_rebuilt_and_the_resume_goes_on_exactly(two_rank_run, tmp_path: Path) -> None:
    root, losses = two_rank_run
    source = step_dir(root / "run", SAVED)
    shutil.copytree(source, tmp_path / source.name)
    universal = tmp_path / source.name / checkpoint_dirs.UNIVERSAL_DIR
    truncated = universal / "zero" / "embed_in.weight" / "exp_avg.pt"
    truncated.write_bytes(truncated.read_bytes()[:100])
    resumed = run_train(root / "config.yml", tmp_path / "run", "--resume", str(tmp_path / source.name),
                        "--train-iters", str(SAVED + 1), check=False)
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-3000:]
    assert f"{universal}: fails verification ({truncated}: 100 bytes" in output
    assert train_losses(tmp_path / "run")[SAVED + 1] == losses[SAVED + 1]  # as from the intact conversion


@pytest.mark.slow
def test_a_redone_step_replaces_its_step_dir_and_its_conversion(two_rank_run, tmp_path: Path) -> None:
    """The issue's sequence: 2 ranks to step 4, a 1-rank resume (converts), ``--resume none`` on 2 ranks with
    another lr to step 4 (the same step dir), a 1-rank resume: it must convert the new save, not reuse the old."""
    root, losses = two_rank_run
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    assert (step_dir(run, SAVED) / checkpoint_dirs.UNIVERSAL_DIR / MANIFEST_FILE).is_file()
    data = yaml.safe_load((root / "config.yml").read_text())
    data["train"]["lr"] = 1.0e-3
    config = write_config(tmp_path / "config.yml", data)
    run_train(config, run, "--resume", "none", ranks=2, timeout=300)
    redone = step_dir(run, SAVED)
    left_over = unlisted_files(redone)  # files of the earlier save
    resumed = run_train(config, run, "--resume", str(redone), "--train-iters", str(SAVED + 1))
    output = resumed.stdout + resumed.stderr
    assert "converted it in" in output and "reusing the conversion" not in output
    assert train_losses(run)[SAVED + 1] != losses[SAVED + 1]  # the new save's state, not the abandoned run's
    assert left_over == []
