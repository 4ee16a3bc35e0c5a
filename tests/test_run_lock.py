"""One run per run directory: the lock file rank 0 holds, its refusal naming the holder,
takeover of a dead holder's lock (also when several runs race for it), --wait-for-lock; end to end, two
train.py runs on one run dir (plain and 2 ranks). A SIGKILLed run's lock taken over by the next run:
tests/test_training_run.py. Arguments checked before DeepSpeed starts."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron_lite import checkpoint_dirs
from megatron_lite import config as config_lib
from megatron_lite.training.run_lock import (LOCK_FILE, RUN_LOCK_HEARTBEAT_ENV, RunDirLocked, _take_over, acquire,
                                             read_holder)
from training_helpers import REPO, metrics, run_train, tiny_train_config, train_command, write_config


def test_lock_is_created_refuses_a_second_run_naming_it_and_is_released(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    lock = acquire(run_dir, period=0.05)
    record = json.loads((run_dir / LOCK_FILE).read_text())
    assert record["pid"] == os.getpid() and record["run_id"] == lock.run_id
    first_mtime = (run_dir / LOCK_FILE).stat().st_mtime
    time.sleep(0.3)
    assert (run_dir / LOCK_FILE).stat().st_mtime > first_mtime  # the heartbeat
    with pytest.raises(RunDirLocked, match=rf"run dir {run_dir} is in use by train.py pid {os.getpid()} on "):
        acquire(run_dir)
    assert read_holder(run_dir / LOCK_FILE).run_id == lock.run_id  # the refused run changed nothing
    lock.release()
    assert not (run_dir / LOCK_FILE).exists()
    acquire(run_dir).release()


def _write_lock(path: Path, host: str, pid: int, age: float, period: float = 30.0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"host": host, "pid": pid, "start": time.time() - age, "heartbeat_seconds": period,
                                "run_id": "old"}))
    os.utime(path, (time.time() - age, time.time() - age))


def _dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_dead_holder_on_this_host_is_taken_over_with_a_notice(tmp_path: Path) -> None:
    import socket

    path = tmp_path / LOCK_FILE
    _write_lock(path, socket.gethostname(), _dead_pid(), age=1.0)  # a fresh heartbeat, but the process is gone
    with pytest.warns(UserWarning, match=r"taking over the run lock .* its process \d+ is gone"):
        lock = acquire(tmp_path)
    assert read_holder(path).run_id == lock.run_id
    lock.release()


def test_other_hosts_lock_is_taken_over_only_once_its_heartbeat_is_stale(tmp_path: Path) -> None:
    path = tmp_path / LOCK_FILE
    _write_lock(path, "node-elsewhere", 1, age=5.0, period=30.0)  # a live holder elsewhere: refused
    with pytest.raises(RunDirLocked, match="in use by train.py pid 1 on node-elsewhere"):
        acquire(tmp_path)
    _write_lock(path, "node-elsewhere", 1, age=200.0, period=30.0)  # 4 periods without a heartbeat
    with pytest.warns(UserWarning, match=r"node-elsewhere.*: no heartbeat for 200 s"):
        lock = acquire(tmp_path)
    assert read_holder(path).run_id == lock.run_id
    lock.release()


def test_wait_for_lock_succeeds_once_the_holder_releases(tmp_path: Path) -> None:
    holder = acquire(tmp_path)
    threading.Timer(0.5, holder.release).start()
    started = time.monotonic()
    with pytest.warns(UserWarning, match=r"waiting up to 20 s for the run lock"):
        lock = acquire(tmp_path, wait_seconds=20)
    assert 0.4 < time.monotonic() - started < 10
    assert read_holder(tmp_path / LOCK_FILE).run_id == lock.run_id
    lock.release()


def test_a_takeover_decided_on_an_outdated_view_leaves_the_winners_lock(tmp_path: Path) -> None:
    """The race a takeover must survive, made deterministic: a late taker judged the old lock stale, and
    another run has taken it over since."""
    path = tmp_path / LOCK_FILE
    _write_lock(path, "node-elsewhere", 1, age=500.0)
    outdated = read_holder(path)
    with pytest.warns(UserWarning, match="taking over the run lock"):
        winner = acquire(tmp_path)
    assert not _take_over(path, outdated, "late", 30.0)
    assert read_holder(path).run_id == winner.run_id
    winner.release()


def _race(run_dir: str, start: multiprocessing.synchronize.Event, done: multiprocessing.synchronize.Event,
          results: multiprocessing.Queue) -> None:
    import warnings

    warnings.simplefilter("ignore")
    start.wait()
    try:
        lock = acquire(Path(run_dir))
    except RunDirLocked:
        results.put(None)
        return
    results.put(lock.run_id)
    done.wait(30)  # stay alive (holding it) until every racer has tried
    lock.release()


def test_racing_takeovers_of_one_stale_lock_leave_exactly_one_winner(tmp_path: Path) -> None:
    context = multiprocessing.get_context("fork")
    for _ in range(3):
        _write_lock(tmp_path / LOCK_FILE, "node-elsewhere", 1, age=500.0)
        start, done, results = context.Event(), context.Event(), context.Queue()
        racers = [context.Process(target=_race, args=(str(tmp_path), start, done, results)) for _ in range(6)]
        for racer in racers:
            racer.start()
        start.set()
        outcomes = [results.get(timeout=30) for _ in racers]
        winners = [run_id for run_id in outcomes if run_id is not None]
        assert len(winners) == 1, outcomes
        assert read_holder(tmp_path / LOCK_FILE).run_id == winners[0]
        done.set()
        for racer in racers:
            racer.join(30)
        assert not (tmp_path / LOCK_FILE).exists()
        assert sorted(p.name for p in tmp_path.iterdir()) == []  # no temp or guard files left


def test_train_iters_is_checked_before_deepspeed_starts_or_a_directory_is_made(tmp_path: Path) -> None:
    started = time.perf_counter()
    result = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs/tiny/rope.yml"),
                             "--run-dir", str(tmp_path / "run"), "--train-iters", "-1"], cwd=REPO, text=True,
                            capture_output=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["error: --train-iters -1: must be positive"]
    assert not (tmp_path / "run").exists()
    assert time.perf_counter() - started < 60


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2], ids=["plain", "two_ranks"])
def test_a_second_run_on_a_run_dir_in_use_stops_and_the_first_is_intact(training_corpus, tmp_path: Path,
                                                                         ranks: int) -> None:
    """The first run trains until it is stopped (SIGTERM) after the second, with other settings, tried its run dir."""
    mix, cache = training_corpus
    common = {"train_iters": 5000, "eval_interval": 0, "save_interval": 0, "gradient_accumulation_steps": 1}
    first_config = write_config(tmp_path / "first.yml", tiny_train_config(mix, cache, **common))
    other_config = write_config(tmp_path / "other.yml", tiny_train_config(mix, cache, lr=1e-2, **common))
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1",
           RUN_LOCK_HEARTBEAT_ENV: "0.5"}
    first = subprocess.Popen(train_command(first_config, run_dir, ranks=ranks), cwd=REPO, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and not (run_dir / LOCK_FILE).is_file() and first.poll() is None:
            time.sleep(0.1)
        second = run_train(other_config, run_dir, ranks=ranks, check=False)
    finally:
        os.killpg(first.pid, signal.SIGTERM)  # what Ctrl-C / scancel do: every process of the job
        output, _ = first.communicate(timeout=180)
    assert second.returncode != 0
    # searched in the whole stream: under the launcher (python -u) rank 1's own line ("see rank 0's message")
    # may be written between the characters of rank 0's
    holder_named = f"error: run dir {run_dir} is in use by train.py pid {first.pid if ranks == 1 else ''}"
    assert holder_named in second.stderr, second.stderr[-2000:]
    assert "Traceback" not in second.stderr + second.stdout
    assert "stopped by SIGTERM" in output and "Traceback" not in output, output[-3000:]
    final = checkpoint_dirs.latest_complete(run_dir / checkpoint_dirs.CHECKPOINTS_DIR)
    step = checkpoint_dirs.read_complete_marker(final)["step"]
    rows = metrics(run_dir)
    assert [row["step"] for row in rows if row.get("loss") is not None] == list(range(1, step + 1))  # one per step
    assert rows[-1] == {"step": step, "stopped_by": "signal", "signal": "SIGTERM"}
    assert config_lib.load(run_dir / checkpoint_dirs.CONFIG_FILE).train.lr == 3e-3  # the first run's settings
    assert config_lib.load(final / checkpoint_dirs.CONFIG_FILE).train.lr == 3e-3
    assert not (run_dir / LOCK_FILE).exists()
