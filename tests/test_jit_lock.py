"""A stale lock left by a JIT build killed mid-way: train.py names it while it waits,
and goes on once it is deleted, instead of sleeping forever without a word; a lock a live build holds
open is reported as a wait, never as stale."""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from megatron_lite.training.jit_lock import LOCK_WARN_ENV, _describe, extensions_root, lock_files, processes_holding
from training_helpers import REPO, tiny_train_config, train_command, write_config

OP = "deepspeed_shm_comm"


def _built_op_dir() -> Path | None:
    root = extensions_root()
    found = sorted(root.glob(f"*/{OP}/*.so")) + sorted(root.glob(f"{OP}/*.so"))
    return found[0].parent if found else None


def test_a_lock_a_live_process_holds_open_is_a_wait_and_one_nobody_holds_is_stale(tmp_path: Path) -> None:
    lock = tmp_path / OP / "lock"
    lock.parent.mkdir()
    fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_RDWR)  # as torch's FileBaton takes it
    # a build still running in another run: a process neither ours nor our parent's (its shell exits at once)
    started = subprocess.run(["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], pass_fds=(fd,), check=True,
                             capture_output=True, text=True)
    builder = int(started.stdout)
    os.close(fd)
    try:
        assert processes_holding(lock) == [builder]
        message = _describe(lock)
        assert message is not None and f"held by the running build (pid {builder})" in message
        assert "delete" not in message
    finally:
        os.kill(builder, signal.SIGKILL)
        while processes_holding(lock):
            time.sleep(0.05)
    message = _describe(lock)  # its builder is gone: the lock is stale
    assert message is not None and "no process on this host has it open" in message
    assert message.endswith("delete it if no build is running")


@pytest.mark.slow  # an end-to-end run of train.py
def test_stale_jit_lock_is_named_while_waiting_and_deleting_it_lets_the_run_go_on(training_corpus,
                                                                                    tmp_path: Path) -> None:
    mix, cache = training_corpus
    extensions = tmp_path / "torch_extensions"
    built = _built_op_dir()
    if built is not None:  # a copy of the built op: no 40 s rebuild once the lock is gone
        shutil.copytree(built, extensions / OP)
    lock = extensions / OP / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()  # what a builder killed by SIGKILL leaves: torch's FileBaton, no process id in it
    assert lock_files(extensions) == [lock]
    config = write_config(tmp_path / "config.yml", tiny_train_config(mix, cache, save_interval=0, eval_interval=0))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1",
           "TORCH_EXTENSIONS_DIR": str(extensions), LOCK_WARN_ENV: "1"}
    process = subprocess.Popen(train_command(config, tmp_path / "run", "--train-iters", "1"), cwd=REPO, env=env,
                               text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    output: list[str] = []
    try:
        deadline = time.time() + 120
        while time.time() < deadline and sum("JIT build lock" in line for line in output) < 2:  # and again later
            try:
                output.append(lines.get(timeout=1))
            except queue.Empty:
                assert process.poll() is None, "".join(output)[-3000:]
        warnings = [line for line in output if "JIT build lock" in line]
        assert len(warnings) >= 2, "".join(output)[-3000:]
        assert warnings[0].startswith(f"warning: waiting for the JIT build lock {lock} (age ")
        assert warnings[0].rstrip().endswith("delete it if no build is running")
        lock.unlink()  # the advice: no build is running
        process.wait(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    time.sleep(0.2)  # the reader thread drains what is left
    while not lines.empty():
        output.append(lines.get())
    text = "".join(output)
    assert process.returncode == 0, text[-3000:]
    assert "Traceback" not in text
