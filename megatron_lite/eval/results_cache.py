"""Per-(model, scaling, window) result files, so an interrupted evaluation resumes where it stopped.

Each entry is one JSON file under ``<out>/cache/<kind>/`` holding a fingerprint of everything the
number depends on (checkpoint files, documents, stride, seed, ...); a stale entry (different
fingerprint) is recomputed and overwritten.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_lite.files import json_sha256, write_text_atomic


def fingerprint(settings: dict[str, Any]) -> str:
    return json_sha256(settings, default=str)[:16]


def checkpoint_fingerprint(directory: Path) -> dict[str, Any]:
    """Names, sizes and modification times of the checkpoint's files (cheap; no hashing of weights)."""
    files = sorted(p for p in directory.iterdir() if p.is_file())
    return {"dir": str(directory.resolve()),
            "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]}


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name)


class ResultCache:
    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, kind: str, model: str, scaling: str, size: int) -> Path:
        return self.directory / kind / f"{_safe(model)}__{_safe(scaling)}__{size}.json"

    def get(self, kind: str, model: str, scaling: str, size: int, key: str) -> dict[str, Any] | None:
        path = self.path(kind, model, scaling, size)
        if not path.is_file():
            return None
        try:
            entry = json.loads(path.read_text())
        except json.JSONDecodeError:  # a file cut short by a crash: recompute
            return None
        return entry.get("result") if entry.get("fingerprint") == key else None

    def put(self, kind: str, model: str, scaling: str, size: int, key: str, result: dict[str, Any]) -> None:
        path = self.path(kind, model, scaling, size)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps({"fingerprint": key, "result": result}, indent=1))

    def get_or_compute(self, kind: str, model: str, scaling: str, size: int, key: str,
                       compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The cached result, or ``compute()``'s, stored before it is returned."""
        result = self.get(kind, model, scaling, size, key)
        if result is None:
            result = compute()
            self.put(kind, model, scaling, size, key, result)
        return result
