#!/usr/bin/env python
"""Fetch the wheels a bare, offline GPU node needs to run train.py (and the speedrun), pinned by constraints.txt.

    python tools/fetch_wheels.py --out wheels            # then copy wheels/ to the node beside the repository
    # on the node:
    python3 -m pip install --no-index --no-deps --target /tmp/site wheels/*.whl
    export PYTHONPATH=/tmp/site:$PWD

A bare node is assumed to hold Python, torch >= 2.11, numpy, pyyaml, sentencepiece, safetensors,
transformers, pyarrow and tqdm (docs/gpu_check.md). What train.py needs beyond that is DeepSpeed (a
pure-Python wheel built here with ``pip wheel --no-deps``) with its own requirements, opt_einsum, and torchao
(train.fp8's float8 training, the ``fp8`` extra); wandb, datasets, zstandard and matplotlib are imported only
by the features that use them. Binary
wheels are fetched for the node's Python and platform (``--python-version``, manylinux x86-64), so this
runs on any machine that reaches a package index. Prints every wheel and the total size.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from megatron_lite.cli import cli_main, run_cli

REPO_ROOT = Path(__file__).resolve().parents[1]
# DeepSpeed's requirements a bare node lacks (numpy, packaging, torch, tqdm are there), opt_einsum (the model) and
# torchao (train.fp8; pinned in constraints.txt to the version tested with the pinned torch).
BARE_NODE_PACKAGES = ("deepspeed", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "hjson",
                      "py-cpuinfo", "ninja", "msgpack", "psutil", "einops", "opt-einsum", "torchao")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux_2_12_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "manylinux_2_5_x86_64")


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned_versions(constraints: Path, names: tuple[str, ...]) -> dict[str, str]:
    """name -> version from a pip constraints file; ValueError naming the file and a package it lacks."""
    if not constraints.is_file():
        raise ValueError(f"--constraints {constraints}: no such file")
    pins: dict[str, str] = {}
    for line in constraints.read_text().splitlines():
        match = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*==\s*([^\s;#]+)", line)
        if match:
            pins[_normalise(match.group(1))] = match.group(2)
    missing = [name for name in names if _normalise(name) not in pins]
    if missing:
        raise ValueError(f"--constraints {constraints}: no pin for {', '.join(missing)}")
    return {name: pins[_normalise(name)] for name in names}


def fetch_commands(versions: dict[str, str], out: Path, python_version: str) -> list[list[str]]:
    """``pip wheel`` for DeepSpeed (it publishes only an sdist), one ``pip download`` for the rest."""
    pip = [sys.executable, "-m", "pip"]
    commands = [[*pip, "wheel", "--no-deps", "-q", "-w", str(out), f"deepspeed=={versions['deepspeed']}"]]
    download = [*pip, "download", "--no-deps", "-q", "--only-binary=:all:", "--python-version", python_version,
                "--implementation", "cp", "-d", str(out)]
    for platform in PLATFORMS:
        download += ["--platform", platform]
    commands.append(download + [f"{name}=={version}" for name, version in versions.items() if name != "deepspeed"])
    return commands


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the wheels")
    parser.add_argument("--python-version", default="3.12", help="the node's Python (binary wheels are for it)")
    parser.add_argument("--constraints", type=Path, default=REPO_ROOT / "constraints.txt",
                        help="pins (the versions CI tests)")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python_version):
        raise ValueError(f"--python-version {args.python_version!r}: expected MAJOR.MINOR such as 3.12")
    versions = pinned_versions(args.constraints, BARE_NODE_PACKAGES)
    args.out.mkdir(parents=True, exist_ok=True)
    for command in fetch_commands(versions, args.out, args.python_version):
        if subprocess.run(command).returncode != 0:
            raise ValueError(f"pip failed: {' '.join(command)} (is a package index reachable?)")
    wheels = sorted(args.out.glob("*.whl"))
    for wheel in wheels:
        print(f"{wheel.stat().st_size / 2**20:7.2f} MiB  {wheel.name}")
    total = sum(wheel.stat().st_size for wheel in wheels)
    print(f"{total / 2**20:7.2f} MiB  in all ({len(wheels)} wheels) in {args.out}")
    return 0


if __name__ == "__main__":
    run_cli(main)
