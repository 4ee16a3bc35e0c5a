"""The install for a machine that already has its own torch.

Fast: constraints-no-torch.txt is what docker/make_constraints.py derives from constraints.txt (its pins
less torch and torch's own requirements), and the README and the at-scale guide document one command for it.
Slow: a fresh venv holding the oldest supported torch (pyproject's lower bound: a CUDA build from the package
index) follows that command exactly as the README writes it, keeps its torch, and runs the model tests.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from script_loading import load_script

REPO = Path(__file__).resolve().parents[1]
NO_TORCH = REPO / "constraints-no-torch.txt"
# the fast tier's tests of the GPT-NeoX model, its position schemes and loss head, run inside the venv (about 25 s
# on 2 CPU cores; the LLaMA blocks' tests were dropped from it to keep the suite within its budget)
MODEL_TESTS = ["tests/test_model.py", "tests/test_rope.py", "tests/test_position.py", "tests/test_fused_loss.py"]
PIP_TIMEOUT = 900  # s: the CUDA wheels are ~2.5 GB


def own_torch_command() -> str:
    """The README's install command for a machine with its own torch (the pip part of its line)."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    (line,) = [line for block in blocks for line in block.splitlines() if "constraints-no-torch.txt" in line]
    (pip,) = [part.strip() for part in line.split("&&") if part.strip().startswith("pip install")]
    return pip


def oldest_torch() -> str:
    """pyproject's lower bound on torch, as a version to install (``torch>=2.11`` -> ``2.11.0``)."""
    pyproject = load_script("docker/make_constraints.py").load_pyproject()
    (requirement,) = [Requirement(line) for line in pyproject["project"]["dependencies"]
                      if Requirement(line).name == "torch"]
    (bound,) = [spec.version for spec in requirement.specifier if spec.operator == ">="]
    return bound if bound.count(".") == 2 else f"{bound}.0"


def test_no_torch_constraints_are_generated_from_the_lock() -> None:
    make = load_script("docker/make_constraints.py")
    dropped = make.torch_closure()
    assert {"torch", "setuptools", "sympy"} <= dropped  # what a different torch release pins differently
    assert NO_TORCH.read_text() == make.without_torch((REPO / "constraints.txt").read_text(), dropped), \
        "constraints-no-torch.txt is stale: run python docker/make_constraints.py"
    pins = make.CONSTRAINTS.read_text().splitlines()
    kept = [line for line in NO_TORCH.read_text().splitlines() if not line.startswith("#")]
    assert not any(line.startswith("torch==") for line in kept)
    assert set(kept) < set(pins) and len(pins) - len(kept) >= len(dropped)


def test_the_documented_command_keeps_torch_and_is_in_the_guide() -> None:
    command = own_torch_command()
    assert "-c constraints-no-torch.txt" in command
    assert "constraints.txt" not in command.replace("constraints-no-torch.txt", ""), "torch==2.13.0 pinned"
    assert not re.search(r"\btorch[=<>]", command), "the command must not name a torch version"
    assert command in (REPO / "docs" / "run_at_scale.md").read_text(), "the guide shows another command"
    assert oldest_torch() != load_script("docker/check_versions.py").read_pins()["torch"], \
        "the venv test must start from another torch than the lock's"


def _run(command: list[str], cwd: Path, env: dict[str, str], timeout: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _index_offers(python: Path, version: str, env: dict[str, str]) -> tuple[bool, str]:
    """Whether pip's configured index lists torch ``version`` (False when it cannot be reached)."""
    result = _run([str(python), "-m", "pip", "index", "versions", "torch"], REPO, env, 180)
    listed = re.search(r"Available versions: (.*)", result.stdout)
    versions = {v.strip() for v in listed.group(1).split(",")} if listed else set()
    output = (result.stdout + result.stderr).strip()
    return version in versions, output.splitlines()[-1] if output else "pip printed nothing"


def _copy_checkout(destination: Path) -> None:
    """The checkout's files (tracked and new, not ignored), so the editable install writes nothing into it."""
    if shutil.which("git") and (REPO / ".git").exists():
        listed = _run(["git", "ls-files", "-co", "--exclude-standard", "-z"], REPO, dict(os.environ), 60)
        for name in filter(None, listed.stdout.split("\0")):
            source = REPO / name
            if source.is_file():
                (destination / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, destination / name)
    else:
        shutil.copytree(REPO, destination, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(".git", "runs", "cache", "wandb", "*.egg-info", "__pycache__"))


def _torch_version(python: Path, env: dict[str, str]) -> str:
    result = _run([str(python), "-c", "import torch; print(torch.__version__)"], REPO, env, 300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


@pytest.fixture
def venv(tmp_path: Path) -> Iterator[Path]:
    """A fresh venv, deleted afterwards: with torch's CUDA wheels it holds ~5 GB."""
    path = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=300)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow
def test_a_venv_with_another_torch_follows_the_documented_install(tmp_path: Path, venv: Path) -> None:
    """A fresh venv with torch 2.11.0 (a CUDA build on PyPI) installed first: the README's command for a
    machine with its own torch keeps it, and the model tests pass there (on CPU)."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PIP_REQUIRE_VIRTUALENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    python = venv / "bin" / "python"
    version = oldest_torch()
    offered, why = _index_offers(python, version, env)
    if not offered:
        pytest.skip(f"the package index does not offer torch {version} here (unreachable?): {why}")

    installed = _run([str(python), "-m", "pip", "install", "-q", f"torch=={version}"], tmp_path, env, PIP_TIMEOUT)
    assert installed.returncode == 0, installed.stderr[-3000:]
    before = _torch_version(python, env)
    assert before.split("+")[0] == version

    checkout = tmp_path / "checkout"
    _copy_checkout(checkout)
    command = shlex.split(own_torch_command())
    assert command[:2] == ["pip", "install"]
    result = _run([str(python), "-m", *command], checkout, env, PIP_TIMEOUT)
    assert result.returncode == 0, f"{own_torch_command()} failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    assert _torch_version(python, env) == before, "the documented install replaced the venv's torch"

    tests = _run([str(python), "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider", *MODEL_TESTS],
                 checkout, env, 900)
    assert tests.returncode == 0, tests.stdout[-4000:]
    assert re.search(r"\d+ passed", tests.stdout), tests.stdout[-2000:]
