"""Writing files atomically with the umask's permissions, and hashing files and JSON values.

An atomic write goes to a hidden temporary file beside the target and is renamed over it, so a
reader (or a crash) sees the old file or the new one, never a part. Every file is created with
``0o666 & ~umask`` (0644 under the usual 022): caches are shared by ranks, users and container UIDs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

StrPath = str | os.PathLike[str]


def current_umask() -> int:
    """The process umask, read without changing it where Linux reports it (``os.umask`` can only set it)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode ``open()`` gives a new file: 0o666 minus the umask."""
    return 0o666 & ~current_umask()


def apply_umask(path: StrPath) -> None:
    """Give ``path`` the mode a new file gets, for writers that create 0600 files (mkstemp, safetensors)."""
    os.chmod(path, file_mode())


def temporary_sibling(path: StrPath) -> Path:
    """A unique hidden name in ``path``'s directory (same file system, so ``os.replace`` is atomic)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


@contextmanager
def atomic_output(path: StrPath) -> Iterator[BinaryIO]:
    """A new binary file that replaces ``path`` when the block ends; removed if the block raises."""
    temporary = temporary_sibling(path)
    try:
        with open(temporary, "xb") as handle:  # open() applies the umask, unlike mkstemp (0600)
            yield handle
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_bytes_atomic(path: StrPath, data: bytes) -> None:
    with atomic_output(path) as handle:
        handle.write(data)


def write_text_atomic(path: StrPath, text: str) -> None:
    write_bytes_atomic(path, text.encode())


def write_json_atomic(path: StrPath, value: Any, *, indent: int | None = None, sort_keys: bool = False) -> None:
    """``json.dumps(value, indent=indent, sort_keys=sort_keys)``, written atomically (no trailing newline)."""
    write_text_atomic(path, json.dumps(value, indent=indent, sort_keys=sort_keys))


def copy_file_atomic(source: StrPath, target: StrPath) -> None:
    """Copy the contents of ``source`` over ``target`` (the mode follows the umask, not ``source``)."""
    with atomic_output(target) as handle, open(source, "rb") as reader:
        shutil.copyfileobj(reader, handle)


def file_sha256(path: StrPath) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def json_sha256(value: Any, *, separators: tuple[str, str] | None = None,
                default: Callable[[Any], Any] | None = None) -> str:
    """Hex sha256 of ``json.dumps(value, sort_keys=True, ...)``: a key that does not depend on dict order.

    ``separators`` and ``default`` are passed to ``json.dumps``; keys already stored were made with
    a caller's choice, so each caller keeps its own.
    """
    canonical = json.dumps(value, sort_keys=True, separators=separators, default=default)
    return hashlib.sha256(canonical.encode()).hexdigest()
