"""One builder at a time per data cache, and no rebuild under a run that reads it.

    <data.cache_dir>/.locks/build.lock           flock'd exclusively by the process checking or building the
                                                 cache (prepare_data); never written, so never rewritten
    <data.cache_dir>/.locks/builder.json         that process's record while it holds the lock
    <data.cache_dir>/.locks/users/<host>-<pid>.json   one per training run reading the cache, flock'd shared
                                                 until that process exits

A process that finds another building the cache waits with one line naming it, then finds the cache built (or
finishes what the other left). A build that would change the cache (retrain the tokenizer, rebuild a source) while
another live run reads it stops with one line naming that run instead: its memory-mapped shards and tokenizer
would change under it. Same settings change nothing, so runs that agree share one cache.

Why ``flock``: the kernel releases the lock of a process that dies (SIGKILL included), so a dead builder's lock is
taken over with no staleness rule, and a dead run stops counting as a reader; NFSv4 carries flock across clients.
Where the file system has no locks (Lustre mounted without ``-o flock``) the cache is built unlocked, as before,
after one notice.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_lite.cli import seconds_from_env
from megatron_lite.console import notice
from megatron_lite.data.manifest import manifest_path
from megatron_lite.processes import pid_alive

LOCKS_DIR = ".locks"
POLL_SECONDS = 0.5
# Test hook: seconds to sleep once the build lock of a fresh cache (no manifest yet) is held: a slow first build,
# which other ranks and other runs must wait for.
SLOW_BUILD_ENV = "MEGATRON_LITE_TEST_SLOW_DATA_BUILD_SECONDS"
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)  # a file system without flock
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)  # a cache mounted read-only: nobody here can change it

_HELD: set[Path] = set()  # caches whose build lock this process holds (a nested prepare must not wait on itself)
_READING: dict[Path, int] = {}  # cache -> this process's reader record, locked shared until the process exits


class CacheInUse(ValueError):
    """Another live run reads the cache this build would change (a user error: one ``error:`` line)."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lock: the process's record."""

    pid: int
    host: str
    command: str
    start: float

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.start))
        return f"PID {self.pid} on {self.host} ({self.command}, started {started})"

    def is_this_process(self) -> bool:
        return self.pid == os.getpid() and self.host == socket.gethostname()


def _own_record() -> bytes:
    command = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])[:200] if sys.argv and sys.argv[0] else "python"
    record = {"pid": os.getpid(), "host": socket.gethostname(), "command": command, "start": time.time()}
    return (json.dumps(record) + "\n").encode()


def _read_holder(path: Path) -> Holder | None:
    """The record in ``path``; None when there is none (released, or its holder not yet written) or unreadable."""
    try:
        data: dict[str, Any] = json.loads(path.read_bytes() or b"null") or {}
        return Holder(int(data["pid"]), str(data["host"]), str(data["command"]), float(data["start"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_record(fd: int) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, _own_record(), 0)


def _write_builder(path: Path) -> None:
    """Whole or not at all (a reader waiting on the lock reads it): a private file renamed into place."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_bytes(_own_record())
    os.replace(temporary, path)


def _try_lock(fd: int, mode: int) -> bool:
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


class CacheBuild:
    """The build lock of one cache, held: what may change it."""

    def __init__(self, cache_dir: Path, locked: bool) -> None:
        self.cache_dir, self.locked = cache_dir, locked

    def before_change(self, what: str) -> None:
        """Raise CacheInUse, naming the run, when another live run reads the cache that ``what`` would change."""
        users = live_readers(self.cache_dir) if self.locked else []
        if users:
            more = f" and {len(users) - 1} more run(s)" if len(users) > 1 else ""
            raise CacheInUse(f"data cache {self.cache_dir} is in use by {users[0].describe()}{more}, built with other "
                             f"settings; this run would {what} under it: wait for that run to end, or give this run "
                             "its own data.cache_dir")

    def keep_reading(self) -> None:
        """Count this process as a reader of the cache until it exits (registered under the build lock, so a
        build checking for readers never misses one)."""
        if self.locked:
            register_reader(self.cache_dir)


@contextmanager
def building(cache_dir: str | os.PathLike[str]) -> Iterator[CacheBuild]:
    """Hold the cache's build lock for the body; another process holding it is waited for, with one line naming
    it; a lock its dead holder left is taken over with a notice."""
    cache = Path(cache_dir)
    key = cache.resolve()
    if key in _HELD:  # a prepare inside a prepare of this process: the outer one holds the lock
        yield CacheBuild(cache, locked=True)
        return
    record = cache / LOCKS_DIR / "builder.json"
    fd = _open_lock(cache)
    if fd is None:  # read-only: a build would fail at its first write, naming the file
        yield CacheBuild(cache, locked=False)
        return
    try:
        if not _wait_for_lock(fd, record, cache):
            yield CacheBuild(cache, locked=False)
            return
        left = _read_holder(record)
        if left is not None and not left.is_this_process():  # a holder releases by removing its record
            gone = left.host == socket.gethostname() and not pid_alive(left.pid)
            notice(f"data cache {cache}: taking over the build lock of {left.describe()}: "
                   f"{'its process is gone' if gone else 'it stopped without releasing it'}; finishing its build")
        _write_builder(record)
        _HELD.add(key)
        try:
            if not manifest_path(cache).exists():
                time.sleep(seconds_from_env(SLOW_BUILD_ENV, 0.0))
            yield CacheBuild(cache, locked=True)
        finally:
            _HELD.discard(key)
            record.unlink(missing_ok=True)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _open_lock(cache: Path) -> int | None:
    """The build lock file, opened (made with its folder if need be); None where the cache is read-only."""
    locks = cache / LOCKS_DIR
    try:
        locks.mkdir(parents=True, exist_ok=True)
        return os.open(locks / "build.lock", os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as error:
        if error.errno in _READ_ONLY:
            return None
        raise


def _wait_for_lock(fd: int, path: Path, cache: Path) -> bool:
    """Take the lock, waiting for its holder (named once) as long as it takes; False, after a notice, where the
    file system has no locks."""
    try:
        _wait_until_locked(fd, path, cache)
    except OSError as error:
        if error.errno not in _NO_LOCKS:
            raise
        notice(f"data cache {cache}: its file system has no file locks ({error.strerror}); building it unlocked "
               "(start one run per cache until it is built)")
        return False
    return True


def _wait_until_locked(fd: int, path: Path, cache: Path) -> None:
    announced = False
    waited = 0.0
    while not _try_lock(fd, fcntl.LOCK_EX):
        holder = _read_holder(path)
        # a holder writes its record just after locking: name it once it is there (or after a few polls)
        if not announced and (holder is not None or waited >= 4 * POLL_SECONDS):
            announced = True
            who = holder.describe() if holder is not None else "another process"
            notice(f"waiting for {who} building {cache}")
        time.sleep(POLL_SECONDS)
        waited += POLL_SECONDS


def register_reader(cache_dir: str | os.PathLike[str]) -> None:
    """This process reads the cache until it exits: its record, locked shared (the kernel unlocks it at exit)."""
    cache = Path(cache_dir)
    key = cache.resolve()
    if key in _READING:
        return
    users = cache / LOCKS_DIR / "users"
    users.mkdir(parents=True, exist_ok=True)
    fd = os.open(users / f"{socket.gethostname()}-{os.getpid()}.json", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError:
        os.close(fd)
        raise
    _write_record(fd)
    _READING[key] = fd


def live_readers(cache_dir: str | os.PathLike[str]) -> list[Holder]:
    """The other processes reading the cache now; the records of ended ones are removed."""
    users = Path(cache_dir) / LOCKS_DIR / "users"
    found = []
    for path in sorted(users.glob("*.json")) if users.is_dir() else []:
        holder = _read_holder(path)
        if holder is not None and holder.is_this_process():
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            if _try_lock(fd, fcntl.LOCK_EX):  # nobody holds it shared: that run has ended
                path.unlink(missing_ok=True)
            elif holder is not None:
                found.append(holder)
        finally:
            os.close(fd)
    return found
