"""Asynchronous checkpoints (train.async_save, megatron_lite/training/checkpointer.py) against real train.py runs.

An asynchronous checkpoint holds the same files and tensors as a synchronous save of the same step; a run stopped
(SIGTERM) or killed (SIGKILL) while one is being written (slowed by the write-delay test hook) resumes to the
uninterrupted run's losses; a background write that fails on one rank of two (a real file-size limit) is one
line, its step dir removed, and the run goes on.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_lite import checkpoint_dirs
from megatron_lite.checkpoint_integrity import safe_load
from megatron_lite.training.checkpoint_writes import WRITE_DELAY_ENV
from megatron_lite.training.host_snapshot import host_copy
from training_helpers import REPO, run_train, tiny_train_config, train_command, train_losses, write_config

STEPS = 10


def tensors(node: Any, path: str = "") -> dict[str, Any]:
    """Every leaf of a loaded checkpoint file by its path (tensors and plain values)."""
    if isinstance(node, dict):
        return {key: value for name, child in node.items() for key, value in tensors(child, f"{path}/{name}").items()}
    if isinstance(node, (list, tuple)) and not isinstance(node, torch.Size):
        return {key: value for index, child in enumerate(node)
                for key, value in tensors(child, f"{path}[{index}]").items()}
    return {path: node}


def assert_same_checkpoint(expected: Path, actual: Path) -> None:
    """The same files; every tensor equal (dtype, shape, values). The RNG files compare torch's generator only:
    numpy's and Python's are never seeded in a run's main process, so they differ between any two runs."""
    assert sorted(p.name for p in expected.iterdir()) == sorted(p.name for p in actual.iterdir())
    for file in sorted(expected.glob("*.pt")):
        left, right = tensors(safe_load(file)), tensors(safe_load(actual / file.name))
        if file.name.startswith("rng_state"):
            left, right = {"torch": left["/torch"]}, {"torch": right["/torch"]}
        assert left.keys() == right.keys(), file.name
        for key, value in left.items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == right[key].dtype and torch.equal(value, right[key]), f"{file.name}: {key}"


def start_train(config: Path, run_dir: Path, *extra: str, delay: float = 0.0) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1",
           WRITE_DELAY_ENV: str(delay)}
    return subprocess.Popen(train_command(config, run_dir, *extra), cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def when_writing(process: subprocess.Popen[str], run_dir: Path, step: int, timeout: float = 300) -> None:
    """Return once ``step``'s checkpoint is being written in the background (its dir there, not complete) and
    the step loop went past it (the next step logged)."""
    step_dir = run_dir / checkpoint_dirs.CHECKPOINTS_DIR / checkpoint_dirs.step_tag(step)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stdout.read() if process.stdout else ""
        if logged_step(run_dir, step + 1) and step_dir.is_dir():
            assert not checkpoint_dirs.is_complete(step_dir)
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step}'s background write never seen")


def logged_step(run_dir: Path, step: int) -> bool:
    """Whether metrics.jsonl has ``step``'s row yet (its last line may be half written)."""
    path = run_dir / "metrics.jsonl"
    return path.is_file() and any(line.startswith(f'{{"step": {step},') for line in path.read_text().splitlines())


@pytest.fixture(scope="module")
def configs(training_corpus, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    mix, cache = training_corpus
    root = tmp_path_factory.mktemp("async_checkpoint")

    def config(name: str, **train: Any) -> Path:
        settings = {"train_iters": STEPS, "save_interval": 2, "eval_interval": 0, **train}
        return write_config(root / f"{name}.yml", tiny_train_config(mix, cache, **settings))

    zero3 = {"zero_stage": 3, "train_iters": 6}
    zero1 = {"zero_stage": 1, "train_iters": 3}  # step 2's save in the background, step 3's the final one
    return {"sync": config("sync", zero_stage=1), "async": config("async", zero_stage=1, async_save=True),
            "sync1": config("sync1", **zero1), "async1": config("async1", **zero1, async_save=True),
            "sync3": config("sync3", **zero3),
            "async3": config("async3", **zero3, async_save=True, fault_injection={
                "disk_full_save_steps": [2], "disk_full_bytes": 4096, "disk_full_rank": 1})}


@pytest.fixture(scope="module")
def reference(configs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted synchronous run: 10 steps, ZeRO 1, a checkpoint every 2 steps."""
    run_dir = tmp_path_factory.mktemp("async_reference") / "run"
    run_train(configs["sync"], run_dir, "--resume", "none")
    return run_dir


def test_host_copy_keeps_shared_storage_and_the_values_at_the_copy() -> None:
    flat = torch.arange(10.0)
    state = collections.OrderedDict(first=flat[:4], second=flat[4:].view(2, 3), shape=torch.Size([2, 3]))
    state._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    copied = host_copy({"module": state, "groups": [{"lr": 0.1, "params": [0, 1]}]})
    flat.add_(1)  # the next step changes the live tensors in place
    assert copied["module"]["first"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert copied["module"]["second"].tolist() == [[4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
    first, second = copied["module"]["first"], copied["module"]["second"]
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
    assert type(copied["module"]) is collections.OrderedDict and copied["module"]._metadata == state._metadata
    assert type(copied["module"]["shape"]) is torch.Size


@pytest.mark.slow
def test_async_checkpoints_equal_sync_ones_and_a_stop_then_a_kill_resume_exactly(
        configs: dict[str, Path], reference: Path, tmp_path: Path) -> None:
    """One rank, ZeRO 1. SIGTERM while step 4's checkpoint is written in the background: it completes, then the
    stop's own save, exit 143. The resumed run is SIGKILLed while step 6 (or 8)'s is written: the next run removes
    that incomplete dir and resumes from the previous checkpoint. Every checkpoint equals the synchronous run's;
    the losses are the uninterrupted run's."""
    run_dir = tmp_path / "run"
    stopped = start_train(configs["async"], run_dir, delay=1.0)
    when_writing(stopped, run_dir, 4)
    stopped.send_signal(signal.SIGTERM)
    output = stopped.communicate(timeout=300)[0]
    assert stopped.returncode == 143, output[-3000:]
    complete = checkpoint_dirs.complete_checkpoints(run_dir / checkpoint_dirs.CHECKPOINTS_DIR)
    stop_step = checkpoint_dirs.checkpoint_step(complete[-1])
    assert [checkpoint_dirs.checkpoint_step(p) for p in complete[:2]] == [2, 4] and stop_step and stop_step >= 4
    assert f"saved checkpoint {complete[1]} (written in the background" in output
    assert "s for the checkpoint at step 4 to finish writing" in output  # the stop's save waited for it first
    assert checkpoint_dirs.read_complete_marker(complete[-1])["stopped_by"] == "signal"

    killed = start_train(configs["async"], run_dir, delay=2.0)
    killing = stop_step + 2 - stop_step % 2
    when_writing(killed, run_dir, killing)
    killed.send_signal(signal.SIGKILL)
    killed.communicate(timeout=60)
    abandoned = run_dir / checkpoint_dirs.CHECKPOINTS_DIR / checkpoint_dirs.step_tag(killing)
    assert abandoned.is_dir() and not checkpoint_dirs.is_complete(abandoned)

    previous = checkpoint_dirs.latest_complete(run_dir / checkpoint_dirs.CHECKPOINTS_DIR)
    assert previous is not None and checkpoint_dirs.checkpoint_step(previous) == max(stop_step, killing - 2)
    finished = run_train(configs["async"], run_dir)
    assert f"resumed from {previous} at step" in finished.stdout
    removal = [line for line in (finished.stdout + finished.stderr).splitlines() if "incomplete checkpoint" in line]
    assert len(removal) == 1 and abandoned.name in removal[0], finished.stdout[-3000:]
    assert checkpoint_dirs.is_complete(abandoned)  # the resumed run saved that step again, in full
    assert train_losses(run_dir) == train_losses(reference)
    compared = 0
    for step_dir in checkpoint_dirs.complete_checkpoints(run_dir / checkpoint_dirs.CHECKPOINTS_DIR):
        if (reference / checkpoint_dirs.CHECKPOINTS_DIR / step_dir.name).is_dir():
            assert_same_checkpoint(reference / checkpoint_dirs.CHECKPOINTS_DIR / step_dir.name, step_dir)
            compared += 1
    assert compared >= 3


@pytest.mark.slow
def test_async_zero3_on_two_ranks_equals_sync_and_a_failed_background_write_is_one_line(configs: dict[str, Path],
                                                                                        tmp_path: Path) -> None:
    """ZeRO 3, 2 ranks, 6 steps. Rank 1's background write of step 2 fails (a real file-size limit): one line on
    rank 0, step 2's dir removed, no hang; step 4's (asynchronous) checkpoint and every loss equal the synchronous
    run's."""
    sync_run, async_run = tmp_path / "sync", tmp_path / "async"
    run_train(configs["sync3"], sync_run, ranks=2)
    done = run_train(configs["async3"], async_run, ranks=2, timeout=300)
    written = async_run / checkpoint_dirs.CHECKPOINTS_DIR / checkpoint_dirs.step_tag(4)
    assert f"saved checkpoint {written} (written in the background" in done.stdout
    output = done.stdout + done.stderr
    failures = [line for line in output.splitlines() if "checkpoint at step 2 failed" in line]
    assert len(failures) == 1 and "failed on 1 rank(s)" in failures[0], output[-3000:]
    assert not (async_run / "checkpoints" / checkpoint_dirs.step_tag(2)).exists()
    assert train_losses(async_run) == train_losses(sync_run)
    tag = checkpoint_dirs.step_tag(4)
    assert_same_checkpoint(sync_run / "checkpoints" / tag, async_run / "checkpoints" / tag)


@pytest.mark.slow
def test_async_zero1_on_two_ranks_equals_sync(configs: dict[str, Path], tmp_path: Path) -> None:
    """ZeRO 1, 2 ranks (each rank's optimizer partition a file of its own): step 2's background checkpoint holds
    the synchronous run's files and tensors, and the losses are the same."""
    sync_run, async_run = tmp_path / "sync", tmp_path / "async"
    run_train(configs["sync1"], sync_run, ranks=2)
    done = run_train(configs["async1"], async_run, ranks=2)
    tag = checkpoint_dirs.step_tag(2)
    assert f"saved checkpoint {async_run / checkpoint_dirs.CHECKPOINTS_DIR / tag} (written in the background" in done.stdout
    assert train_losses(async_run) == train_losses(sync_run)
    assert_same_checkpoint(sync_run / "checkpoints" / tag, async_run / "checkpoints" / tag)


def test_the_benchmark_reads_each_saves_stall_and_the_steps_a_write_overlaps() -> None:
    from megatron_lite.bench.checkpoint_bench import parse_run

    output = "\n".join([
        "step 1/5 | loss 9.0", "step 2/5 | loss 8.0", "step 3/5 | loss 7.0", "step 4/5 | loss 6.0",
        "waited 1.50 s for the checkpoint at step 2 to finish writing",
        "saved checkpoint /run/checkpoints/step_00000002 (written in the background; the step loop waited 0.20 s "
        "for its snapshot and 0.10 s to complete it)",
        "step 5/5 | loss 5.0", "saved checkpoint /run/checkpoints/step_00000005 (the step loop waited 3.00 s)",
        "waited 2.00 s for the checkpoint at step 5 to finish writing"])  # the run's end: no step held
    rows = [{"step": step, "tokens_per_sec": 64 / seconds} for step, seconds in ((1, 9.0), (2, 1.0), (3, 2.0),
                                                                                 (4, 4.0), (5, 1.0))]
    result = parse_run(output, rows, 64, "async", 10.0)
    assert result.blocked_s == pytest.approx([1.8, 3.0]) and result.saves == 2 and result.end_wait_s == 2.0
    assert result.later_blocked_median_s == 3.0
    # steps 3 and 4 ran while step 2's checkpoint was written; 5 did not; 1 and 2 come before the first save
    assert result.step_s_overlapping == 3.0 and result.step_s_quiet == 1.0
