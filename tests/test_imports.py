"""The package's layering, read from the source with ``ast`` (function-level imports included):
config/, model/, data/, eval/ and convert/ never import megatron_lite.training, and no module
imports itself back through a cycle. ``from pkg import submodule`` counts as depending on the
submodule, ``from pkg import name`` on the package."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "megatron_lite"
BELOW_TRAINING = ("config", "model", "data", "eval", "convert")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules(root: Path) -> dict[str, Path]:
    return {module_name(path, root): path for path in sorted(root.rglob("*.py"))}


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every megatron_lite module that ``name`` imports anywhere in its file."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from . import x / from .mod import y
                base = package[: len(package) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.add(submodule if submodule in modules else source)
    return {module for module in found if module in modules and module != name}


def import_graph(root: Path = PACKAGE_ROOT) -> dict[str, set[str]]:
    modules = package_modules(root)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = lowlink[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = lowlink[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    lowlink[node] = min(lowlink[node], index[child])
                continue
            work.pop()
            if work:
                lowlink[work[-1][0]] = min(lowlink[work[-1][0]], lowlink[node])
            if lowlink[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """'module -> target' for every import of megatron_lite.training from a layer below it."""
    return sorted(f"{module} -> {target}" for module, targets in graph.items() for target in targets
                  if module.split(".")[1:2] and module.split(".")[1] in BELOW_TRAINING
                  and target.split(".")[:2] == ["megatron_lite", "training"])


def test_lower_layers_never_import_training() -> None:
    upward = upward_imports(import_graph())
    assert not upward, "layering broken: " + "; ".join(upward)


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(component) for component in found)


@pytest.mark.parametrize(("files", "expected"), [
    # a function-level import closing a loop still counts
    ({"a.py": "from megatron_lite import b\n", "b.py": "def f():\n    from megatron_lite.a import x\n"},
     [["megatron_lite.a", "megatron_lite.b"]]),
    # a package importing its submodule and the submodule importing a sibling: no cycle
    ({"pkg/__init__.py": "from megatron_lite.pkg.one import x\n", "pkg/one.py": "from megatron_lite.pkg import two\n",
      "pkg/two.py": "y = 1\n"}, []),
    # a submodule importing a name from its own package __init__, which imports the submodule
    ({"pkg/__init__.py": "from .one import x\n", "pkg/one.py": "from megatron_lite.pkg import helper\n"},
     [["megatron_lite.pkg", "megatron_lite.pkg.one"]]),
])
def test_cycle_finder_sees_function_level_and_relative_imports(
    tmp_path: Path, files: dict[str, str], expected: list[list[str]]
) -> None:
    root = tmp_path / "megatron_lite"
    for relative, text in {"__init__.py": "", **files}.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)
    assert cycles(import_graph(root)) == expected


def test_upward_import_is_detected(tmp_path: Path) -> None:
    root = tmp_path / "megatron_lite"
    for relative, text in {"__init__.py": "", "training/__init__.py": "", "training/loop.py": "",
                           "data/__init__.py": "", "data/x.py": "def f():\n    import megatron_lite.training.loop\n"}.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)
    assert upward_imports(import_graph(root)) == ["megatron_lite.data.x -> megatron_lite.training.loop"]
