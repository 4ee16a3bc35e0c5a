#!/usr/bin/env python
"""Check that what is installed equals constraints.txt (run in the image build and by the tests).

    python docker/check_versions.py                 # core dependencies (the Docker image)
    python docker/check_versions.py --extras test   # core + test extra (CI)

Every distribution reached from pyproject's dependencies must be pinned in constraints.txt and
installed at exactly the pinned version (local labels such as +cu130 or +cpu ignored). The one
exception is what torch itself pulls in beyond the pins (the CUDA runtime wheels and triton of a
GPU build): the base image's tag fixes those, and CI's CPU torch has none of them.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import sys
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ModuleNotFoundError:  # a bare base image: the copy pip vendors
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_constraints import (  # noqa: E402
    CONSTRAINTS,
    load_pyproject,
    public_version,
    resolve_installed,
    top_level_requirements,
)

TORCH = "torch"


def read_pins(path: Path = CONSTRAINTS) -> dict[str, str]:
    """{canonical name: version} from a constraints file of `name==version` lines."""
    pins: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        requirement = Requirement(line)
        specifiers = list(requirement.specifier)
        if len(specifiers) != 1 or specifiers[0].operator != "==" or requirement.marker is not None:
            raise ValueError(f"{path}:{number}: expected NAME==VERSION, got {raw!r}")
        pins[canonicalize_name(requirement.name)] = specifiers[0].version
    return pins


def problems(extras: tuple[str, ...], constraints: Path = CONSTRAINTS) -> list[str]:
    pins = read_pins(constraints)
    pyproject = load_pyproject()
    project = canonicalize_name(pyproject["project"]["name"])
    requirements = top_level_requirements(pyproject, extras)
    installed = resolve_installed(requirements, leaves=frozenset({TORCH}))
    installed.pop(project, None)
    found = []
    for name, version in sorted(installed.items()):
        if name not in pins:
            found.append(f"{name} {version} is installed but not pinned in {constraints.name}")
        elif version != pins[name]:
            found.append(f"{name} {version} is installed but {constraints.name} pins {pins[name]}")
    if TORCH in installed:  # torch's own dependencies: pinned ones must match, the CUDA extras may be unpinned
        torch_requirements = [Requirement(line) for line in metadata.distribution(TORCH).requires or []]
        for name, version in sorted(resolve_installed(torch_requirements).items()):
            if name in pins and version != pins[name]:
                found.append(f"{name} {version} (required by torch) is installed but {constraints.name} pins {pins[name]}")
    return found


def torch_problems(constraints: Path = CONSTRAINTS) -> list[str]:
    """Only torch: the base image's build must carry the pinned version (checked before pip runs, which
    would otherwise replace it with the default CUDA build from PyPI)."""
    pin = read_pins(constraints)[TORCH]
    try:
        version = metadata.version(TORCH)
    except metadata.PackageNotFoundError:
        return [f"torch is not installed; {constraints.name} pins {pin}"]
    if public_version(version) != pin:
        return [f"torch {version} is installed but {constraints.name} pins {pin}: use a base image with torch {pin}"]
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--extras", nargs="*", default=[], help="pyproject extras that should be installed too")
    parser.add_argument("--constraints", type=Path, default=CONSTRAINTS)
    parser.add_argument("--torch-only", action="store_true", help="check only torch (the base image, before installing)")
    args = parser.parse_args(argv)
    found = torch_problems(args.constraints) if args.torch_only else problems(tuple(args.extras), args.constraints)
    for problem in found:
        print(f"version drift: {problem}", file=sys.stderr)
    if found:
        print("reinstall with -c constraints.txt, or regenerate it with python docker/make_constraints.py",
              file=sys.stderr)
        return 1
    checked = "torch" if args.torch_only else "every dependency"
    print(f"{checked}: installed version equals {args.constraints.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
