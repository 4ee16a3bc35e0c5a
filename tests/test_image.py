"""The training image, built and run for real (marked `image`; CI installs what it needs in .ci/run).

docker/build_local.py builds a CPU base (Debian bookworm by mmdebstrap or debootstrap, a venv, torch
from the CPU wheel pip installs here), then the project's Dockerfile on it, exactly as the CUDA image
builds (its version-lock check included). Inside the image, as its non-root user, with host directories bound at
/workspace/runs and /workspace/data: `train.py --help`, 20 steps of the tiny config on the offline
sample corpus, the checkpoint converted, and the lock check. A context whose constraints.txt pins
another torch must fail the build, naming torch.

Skipped where there is no container engine (a running Docker engine, or podman + buildah), no
mmdebstrap or debootstrap, or no root. Needs the network (Debian's mirror, PyPI). Slow the first time
(4-5 min here: downloads, DeepSpeed's JIT build of its CPU op); the bases and the build's layers stay
cached in the engine's storage, so a rerun skips the build (the training still takes 1-2 min).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from script_loading import load_script

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "docker" / "build_local.py"
TAG = "localhost/megatron_lite:test"
BUILD_TIMEOUT = 1500  # s; from scratch the build took 2.5-3.5 min here (numbers: docs/run_at_scale.md)
RUN_TIMEOUT = 600
UID = 1000  # the Dockerfile's default USER_UID

pytestmark = [pytest.mark.image, pytest.mark.slow]


def _docker_engine_runs() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


def _skip_reason() -> str | None:
    if not _docker_engine_runs() and not (shutil.which("podman") and shutil.which("buildah")):
        return "no container engine: a running Docker engine, or apt-get install podman buildah"
    if shutil.which("mmdebstrap") is None and shutil.which("debootstrap") is None:
        return "no mmdebstrap or debootstrap (the CPU base image): apt-get install mmdebstrap"
    if os.geteuid() != 0:
        return "building the debootstrap base and chroot-isolated builds need root"
    return None


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    return tmp_path_factory.mktemp("image")


def tool(*args: str, timeout: int = RUN_TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def torch_pin() -> str:
    return load_script("docker/check_versions.py").read_pins(REPO / "constraints.txt")["torch"]


@pytest.fixture(scope="module")
def torch_wheel(workdir: Path) -> Path:
    """The pinned CPU torch wheel, as pip resolves it here (from local disk where pip's find-links has it)."""
    given = os.environ.get("MEGATRON_LITE_TORCH_WHEEL")
    if given:
        return Path(given)
    dest = workdir / "wheels"
    # the base's Python (bookworm: 3.11), whatever runs the tests
    result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                             "--python-version", "3.11", "--implementation", "cp", "--platform",
                             "manylinux_2_28_x86_64", "-d", str(dest), f"torch=={torch_pin()}"],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"pip download torch failed:\n{result.stderr[-3000:]}"
    (wheel,) = dest.glob("torch-*.whl")
    return wheel


@pytest.fixture(scope="module")
def image(torch_wheel: Path, workdir: Path) -> str:
    result = tool("--torch-wheel", str(torch_wheel), "--tag", TAG, timeout=BUILD_TIMEOUT)
    (workdir / "build.log").write_text(result.stdout + result.stderr)  # for a look afterwards (step timings)
    assert result.returncode == 0, f"image build failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    # (the Dockerfile's lock check passed in the build, unless podman took that layer from its cache;
    # test_lock_check_in_the_image runs it in the result either way)
    return TAG


@pytest.fixture(scope="module")
def volumes(workdir: Path) -> dict[str, Path]:
    dirs = {name: workdir / name for name in ("runs", "data")}
    for path in dirs.values():
        path.mkdir()
        os.chown(path, UID, UID)  # what a user does with --build-arg USER_UID=$(id -u): the bind is theirs
    return dirs


def in_image(image: str, volumes: dict[str, Path], *command: str) -> subprocess.CompletedProcess:
    binds = [arg for name, path in volumes.items() for arg in ("-v", f"{path}:/workspace/{name}")]
    return tool("--no-build", "--tag", image, *binds, "--", *command)


def test_help_in_full(image: str, volumes: dict[str, Path]) -> None:
    result = in_image(image, volumes, "python", "train.py", "--help")
    assert result.returncode == 0, result.stderr[-3000:]
    here = subprocess.run([sys.executable, "train.py", "--help"], cwd=REPO, capture_output=True, text=True)
    words = lambda text: text.split()  # noqa: E731  (line wrapping may differ with the terminal width)
    assert words(result.stdout) == words(here.stdout), result.stdout


def test_lock_check_in_the_image(image: str, volumes: dict[str, Path]) -> None:
    result = in_image(image, volumes, "python", "docker/check_versions.py")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "every dependency: installed version equals constraints.txt" in result.stdout


@pytest.fixture(scope="module")
def trained(image: str, volumes: dict[str, Path]) -> Path:
    # The tiny config's data is the offline sample corpus built from the image's own Python (no download).
    result = in_image(image, volumes, "sh", "-ec",
                      "id -un; id -u; exec python train.py --config configs/tiny/coca_slack.yml --train-iters 20 "
                      "--run-dir /workspace/runs/tiny --resume none --set train.log_interval=1 "
                      "--set train.wandb.mode=disabled")
    assert result.returncode == 0, f"training in the image failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    user, uid = result.stdout.split()[:2]
    assert (user, int(uid)) == ("trainer", UID), "the image must train as its non-root user"
    return volumes["runs"] / "tiny"


def test_tiny_training_as_the_non_root_user(trained: Path, volumes: dict[str, Path]) -> None:
    rows = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    losses = {row["step"]: row["loss"] for row in rows if "loss" in row}
    assert sorted(losses) == list(range(1, 21)), sorted(losses)
    first, last = sum(losses[s] for s in range(1, 6)) / 5, sum(losses[s] for s in range(16, 21)) / 5
    assert last < first - 0.5, f"loss did not fall: {first:.3f} (steps 1-5) -> {last:.3f} (steps 16-20)"
    checkpoint = trained / "checkpoints" / "step_00000020"
    assert checkpoint.is_dir()
    # written through the binds by the image's user, not root
    assert checkpoint.stat().st_uid == UID
    assert (volumes["data"] / "cache" / "sample" / "tokenizer" / "tokenizer.model").stat().st_uid == UID


def test_convert_checkpoint_in_the_image(trained: Path, image: str, volumes: dict[str, Path]) -> None:
    result = in_image(image, volumes, "python", "tools/convert_checkpoint.py", "/workspace/runs/tiny",
                      "/workspace/runs/tiny_safetensors", "--to", "safetensors")
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    from safetensors.torch import load_file

    out = volumes["runs"] / "tiny_safetensors"
    weights = load_file(str(out / "model.safetensors"))
    assert sum(tensor.numel() for tensor in weights.values()) > 1_000_000
    assert (out / "config.yml").is_file() and (out / "tokenizer.model").is_file()


def test_a_context_with_another_pin_fails_the_build(image: str, torch_wheel: Path, workdir: Path) -> None:
    """Acceptance 2: constraints.txt pins a torch the base does not carry -> the build stops, naming it.

    (Any other pin is what pip installs; torch is the one the base image brings.) The bases and the
    layers before the COPY of constraints.txt come from the engine's cache, so this takes seconds.
    """
    context = workdir / "drift_context"
    context.mkdir()
    for name in ("Dockerfile", ".dockerignore", "pyproject.toml", "constraints.txt", "README.md", "train.py"):
        shutil.copy2(REPO / name, context / name)
    ignore = shutil.ignore_patterns("__pycache__", "cache", "out")
    for name in ("docker", "megatron_lite", "configs", "tools", "data"):
        shutil.copytree(REPO / name, context / name, ignore=ignore)
    constraints = context / "constraints.txt"
    pin = torch_pin()
    other = "2.12.0" if pin != "2.12.0" else "2.11.0"
    constraints.write_text(re.sub(rf"^torch=={re.escape(pin)}$", f"torch=={other}", constraints.read_text(),
                                  flags=re.M))
    assert f"torch=={other}" in constraints.read_text()
    result = tool("--torch-wheel", str(torch_wheel), "--context", str(context), "--tag",
                  "localhost/megatron_lite:drift", timeout=BUILD_TIMEOUT)
    output = result.stdout + result.stderr
    assert result.returncode != 0, "a build with a drifted pin must fail"
    assert re.search(rf"version drift: torch {re.escape(pin)}\S* is installed but constraints.txt pins {other}",
                     output), output[-4000:]
    assert "build_local: error: the image build failed" in output
