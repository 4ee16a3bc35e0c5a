"""Watching DeepSpeed's one-time JIT build of its CPU communication op for a stale lock.

``deepspeed.init_distributed`` builds (or loads) ``deepspeed_shm_comm`` through
``torch.utils.cpp_extension``, which guards the build directory with a ``lock`` file and makes every
other process sleep until it disappears. A builder killed mid-build (SIGKILL, OOM) leaves the file
behind, and the file holds no process id; but a live builder keeps it open, so ``/proc/*/fd`` tells
a running build on this host from a dead one. While start-up waits, a watcher thread names any such
lock file after ``LOCK_WARN_ENV`` seconds (default 60) and keeps naming it every as many seconds: as
stale (advising its deletion) only when no process on this host has it open. A lock held by this run's own
build is not named at all: the build is why the run waits, and it says when it finishes (a lock this process,
its parent or a child of this process holds, or under a launcher (LOCAL_RANK set) another rank of the launch).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from megatron_lite.cli import seconds_from_env
from megatron_lite.console import notice

LOCK_WARN_ENV = "MEGATRON_LITE_JIT_LOCK_WARN_SECONDS"
DEFAULT_WARN_SECONDS = 60.0


def extensions_root() -> Path:
    """Where torch.utils.cpp_extension builds JIT ops: ``TORCH_EXTENSIONS_DIR`` or its default root."""
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    if configured:
        return Path(configured)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def lock_files(root: Path) -> list[Path]:
    """``lock`` files of build directories: ``ROOT/<op>/lock`` (TORCH_EXTENSIONS_DIR) or
    ``ROOT/<python_accelerator>/<op>/lock`` (the default root)."""
    return sorted({*root.glob("*/lock"), *root.glob("*/*/lock")})


def processes_holding(path: Path) -> list[int]:
    """Pids of this host's processes with ``path`` open (those whose /proc/PID/fd this user may read)."""
    target = os.path.realpath(path)
    holders = []
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            if any(os.readlink(fd) == target for fd in fd_dir.iterdir()):
                holders.append(int(fd_dir.parent.name))
        except OSError:  # another user's process, or one that ended meanwhile
            continue
    return sorted(holders)


def parent_pid(pid: int) -> int | None:
    """``pid``'s parent from /proc/PID/stat (None when it ended or cannot be read)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # after the command name, which may hold spaces
    return int(fields[1]) if len(fields) > 1 else None


def own_build(pid: int) -> bool:
    """Whether the process ``pid`` is this run's own: this process, its parent, a child of this process, or under
    a launcher (LOCAL_RANK set) another child of the parent, a sibling rank building the op for the launch."""
    me, parent = os.getpid(), os.getppid()
    if pid in (me, parent):
        return True
    holder_parent = parent_pid(pid)
    return holder_parent == me or (holder_parent == parent and "LOCAL_RANK" in os.environ)


def _describe(lock: Path) -> str | None:
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:  # released meanwhile
        return None
    holders = processes_holding(lock)
    if holders and all(own_build(pid) for pid in holders):
        return None  # this run's own build: nothing to report
    holders = [pid for pid in holders if not own_build(pid)]
    if holders:
        return (f"waiting for the JIT build lock {lock} (age {age:.0f} s): held by the running build "
                f"(pid {', '.join(map(str, holders))}); it is released when that build finishes")
    return (f"waiting for the JIT build lock {lock} (age {age:.0f} s): no process on this host has it open, so a "
            "build killed before it finished left it behind; delete it if no build is running")


def warn_seconds() -> float:
    return seconds_from_env(LOCK_WARN_ENV, DEFAULT_WARN_SECONDS)


@contextmanager
def watch_jit_locks(seconds: float | None = None) -> Iterator[None]:
    """While the body runs: after ``seconds`` (and every ``seconds`` after), a notice per lock file."""
    period = warn_seconds() if seconds is None else seconds
    root = extensions_root()
    done = threading.Event()

    def watch() -> None:
        while not done.wait(period):
            for lock in lock_files(root):
                message = _describe(lock)
                if message is not None and not done.is_set():
                    notice(message)

    watcher = threading.Thread(target=watch, name="jit-lock-watcher", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
