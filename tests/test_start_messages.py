"""What a start says, once: a refused value under where it came from (``--set`` or the file that set it), a
missing or mistyped ``--config`` with the nearest file, a user error under the deepspeed launcher as one
``error:`` line, and DeepSpeed's one-time CPU op build announced (and its cached loads quiet)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_lite import config as config_lib
from script_loading import load_script
from training_helpers import REPO, train_command

# ----------------------------------------------------------------------------------------------
# Where a refused value came from


def _refusal(path: Path, overrides: list[str] | None = None) -> str:
    with pytest.raises(ValueError) as error:
        config_lib.load(path, overrides)
    return str(error.value)


def test_a_refused_value_is_named_under_the_set_or_the_file_that_set_it(tmp_path: Path) -> None:
    base = tmp_path / "shared" / "base.yml"
    base.parent.mkdir()
    base.write_text("train: {lr: 1.0e-3, min_lr: 1.0e-4, warmup: 0.01}\nmodel: {position: {scheme: rope}}\n")
    child = tmp_path / "child.yml"
    child.write_text("base: shared/base.yml\ntrain: {weight_decay: 0.1}\n")
    assert _refusal(child, ["train.lr=nan"]) == "--set train.lr=nan: must be positive"
    assert _refusal(child, ["train.lr=1e-6"]) == (  # names min_lr first; the --set made it wrong
        "--set train.lr=1e-6: train.min_lr=0.0001: must be in [0, train.lr=1e-06]")
    assert _refusal(child, ["train.lrr=1"]) == "--set train.lrr=1: unknown config key train.lrr; did you mean train.lr?"
    assert _refusal(child, ["train={lr: 0}"]) == "--set train={lr: 0}: train.lr=0.0: must be positive"
    child.write_text("base: shared/base.yml\ntrain: {weight_decay: -1}\n")
    assert _refusal(child) == f"{child}: train.weight_decay=-1.0: must be >= 0"
    assert _refusal(child, ["train.lr=1e-3"]) == f"{child}: train.weight_decay=-1.0: must be >= 0"
    child.write_text("base: shared/base.yml\n")
    base.write_text("train: {warmup: 3}\n")
    assert _refusal(child) == f"{base} (a base of {child}): train.warmup=3.0: must be a fraction in [0, 1)"


def test_a_missing_config_offers_the_nearest_file_and_a_directory_is_called_one(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(REPO)
    train = load_script("train.py")
    cases = {"configs/tiny/coca_slak.yml": "error: config file configs/tiny/coca_slak.yml does not exist; did you "
                                           "mean configs/tiny/coca_slack.yml?",
             "configs/tiny": "error: config file configs/tiny is a directory, not a YAML file (it holds alibi.yml, "
                             "coca_slack.yml, coca_strict.yml, ...)",
             "configs/tiny/nothing_like_it.yml": "error: config file configs/tiny/nothing_like_it.yml does not exist"}
    for given, said in cases.items():
        assert train.main(["--config", given]) == 2
        assert capsys.readouterr().err.splitlines() == [said]
    assert train.main(["--config", "configs/tiny/rope.yml", "--set", "train.lr=nan"]) == 2
    assert capsys.readouterr().err.splitlines() == ["error: --set train.lr=nan: must be positive"]


# ----------------------------------------------------------------------------------------------
# A user error under a launcher


def test_the_launched_ranks_check_the_batch_before_deepspeed_and_only_rank_0_names_the_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_lite.training import loop

    def reached(*args: object, **kwargs: object) -> None:
        raise AssertionError("run_training started (DeepSpeed, the data, the run dir) for a batch that cannot fit")

    monkeypatch.setattr(loop, "run_training", reached)
    train = load_script("train.py")
    command = ["--config", str(REPO / "configs/tiny/coca_slack.yml"), "--run-dir", str(tmp_path / "run"),
               "--set", "train.train_batch_size=12"]
    said = {}
    for rank in (0, 1):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", str(rank))
        assert train.main(command) == 2
        said[rank] = capsys.readouterr().err.splitlines()
    assert said[1] == [] and said[0] == [
        "error: train.train_batch_size=12 is not a multiple of train.train_micro_batch_size_per_gpu=16 x 2 "
        "data-parallel ranks = 32; train.train_micro_batch_size_per_gpu=6, 3, 2 or 1 keeps it (set it with --set)"]
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    assert train.main([*command[:-1], "train.sequence_parallel_size=2"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: train.sequence_parallel_size=2 does not divide the 3 rank(s) launched (ranks = data-parallel ranks x P)"]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_user_error_under_the_deepspeed_launcher_is_one_error_line(tmp_path: Path) -> None:
    """Two ranks, a global batch that does not divide: one ``error:`` line (rank 0's), exit code 2, before
    DeepSpeed starts. The launcher's own lines (stdout) follow: one "Killing subprocess" per rank and one naming
    the command of the rank that exited, "exits with return code = 2"."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    command = train_command(REPO / "configs/tiny/coca_slack.yml", tmp_path / "run", "--set",
                            "train.train_batch_size=12", ranks=2)
    result = subprocess.run(command, cwd=REPO, env=env, text=True, capture_output=True, timeout=300)
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert [line for line in result.stderr.splitlines() if "error" in line.lower()] == [
        "error: train.train_batch_size=12 is not a multiple of train.train_micro_batch_size_per_gpu=16 x 2 "
        "data-parallel ranks = 32; train.train_micro_batch_size_per_gpu=6, 3, 2 or 1 keeps it (set it with --set)"]
    assert "exits with return code = 2" in result.stdout and "Traceback" not in result.stdout + result.stderr
    assert "built successfully" not in result.stdout  # stopped before DeepSpeed loads or builds its CPU op
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------------------------
# DeepSpeed's CPU communication op: built once, said once; loaded quietly


BUILT = "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully"  # deepspeed/comm/torch.py's line


def test_the_cpu_op_build_is_announced_once_on_rank_0_and_its_cached_loads_are_quiet(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Decided from torch's build directory (TORCH_EXTENSIONS_DIR/deepspeed_shm_comm): no library there, the
    notice names it before the build and DeepSpeed's line after it stays; a library there (a load), the
    notice is not given and DeepSpeed's line is dropped, while every other line passes."""
    from megatron_lite.training import jit_lock

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    build_dir = tmp_path / "deepspeed_shm_comm"
    assert jit_lock.comm_op_to_build() == build_dir
    capsys.readouterr()  # what importing DeepSpeed printed
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        with jit_lock.watch_jit_locks():
            print(BUILT)
        said = capsys.readouterr().out.splitlines()
        notice = [jit_lock.build_notice(build_dir)] if rank == "0" else []
        assert said == [*notice, BUILT]
    assert "40 s to 2 minutes" in jit_lock.build_notice(build_dir) and str(build_dir) in jit_lock.build_notice(build_dir)

    build_dir.mkdir()
    (build_dir / "deepspeed_shm_comm.so").write_bytes(b"")
    assert jit_lock.comm_op_to_build() is None
    with jit_lock.watch_jit_locks():
        print("a line of its own")
        print(BUILT)
        sys.stdout.write("no newline yet")
    assert capsys.readouterr().out == "a line of its own\nno newline yet"
