"""The built-in offline corpus: what every CPython installation carries (docs/design.md, Data).

* ``python_docs`` (English prose): the licence text of the installation, the pydoc topic pages
  (``pydoc_data.topics``), then one document per stdlib module holding its module, class and
  function docstrings, found by parsing the ``.py`` files with ``ast`` (nothing is imported, so
  no module code runs).
* ``python_code``: the standard library's ``.py`` sources, one document per file.

Both walk ``sysconfig.get_paths()["stdlib"]`` (or ``path`` when a source sets it) in sorted
order and skip ``site-packages``/``dist-packages`` (third-party code) and the test suites
(``test``, ``tests``, ``idle_test`` directories): the tests are ~60% of the stdlib bytes, highly
repetitive, and include deliberately malformed and non-UTF-8 files.
"""

from __future__ import annotations

import ast
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from megatron_lite.config import SourceConfig
from megatron_lite.data.records import NON_UTF8, UNPARSABLE, BadRecord, Record, make_record

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def python_files(root: Path) -> list[Path]:
    """Sorted ``.py`` files below ``root``, outside EXCLUDED_DIRS."""
    if not root.is_dir():
        raise ValueError(f"python sample corpus: directory {root} does not exist")
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in EXCLUDED_DIRS]  # prune: never walk site-packages
        files.extend(Path(directory, n) for n in names if n.endswith(".py"))
    return sorted(files)


def licence_files() -> list[Path]:
    """The installation's licence (LICENSE.txt sits in the stdlib dir on POSIX, the prefix on Windows)."""
    candidates = [stdlib_dir() / "LICENSE.txt", Path(sys.base_prefix) / "LICENSE.txt", Path(sys.base_prefix) / "LICENSE"]
    found: dict[Path, Path] = {}
    for path in candidates:
        if path.is_file():
            found.setdefault(path.resolve(), path)
    return list(found.values())


def _root(source: SourceConfig) -> Path:
    return Path(source.path) if source.path else stdlib_dir()


def input_files(source: SourceConfig) -> list[Path]:
    """Every file a built-in source reads (for the cache fingerprint)."""
    files = python_files(_root(source))
    return files + licence_files() if source.type == "python_docs" and not source.path else files


class _DocstringCollector(ast.NodeVisitor):
    """Module/class/function docstrings in source order, each under its qualified name."""

    def __init__(self, module: str) -> None:
        self.parts: list[str] = []
        self._names = [module]

    def visit_Module(self, node: ast.Module) -> None:
        self._add(node)
        self.generic_visit(node)

    def _visit_scope(self, node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._names.append(node.name)
        self._add(node)
        self.generic_visit(node)
        self._names.pop()

    visit_ClassDef = visit_FunctionDef = visit_AsyncFunctionDef = _visit_scope

    def _add(self, node: ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        doc = ast.get_docstring(node, clean=True)
        if doc and doc.strip():
            self.parts.append(f"{'.'.join(self._names)}\n\n{doc}")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def docstrings_document(source_text: str, module: str) -> str:
    """One module's docstrings joined by blank lines ('' when it has none); SyntaxError if unparsable."""
    collector = _DocstringCollector(module)
    collector.visit(ast.parse(source_text))
    return "\n\n".join(collector.parts)


def read_python_docs(source: SourceConfig, name: str) -> Iterator[Record]:
    """Licence text, pydoc topics, then per-module docstrings (modules without any yield nothing)."""
    root = _root(source)
    if not source.path:  # the installation's own prose, only for the default stdlib walk
        for path in licence_files():
            yield make_record(path.read_bytes(), str(path))
        try:
            from pydoc_data.topics import topics
        except ImportError:  # some distributions ship pydoc_data separately
            topics = {}
        for key in sorted(topics):
            yield make_record(topics[key], f"pydoc_data.topics[{key!r}]")
    for path in python_files(root):
        try:
            code = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as error:
            yield BadRecord(NON_UTF8, str(path), f"invalid UTF-8 at byte {error.start}")
            continue
        try:
            text = docstrings_document(code, module_name(path, root))
        except (SyntaxError, ValueError, RecursionError) as error:  # ValueError: null bytes
            yield BadRecord(UNPARSABLE, str(path), f"{type(error).__name__}: {error}")
            continue
        if text:
            yield make_record(text, f"{path} (docstrings)")


def read_python_code(source: SourceConfig, name: str) -> Iterator[Record]:
    """Standard-library sources, one document per ``.py`` file."""
    for path in python_files(_root(source)):
        yield make_record(path.read_bytes(), str(path))
