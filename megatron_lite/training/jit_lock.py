"""DeepSpeed's one-time JIT build of its CPU communication op: said before it starts, quiet once cached, and
watched for a stale lock.

``deepspeed.init_distributed`` builds (or loads) ``deepspeed_shm_comm`` through
``torch.utils.cpp_extension``: a build (40 s to 2 minutes of compiling, when its build directory holds no
library yet: the first start on a machine, or in a new ``TORCH_EXTENSIONS_DIR``) is announced in one line on
rank 0 first, naming where it is cached; a load from that cache says nothing (DeepSpeed prints "... built
successfully" on each rank either way, dropped then; a rebuild torch decides on by itself, for sources changed
by an upgrade, goes unannounced). The build guards the build directory with a ``lock`` file and makes every
other process sleep until it disappears. A builder killed mid-build (SIGKILL, OOM) leaves the file
behind, and the file holds no process id; but a live builder keeps it open, so ``/proc/*/fd`` tells
a running build on this host from a dead one. While start-up waits, a watcher thread names any such
lock file after ``LOCK_WARN_ENV`` seconds (default 60) and keeps naming it every as many seconds: as
stale (advising its deletion) only when no process on this host has it open. A lock held by this run's own
build is not named at all: the build is why the run waits, and it says when it finishes (a lock this process,
its parent or a child of this process holds, or under a launcher (LOCAL_RANK set) another rank of the launch).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from megatron_lite.cli import seconds_from_env
from megatron_lite.console import console, is_main_rank, notice, stdout_without

LOCK_WARN_ENV = "MEGATRON_LITE_JIT_LOCK_WARN_SECONDS"
DEFAULT_WARN_SECONDS = 60.0
BUILT_LINE = r"DeepSpeed \S+ built successfully$"  # deepspeed/comm/torch.py prints it after every load of the op


def extensions_root() -> Path:
    """Where torch.utils.cpp_extension builds JIT ops: ``TORCH_EXTENSIONS_DIR`` or its default root."""
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    if configured:
        return Path(configured)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def build_directory(name: str) -> Path:
    """Where torch.utils.cpp_extension builds and caches the JIT op ``name`` (as its ``_get_build_directory``,
    without creating it): ``TORCH_EXTENSIONS_DIR/<name>``, or ``<default root>/py<version>_<accelerator>/<name>``."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return extensions_root() / name
    import torch

    accelerator = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip is not None
                   else f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda is not None else "cpu")
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return extensions_root() / f"{python}_{accelerator}" / name


def comm_op_to_build() -> Path | None:
    """The build directory of DeepSpeed's CPU communication op when ``deepspeed.init_distributed`` is about to
    JIT-build it (the CPU accelerator, the op compatible, not pre-installed, no built library cached there);
    None when it only loads, or builds nothing."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")  # None on CUDA: NCCL needs no op
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False) \
            or installed_ops.get(builder.NAME, False):
        return None
    directory = build_directory(builder.NAME)
    return None if (directory / f"{builder.NAME}.so").is_file() else directory


def build_notice(directory: Path) -> str:
    return (f"building DeepSpeed's CPU communication op ({directory.name}) once for this machine, DeepSpeed and "
            f"torch: 40 s to 2 minutes of compiling, then cached in {directory}")


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
    """Around ``deepspeed.init_distributed``: the build notice first when the CPU communication op is to be built
    (rank 0), DeepSpeed's "built successfully" line dropped when it is only loaded; while the body runs, after
    ``seconds`` (and every ``seconds`` after), a notice per lock file."""
    to_build = comm_op_to_build()
    if to_build is not None and is_main_rank():
        console(build_notice(to_build))
    with contextlib.ExitStack() as stack:
        if to_build is None:
            stack.enter_context(stdout_without(BUILT_LINE))
        stack.enter_context(_watching(seconds))
        yield


@contextmanager
def _watching(seconds: float | None) -> Iterator[None]:
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
