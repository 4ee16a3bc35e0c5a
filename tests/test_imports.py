"""The package's layering, read from the source with ``ast`` (function-level imports included):
nothing in config/, model/, data/, eval/, convert/ or weights.py reaches megatron_lite.training
through any chain of imports, and no module imports itself back through a cycle. ``from pkg import
submodule`` counts as depending on the submodule, ``from pkg import name`` on the package; reaching a
module also runs the ``__init__`` of every package above it, so that counts as reaching them too."""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "megatron_lite"
BELOW_TRAINING = ("config", "model", "data", "eval", "convert", "weights")  # under megatron_lite.


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


def is_training(module: str) -> bool:
    return module.split(".")[:2] == ["megatron_lite", "training"]


def training_chain(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """The shortest chain of imports from ``start`` to a module of megatron_lite.training (breadth first),
    or None. Besides its imports, a module leads to its parent packages, whose ``__init__`` runs on import."""
    previous: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        module = queue.popleft()
        if is_training(module):
            chain = [module]
            while (parent := previous[chain[-1]]) is not None:
                chain.append(parent)
            return chain[::-1]
        parents = {module.rsplit(".", depth)[0] for depth in range(1, module.count(".") + 1)}
        for target in sorted(graph[module] | parents):
            if target not in previous:
                previous[target] = module
                queue.append(target)
    return None


def upward_chains(graph: dict[str, set[str]]) -> list[str]:
    """'module -> ... -> megatron_lite.training.x' for every module below training that reaches it."""
    chains = (training_chain(graph, module) for module in sorted(graph)
              if module.split(".")[1:2] and module.split(".")[1] in BELOW_TRAINING)
    return [" -> ".join(chain) for chain in chains if chain is not None]


def test_lower_layers_never_reach_training() -> None:
    upward = upward_chains(import_graph())
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


@pytest.mark.parametrize(("files", "expected"), [
    # a function-level import in the lower module itself
    ({"data/x.py": "def f():\n    import megatron_lite.training.loop\n"},
     ["megatron_lite.data.x -> megatron_lite.training.loop"]),
    # through weights.py, whose own import of training sits in a function
    ({"data/x.py": "from megatron_lite import weights\n",
      "weights.py": "def load():\n    from megatron_lite.training.loop import run\n"},
     ["megatron_lite.data.x -> megatron_lite.weights -> megatron_lite.training.loop",
      "megatron_lite.weights -> megatron_lite.training.loop"]),
    # through the __init__ of a package above an imported module
    ({"data/x.py": "from megatron_lite.tools.y import f\n", "tools/__init__.py": "from megatron_lite.training import loop\n",
      "tools/y.py": "def f():\n    pass\n"},
     ["megatron_lite.data.x -> megatron_lite.tools.y -> megatron_lite.tools -> megatron_lite.training.loop"]),
    # training importing a lower layer is the right direction
    ({"data/x.py": "", "training/step.py": "from megatron_lite.data import x\n"}, []),
])
def test_upward_chain_is_detected(tmp_path: Path, files: dict[str, str], expected: list[str]) -> None:
    root = tmp_path / "megatron_lite"
    for relative, text in {"__init__.py": "", "training/__init__.py": "", "training/loop.py": "def run():\n    pass\n",
                           "data/__init__.py": "", **files}.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)
    assert upward_chains(import_graph(root)) == expected
