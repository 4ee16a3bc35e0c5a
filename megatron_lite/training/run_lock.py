"""One run per run directory: rank 0 holds ``<run-dir>/run.lock`` for the whole run.

The lock file is created atomically and whole (written to a private temp file, then ``os.link``ed to
its name, which fails if the name exists: the classic NFS-safe way, where ``flock`` may not work, and
no reader ever sees it half-written) and holds JSON naming its holder: host, pid, start time,
heartbeat period and a run id. A thread refreshes its mtime every heartbeat period
(``RUN_LOCK_HEARTBEAT_ENV`` seconds, default 30). A second run on the
directory stops with one line naming the holder, unless the holder is gone: its pid is dead (same
host), or its heartbeat is older than ``STALE_HEARTBEATS`` periods (another host: 120 s by default).
Such a lock is taken over with a notice, race-safe: under a guard file (made the same way) the taker
checks that the lock is still the one judged stale before replacing it by its own.

``python -m megatron_lite.training.run_lock RUN_DIR`` waits until the run in RUN_DIR has ended (its lock
released, or its holder gone), says how it ended and exits with the code train.py gives for that ending as one
process: what a job script reads after a signal, on which the ``deepspeed`` launcher returns at once, before
its ranks have saved (docs/training.md, "Stopping and exit codes").
``python -m megatron_lite.training.run_lock --run-dir-of TRAIN_ARGS...`` prints the run dir train.py uses with
those arguments (its ``--run-dir``, else ``runs/<config name>``): how a job script finds the directory to wait on.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_lite.cli import cli_main, run_cli, seconds_from_env
from megatron_lite.console import notice
from megatron_lite.processes import pid_alive

LOCK_FILE = "run.lock"
RUN_LOCK_HEARTBEAT_ENV = "MEGATRON_LITE_RUN_LOCK_HEARTBEAT_SECONDS"
DEFAULT_HEARTBEAT_SECONDS = 30.0
STALE_HEARTBEATS = 4  # a holder whose lock went this many periods without a heartbeat is gone
POLL_SECONDS = 1.0  # how often --wait-for-lock looks again
GUARD_STALE_SECONDS = 10.0  # a takeover takes milliseconds: a guard this old was left by a killed taker
EXIT_NO_ENDING = 1  # the run wrote no closing metrics row: killed (SIGKILL, or a crash) or never started training


class RunDirLocked(ValueError):
    """Another live run holds the run directory (a user error: one ``error:`` line)."""


@dataclass(frozen=True)
class LockHolder:
    host: str
    pid: int
    start: float  # time.time() when it took the lock
    heartbeat_seconds: float
    run_id: str
    age: float  # seconds since its last heartbeat (the file's mtime)

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.start))
        return (f"train.py pid {self.pid} on {self.host}, started {started}, last heartbeat {self.age:.0f} s ago")

    def gone_because(self, host: str) -> str | None:
        """Why the holder no longer runs (a dead pid on this host, a stale heartbeat elsewhere), else None."""
        if self.host == host:
            return None if pid_alive(self.pid) else f"its process {self.pid} is gone"
        if self.age > STALE_HEARTBEATS * self.heartbeat_seconds:
            return f"no heartbeat for {self.age:.0f} s"
        return None


def live_run_holds(run_dir: Path) -> bool:
    """Whether a live run holds ``run_dir``'s lock (and so may be writing a step dir there right now)."""
    holder = read_holder(run_dir / LOCK_FILE)
    return holder is not None and holder.gone_because(socket.gethostname()) is None


def heartbeat_seconds() -> float:
    return seconds_from_env(RUN_LOCK_HEARTBEAT_ENV, DEFAULT_HEARTBEAT_SECONDS)


def read_holder(path: Path) -> LockHolder | None:
    """The lock's holder; None when there is no lock file (released meanwhile)."""
    try:
        text = path.read_text()
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        return None
    try:
        data: dict[str, Any] = json.loads(text)
        return LockHolder(str(data["host"]), int(data["pid"]), float(data["start"]),
                          float(data["heartbeat_seconds"]), str(data["run_id"]), time.time() - mtime)
    except (ValueError, KeyError, TypeError):  # not ours, or damaged: nobody can be shown to hold it
        return LockHolder("unknown host", -1, mtime, DEFAULT_HEARTBEAT_SECONDS, "", time.time() - mtime)


class RunLock:
    """The lock file ``path``, once taken: a heartbeat thread refreshes it until ``release``."""

    def __init__(self, path: Path, run_id: str, period: float) -> None:
        self.path, self.run_id, self.period = path, run_id, period
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()

    def owned(self) -> bool:
        holder = read_holder(self.path)
        return holder is not None and holder.run_id == self.run_id

    def _beat(self) -> None:
        warned = False
        while not self._done.wait(self.period):
            if self.owned():
                os.utime(self.path)
            elif not warned:  # another run took it over (we looked dead to it): say so once
                warned = True
                notice(f"lost the run lock {self.path}: another run took it over; this run and that one now "
                       "write to the same directory")

    def release(self) -> None:
        self._done.set()
        self._thread.join()
        if self.owned():
            self.path.unlink(missing_ok=True)


def _create(path: Path, run_id: str, period: float) -> bool:
    """Make the lock file, whole, if none exists: a private temp file linked to ``path`` (atomic on NFS too)."""
    temp = path.with_name(f".{path.name}.{run_id}")
    record = {"host": socket.gethostname(), "pid": os.getpid(), "start": time.time(), "heartbeat_seconds": period,
              "run_id": run_id}
    temp.write_text(json.dumps(record) + "\n")
    try:
        os.link(temp, path)
        return True
    except FileExistsError:
        return False
    except OSError:  # NFS may report a link that was made (a retried request): the link count tells
        return temp.stat().st_nlink == 2
    finally:
        temp.unlink(missing_ok=True)


def _take_over(path: Path, stale: LockHolder, run_id: str, period: float) -> bool:
    """Replace the stale lock by ours, one taker at a time (a guard file made like the lock): only a taker
    holding the guard removes a lock, and only the one judged stale, so of racing takers exactly one wins."""
    guard = path.with_name(f"{path.name}.takeover")
    if not _create(guard, run_id, period):
        guard_holder = read_holder(guard)
        if guard_holder is not None and guard_holder.age > GUARD_STALE_SECONDS:  # a taker killed mid-takeover
            guard.unlink(missing_ok=True)
        time.sleep(0.05)  # another taker is at it
        return False
    try:
        current = read_holder(path)
        if current is None or current.run_id != stale.run_id:  # released or replaced meanwhile
            return False
        path.unlink()
        return _create(path, run_id, period)
    finally:
        guard.unlink(missing_ok=True)


def acquire(run_dir: Path, wait_seconds: float = 0.0, period: float | None = None) -> RunLock:
    """Take ``run_dir``'s lock (making the directory); RunDirLocked naming the holder when a live run holds
    it past ``wait_seconds``. A gone holder's lock is taken over with a notice."""
    period = heartbeat_seconds() if period is None else period
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    run_id = uuid.uuid4().hex
    host = socket.gethostname()
    deadline = time.monotonic() + wait_seconds
    waiting = False
    while True:
        if _create(path, run_id, period):
            return RunLock(path, run_id, period)
        holder = read_holder(path)
        if holder is None:  # released just now
            continue
        reason = holder.gone_because(host)
        if reason is not None:
            if _take_over(path, holder, run_id, period):
                notice(f"taking over the run lock {path} of {holder.describe()}: {reason}")
                return RunLock(path, run_id, period)
            continue
        if time.monotonic() >= deadline:
            raise RunDirLocked(f"run dir {run_dir} is in use by {holder.describe()} ({path}); wait for it to end, "
                               "or pass --wait-for-lock SECONDS")
        if not waiting:
            waiting = True
            notice(f"waiting up to {wait_seconds:.0f} s for the run lock {path} held by {holder.describe()}")
        time.sleep(min(POLL_SECONDS, max(0.0, deadline - time.monotonic())))


@contextmanager
def hold_run_dir(run_dir: Path, is_main: bool, device: Any, wait_seconds: float = 0.0) -> Iterator[None]:
    """Rank 0 holds ``run_dir``'s lock for the body; every rank learns whether it got it, so a refused run
    stops on all ranks (rank 0 raising the one line naming the holder) instead of hanging the others."""
    from megatron_lite.training.distributed import all_reduce_sum

    lock: RunLock | None = None
    error: ValueError | None = None
    fresh = not run_dir.exists()  # made by the lock: a refused run leaves no empty run dir behind
    if is_main:
        try:
            lock = acquire(run_dir, wait_seconds)
        except ValueError as caught:
            error = caught
    with _sigterm_held() as held:
        refused = all_reduce_sum([0.0 if error is None else 1.0], device)[0]
        held.keep = bool(refused)
    if error is not None:
        raise error
    if refused:
        raise RunDirLocked(f"run dir {run_dir}: rank 0 could not take its lock (see its message)")
    try:
        yield
    except ValueError:
        if lock is not None and fresh:
            lock.release()
            lock = None
            _remove_if_empty(run_dir)
        raise
    finally:
        if lock is not None:
            lock.release()


class _HeldSigterm:
    keep = False  # True: the run is refused, every rank is on its way out with exit 2
    received = False


@contextmanager
def _sigterm_held() -> Iterator[_HeldSigterm]:
    """SIGTERM held from before the ranks learn whether the run is refused: a launcher (torchrun) terminates the
    other ranks as soon as one exits 2, and one still between the agreement and its exit would die of the signal
    instead of exiting 2 itself. Refused (``keep``): the signal stays held until the process exits; otherwise the
    previous handler comes back and a SIGTERM that arrived meanwhile is delivered to it."""
    held = _HeldSigterm()
    if threading.current_thread() is not threading.main_thread():
        yield held
        return

    def note(signum: int, frame: Any) -> None:
        held.received = True

    previous = signal.signal(signal.SIGTERM, note)
    try:
        yield held
    finally:
        if not held.keep:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)  # None: set from C
            if held.received:
                os.kill(os.getpid(), signal.SIGTERM)


def _remove_if_empty(directory: Path) -> None:
    try:
        directory.rmdir()
    except OSError:  # not empty (or gone): it holds what the run wrote
        pass


def wait_for_run_end(run_dir: Path, timeout: float) -> None:
    """Return once no live run holds ``run_dir``: its lock released, or its holder gone (a killed run's lock
    is taken over, with the notice naming it). Taken and given back at once; ValueError past ``timeout``."""
    if not timeout >= 0:
        raise ValueError(f"--timeout {timeout}: must be a number of seconds >= 0")
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir}: no such run dir")
    try:
        acquire(run_dir, timeout).release()
    except RunDirLocked:
        holder = read_holder(run_dir / LOCK_FILE)
        raise ValueError(f"{run_dir}: its run has not ended after {timeout:.0f} s (held by "
                         f"{holder.describe() if holder else 'a run that just ended'})") from None


@contextmanager
def _waiting_through_signals(run_dir: Path) -> Iterator[None]:
    """The wait outlives a scheduler's repeated SIGTERM (scancel after the time limit's warning, a step's every
    process signalled again): dying of it would end the job while the run's ranks still write the stop's
    checkpoint, and the scheduler would kill them mid-save. A SIGTERM is noted in one line; a second SIGINT
    (Ctrl-C twice at a terminal) interrupts."""
    said: set[str] = set()

    def note(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT and name in said:
            raise KeyboardInterrupt
        if name not in said:
            said.add(name)
            print(f"run_lock: {name} received; still waiting for the run in {run_dir} to finish its stop and save",
                  flush=True)

    previous = {signum: signal.signal(signum, note) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run_ending(run_dir: Path) -> tuple[str, int]:
    """How the ended run in ``run_dir`` stopped, from its last metrics.jsonl row, as one line naming the
    checkpoint a resume starts from; and train.py's exit code for that ending as one process (0, 3, 4, 130,
    143; ``EXIT_NO_ENDING`` without a closing row)."""
    from megatron_lite import checkpoint_dirs
    from megatron_lite.training.exit_codes import exit_code_for
    from megatron_lite.training.metrics import read_metrics

    path = run_dir / "metrics.jsonl"
    rows = read_metrics(path) if path.is_file() else []
    last = rows[-1] if rows else {}
    checkpoints = run_dir / checkpoint_dirs.CHECKPOINTS_DIR
    checkpoint = checkpoint_dirs.latest_complete(checkpoints)
    resume = f"--resume auto starts from {checkpoint or 'step 0 (no complete checkpoint)'}"
    newest = (checkpoint_dirs.step_dirs(checkpoints) or [None])[-1]
    if newest is not None and not checkpoint_dirs.is_complete(newest):  # never "saved" over a save cut short
        return (f"{run_dir}: ended with its newest checkpoint {newest} incomplete (its save was cut short: killed "
                f"mid-save); {resume}", EXIT_NO_ENDING)
    stopped_by = last.get("stopped_by")
    if stopped_by is None:
        return (f"{run_dir}: ended without a closing row in {path} (killed, or stopped before its first step); "
                f"{resume}", EXIT_NO_ENDING)
    name = last.get("signal")
    # "a signal on another rank" (rank 0 got none, e.g. another node's): SIGTERM's code
    known = name if name in signal.Signals.__members__ else "SIGTERM"
    code = exit_code_for(stopped_by, known if stopped_by == "signal" else None)
    how = (f"stopped by {name}" if stopped_by == "signal" else
           f"{stopped_by.replace('_', ' ')}{f' ({name})' if name else ''}") + f" at step {last.get('step')}"
    return f"{run_dir}: {how}; {resume}", code


def train_run_dir(train_args: list[str]) -> Path:
    """The run dir train.py uses with ``train_args`` (its own rule: ``--run-dir``, else runs/<config stem>)."""
    parser = argparse.ArgumentParser(prog="train.py", add_help=False)
    parser.add_argument("--config")
    parser.add_argument("--run-dir", type=Path)
    known, _ = parser.parse_known_args(train_args)
    if known.run_dir is not None:
        return known.run_dir
    if not known.config:
        raise ValueError(f"--run-dir-of {' '.join(train_args)}: train.py arguments without --config or --run-dir")
    return Path("runs") / Path(known.config).stem


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_lite.training.run_lock",
        description="Wait until the run in RUN_DIR has ended (its run.lock released, or its holder gone), print how "
                    "it ended and exit with the code train.py gives for that as one process: 0 completed or "
                    "train.exit_interval, 3 non-finite losses, 4 failed saves, 130/143 SIGINT/SIGTERM, 1 no closing "
                    "row (killed). On a signal the deepspeed launcher exits at once, before its ranks have saved: a "
                    "job script runs this next (docs/training.md, 'Stopping and exit codes').")
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", nargs="?")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                        help="give up (exit 2) if the run still holds its lock after SECONDS (default 600)")
    parser.add_argument("--free", action="store_true",
                        help="only wait (up to --timeout) until no live run holds RUN_DIR, then exit 0 (a missing "
                             "RUN_DIR is free); still held: exit 2 naming the holder. How a job script refuses a "
                             "run dir in use before it starts any rank")
    parser.add_argument("--run-dir-of", nargs=argparse.REMAINDER, metavar="TRAIN_ARGS",
                        help="print the run dir train.py uses with TRAIN_ARGS (everything after this flag) and exit")
    args = parser.parse_args(argv)
    if args.run_dir_of is not None:
        print(train_run_dir(args.run_dir_of), flush=True)
        return 0
    if args.run_dir is None:
        parser.error("RUN_DIR is required (or --run-dir-of TRAIN_ARGS)")
    if args.free:
        if args.run_dir.exists():
            wait_for_run_end(args.run_dir, args.timeout)
        return 0
    with _waiting_through_signals(args.run_dir):
        wait_for_run_end(args.run_dir, args.timeout)
    line, code = run_ending(args.run_dir)
    print(line, flush=True)
    return code


if __name__ == "__main__":
    run_cli(main)
