#!/usr/bin/env python3
"""Build the training image without Docker Hub (a CPU base from Debian), and run commands inside it.

    python docker/build_local.py --torch-wheel torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
    python docker/build_local.py --base IMAGE                    # any base you have (torch in it or --torch-wheel)
    python docker/build_local.py --no-build -v $PWD/runs:/workspace/runs -- python train.py --help

Steps: (1) the base: `debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,python3-dev
bookworm` (or mmdebstrap, the same and faster, when installed) imported as an image, with a venv at
/opt/venv first on PATH (`python` and `pip`, as in the official images; python3-dev for DeepSpeed's
JIT-built ops), or the image named by --base; (2) torch from --torch-wheel installed into that base when given
(the CUDA base image carries torch; a plain Python base does not); (3) the project's Dockerfile on it with
--build-arg BASE_IMAGE=<that base>, so the image build itself (its version-lock check included) is the
one the CUDA image goes through. A running Docker engine builds with `docker build`; without one,
podman (`podman build --isolation chroot`) builds and `buildah run --isolation chroot` runs commands
(`podman run` needs rlimits that unprivileged sandboxes refuse).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TAG = "megatron_lite"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
DEFAULT_SUITE = "bookworm"
BASE_PACKAGES = "python3,python3-venv,python3-pip,python3-dev"  # -dev: Python.h, DeepSpeed JIT-builds ops
VENV = "/opt/venv"
PATH_ENV = f"PATH={VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class BuildError(Exception):
    """A one-line error for the user (bad input, a missing tool, a failed step)."""


def log(message: str) -> None:
    print(f"build_local: {message}", file=sys.stderr, flush=True)


def _run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
    log("$ " + shlex.join(argv))
    return subprocess.run(argv, **kwargs)


def _check(argv: list[str], what: str, **kwargs: Any) -> subprocess.CompletedProcess:
    result = _run(argv, **kwargs)
    if result.returncode != 0:
        raise BuildError(f"{what} failed (exit {result.returncode}): {shlex.join(argv[:3])} ...")
    return result


@dataclass
class Engine:
    """docker (a running engine) or podman + buildah."""

    name: str

    def has_image(self, image: str) -> bool:
        if self.name == "docker":
            command = ["docker", "image", "inspect", image]
        else:
            command = ["podman", "image", "exists", image]
        return subprocess.run(command, capture_output=True).returncode == 0

    def import_rootfs(self, rootfs: Path, tag: str) -> None:
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
        _check([self.name, "import", "--change", f"ENV {PATH_ENV}", "-", tag], "importing the base", stdin=tar.stdout,
               stdout=subprocess.DEVNULL)
        tar.stdout.close()  # type: ignore[union-attr]
        if tar.wait() != 0:
            raise BuildError(f"tar of {rootfs} failed")

    def derive(self, image: str, tag: str, script: str, binds: list[str], env: dict[str, str]) -> None:
        """Run a shell script in a container of `image` as root and commit the result as `tag` (one layer),
        with `env` added to the image's environment."""
        if self.name == "docker":
            name = f"build_local_{os.getpid()}"
            mounts = [arg for bind in binds for arg in ("-v", bind)]
            try:
                _check(["docker", "run", "--name", name, "--user", "0", *mounts, image, "sh", "-ec", script],
                       "the base step")
                changes = [arg for key, value in env.items() for arg in ("--change", f"ENV {key}={value}")]
                _check(["docker", "commit", *changes, name, tag], "committing the base", stdout=subprocess.DEVNULL)
            finally:
                subprocess.run(["docker", "rm", "-f", name], capture_output=True)
            return
        container = self._from(image)
        try:
            mounts = [arg for bind in binds for arg in ("-v", bind)]
            _check(["buildah", "run", "--isolation", "chroot", "--user", "0:0", *mounts, container, "--",
                    "sh", "-ec", script], "the base step")
            for key, value in env.items():
                _check(["buildah", "config", "--env", f"{key}={value}", container], "configuring the base")
            _check(["buildah", "commit", "--quiet", container, tag], "committing the base", stdout=subprocess.DEVNULL)
        finally:
            self._rm(container)

    def build(self, context: Path, tag: str, build_args: dict[str, str]) -> None:
        args = [arg for name, value in build_args.items() for arg in ("--build-arg", f"{name}={value}")]
        if self.name == "docker":
            command = ["docker", "build", "-t", tag, *args, "-f", str(context / "Dockerfile"), str(context)]
        else:  # --layers: cache steps like docker does, so a rebuild after a source change starts at its COPY
            # --format docker: the OCI format drops SHELL, and the Dockerfile's RUNs rely on bash -o pipefail
            command = ["podman", "build", "--isolation", "chroot", "--layers", "--pull=never", "--format", "docker",
                       "-t", tag, *args, "-f", str(context / "Dockerfile"), str(context)]
        _check(command, "the image build")

    def run(self, image: str, command: list[str], binds: list[str], user: str | None) -> int:
        """Run `command` in a fresh container of `image` (its USER unless `user`); return its exit status."""
        mounts = [arg for bind in binds for arg in ("-v", bind)]
        who = ["--user", user] if user else []
        if self.name == "docker":
            return _run(["docker", "run", "--rm", *who, *mounts, image, *command]).returncode
        container = self._from(image)
        try:
            for bind in binds:  # else buildah mounts the image's VOLUME there too, in random order over the bind
                _check(["buildah", "config", "--volume", bind.split(":")[1] + "-", container], "configuring the run")
            argv = ["buildah", "run", "--isolation", "chroot", *who, *mounts, container, "--", *command]
            return _run(argv).returncode
        finally:
            self._rm(container)

    def _from(self, image: str) -> str:
        result = _check(["buildah", "from", "--pull-never", "--quiet", image], "creating a container",
                        capture_output=True, text=True)
        return result.stdout.strip().splitlines()[-1]

    @staticmethod
    def _rm(container: str) -> None:
        subprocess.run(["buildah", "rm", container], capture_output=True)


def pick_engine(choice: str) -> Engine:
    docker_up = False
    if shutil.which("docker") is not None:  # a client alone is not an engine: ask it for the daemon
        try:
            docker_up = subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0
        except subprocess.TimeoutExpired:
            pass
    podman_ok = shutil.which("podman") is not None and shutil.which("buildah") is not None
    if choice == "docker" or (choice == "auto" and docker_up):
        if not docker_up:
            raise BuildError("--engine docker: no running Docker engine (docker info failed)")
        return Engine("docker")
    if not podman_ok:
        raise BuildError("no Docker engine and no podman + buildah: apt-get install podman buildah "
                         "(and mmdebstrap or debootstrap for the default base)")
    return Engine("podman")


BOOTSTRAPPERS = ("mmdebstrap", "debootstrap")


def pick_bootstrapper(choice: str) -> str:
    """mmdebstrap when installed (same minbase result, about twice as fast: parallel downloads, one apt
    run), else debootstrap."""
    candidates = BOOTSTRAPPERS if choice == "auto" else (choice,)
    for name in candidates:
        if shutil.which(name):
            return name
    raise BuildError(f"{' or '.join(candidates)} is not installed: apt-get install {candidates[-1]} "
                     "(or pass --base IMAGE)")


def debootstrap_base(engine: Engine, tag: str, suite: str, mirror: str, bootstrapper: str) -> None:
    tool = pick_bootstrapper(bootstrapper)
    if os.geteuid() != 0:
        raise BuildError(f"{tool} needs root (or pass --base IMAGE)")
    with tempfile.TemporaryDirectory(prefix="megatron_lite_rootfs_") as tmp:
        rootfs = Path(tmp) / "rootfs"
        started = time.monotonic()
        quiet = ["--quiet"] if tool == "mmdebstrap" else []
        _check([tool, *quiet, "--variant=minbase", f"--include={BASE_PACKAGES}", suite, str(rootfs), mirror],
               tool, stdout=subprocess.DEVNULL)
        # The venv gives the image `python` and `pip` on PATH and a pip that may install (Debian's own
        # Python is "externally managed"), as `python` and `pip` are in the official images.
        _check(["chroot", str(rootfs), "python3", "-m", "venv", VENV], "creating the venv")
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (rootfs / cache).glob("*"):
                if entry.is_file():
                    entry.unlink()
        engine.import_rootfs(rootfs, tag)
        log(f"base {tag}: {tool} {suite} + import in {time.monotonic() - started:.0f} s")


HOST_CA_DIR = Path("/usr/local/share/ca-certificates")  # where Debian/Ubuntu keep locally added CAs
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


def with_torch(engine: Engine, base: str, wheel: Path, tag: str) -> None:
    """`base` + torch from a local wheel (its dependencies from the index, as a base image would carry them).

    The CAs this host added (a TLS-inspecting proxy's, say) go in too, and pip is pointed at the system
    bundle: without them neither this pip nor the Dockerfile's could reach the index from here.
    """
    started = time.monotonic()
    host_cas = sorted(HOST_CA_DIR.glob("*.crt")) if HOST_CA_DIR.is_dir() else []
    binds = [f"{wheel.parent}:/wheels:ro"]
    script = ""
    env: dict[str, str] = {}
    if host_cas:
        binds.append(f"{HOST_CA_DIR}:/host-ca:ro")
        script = ("command -v update-ca-certificates > /dev/null "
                  "|| { echo 'the base has no update-ca-certificates (package ca-certificates)' >&2; exit 1; }; "
                  "mkdir -p /usr/local/share/ca-certificates && cp /host-ca/*.crt /usr/local/share/ca-certificates/ "
                  "&& update-ca-certificates > /dev/null && ")
        env = {"PIP_CERT": CA_BUNDLE, "REQUESTS_CA_BUNDLE": CA_BUNDLE}
        log(f"adding this host's CA certificates to the base: {', '.join(ca.name for ca in host_cas)}")
    script += "".join(f"export {name}={value}; " for name, value in env.items())
    script += (f"python -m pip install --no-cache-dir --disable-pip-version-check /wheels/{wheel.name} "
               f"&& python -c 'import torch; print(\"torch\", torch.__version__)'")
    engine.derive(base, tag, script, binds, env)
    log(f"base {tag}: torch from {wheel.name} in {time.monotonic() - started:.0f} s")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     epilog="Everything after `--` is run inside the image (after building it).")
    parser.add_argument("--engine", choices=("auto", "docker", "podman"), default="auto",
                        help="auto: docker when a Docker engine runs, else podman + buildah")
    parser.add_argument("--base", metavar="IMAGE", help="base image (default: build a Debian one with debootstrap)")
    parser.add_argument("--torch-wheel", type=Path, metavar="PATH",
                        help="torch wheel to install into a base that has no torch (pip download torch==PIN)")
    parser.add_argument("--bootstrapper", choices=("auto", *BOOTSTRAPPERS), default="auto",
                        help="what builds the Debian base (auto: mmdebstrap when installed, else debootstrap)")
    parser.add_argument("--suite", default=DEFAULT_SUITE, help="Debian release of the debootstrap base")
    parser.add_argument("--mirror", default=DEFAULT_MIRROR, help="Debian mirror of the debootstrap base")
    parser.add_argument("--rebuild-base", action="store_true", help="rebuild the base even if its tag exists")
    parser.add_argument("--tag", default=DEFAULT_TAG, help="tag of the built image")
    parser.add_argument("--context", type=Path, default=REPO, help="build context holding the Dockerfile")
    parser.add_argument("--build-arg", action="append", default=[], metavar="NAME=VALUE",
                        help="passed to the Dockerfile (BASE_IMAGE is set by this tool)")
    parser.add_argument("--no-build", action="store_true", help="only run the command in the existing --tag image")
    parser.add_argument("-v", "--volume", action="append", default=[], metavar="HOST:CONTAINER",
                        help="bind a host directory into the container when running the command")
    parser.add_argument("--user", help="run the command as this user (default: the image's USER)")
    args, rest = parser.parse_known_args(argv)
    if rest and rest[0] == "--":
        rest = rest[1:]
    elif rest:
        parser.error(f"unrecognized arguments: {shlex.join(rest)} (put the command to run after --)")
    args.command = rest
    return args


def validate(args: argparse.Namespace) -> None:
    if args.torch_wheel is not None:
        wheel = args.torch_wheel.expanduser().resolve()
        if not wheel.is_file():
            raise BuildError(f"--torch-wheel {args.torch_wheel}: no such file")
        if not (wheel.name.startswith("torch-") and wheel.suffix == ".whl"):
            raise BuildError(f"--torch-wheel {args.torch_wheel}: not a torch wheel (torch-*.whl)")
        args.torch_wheel = wheel
    if not (args.context / "Dockerfile").is_file():
        raise BuildError(f"--context {args.context}: no Dockerfile there")
    for item in args.build_arg:
        if "=" not in item:
            raise BuildError(f"--build-arg {item}: expected NAME=VALUE")
        if item.startswith("BASE_IMAGE="):
            raise BuildError("--build-arg BASE_IMAGE: use --base")
    for bind in args.volume:
        host, sep, container = bind.partition(":")
        if not sep or not container.startswith("/"):
            raise BuildError(f"-v {bind}: expected HOST_DIR:/CONTAINER_PATH")
        if not Path(host).exists():
            raise BuildError(f"-v {bind}: {host} does not exist")
    if args.no_build and not args.command:
        raise BuildError("--no-build: nothing to run (put the command after --)")
    if args.base is None and args.torch_wheel is None and not args.no_build:
        raise BuildError("the Debian base has no torch: pass --torch-wheel PATH (pip download --no-deps torch==PIN)")


def build(engine: Engine, args: argparse.Namespace) -> None:
    base = args.base
    if base is None:
        base = f"localhost/{args.tag.split('/')[-1].split(':')[0]}-base:{args.suite}"
        if args.rebuild_base or not engine.has_image(base):
            debootstrap_base(engine, base, args.suite, args.mirror, args.bootstrapper)
        else:
            log(f"reusing base {base} (--rebuild-base rebuilds it)")
    elif not engine.has_image(base):
        raise BuildError(f"--base {base}: no such local image (pull or build it first)")
    if args.torch_wheel is not None:
        repository, _, label = base.rpartition(":") if ":" in base.split("/")[-1] else (base, "", "latest")
        torch_version = args.torch_wheel.name.split("-")[1].replace("+", "-")  # torch-2.13.0+cpu-... -> 2.13.0-cpu
        torch_base = f"{repository}:{label}-torch{torch_version}"
        if args.rebuild_base or not engine.has_image(torch_base):
            with_torch(engine, base, args.torch_wheel, torch_base)
        else:
            log(f"reusing base {torch_base} (--rebuild-base rebuilds it)")
        base = torch_base
    started = time.monotonic()
    build_args = {"BASE_IMAGE": base, **dict(item.split("=", 1) for item in args.build_arg)}
    engine.build(args.context.resolve(), args.tag, build_args)
    log(f"image {args.tag} built on {base} in {time.monotonic() - started:.0f} s")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        validate(args)
        engine = pick_engine(args.engine)
        if not args.no_build:
            build(engine, args)
        elif not engine.has_image(args.tag):
            raise BuildError(f"--no-build: no image {args.tag}: build it first (without --no-build)")
        if args.command:
            return engine.run(args.tag, args.command, args.volume, args.user)
        return 0
    except BuildError as error:
        print(f"build_local: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
