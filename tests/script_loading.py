"""Import a script that is not part of the package (tools/*.py, docker/*.py) so tests can call its main()."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def load_script(relative_path: str) -> ModuleType:
    """The module at REPO/relative_path, imported with its directory first on sys.path, as `python script.py` has."""
    path = REPO / relative_path
    spec = importlib.util.spec_from_file_location(f"{path.stem}_script", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module
