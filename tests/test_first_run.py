"""A first run's rough edges, each at unit level: --resume's target checked before anything
starts or is written; the data summary in full once, one line when the cache is reused; no JIT-lock notice for
the run's own build; the converter naming a run dir as one; git ignoring the docs' example outputs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import tiny_config
from megatron_lite import checkpoint_dirs
from megatron_lite import config as config_lib
from megatron_lite.convert.conversion import ConversionResult
from megatron_lite.data.preprocess import prepare_data
from megatron_lite.training import jit_lock
from script_loading import load_script
from training_helpers import REPO, tiny_train_config

# ----------------------------------------------------------------------------------------------
# --resume


def _not_checkpoints(root: Path) -> dict[str, Path]:
    """Existing directories --resume must refuse: an unrelated one, a consolidated dir, a Hugging Face dir, a run
    dir without a complete checkpoint, a step dir whose save did not finish."""
    dirs = {name: root / name for name in ("plain", "consolidated", "hf", "run", "step")}
    for path in dirs.values():
        path.mkdir()
    (dirs["plain"] / "notes.txt").write_text("not a checkpoint\n")
    (dirs["consolidated"] / checkpoint_dirs.CONFIG_FILE).write_text("model: {}\n")
    (dirs["consolidated"] / checkpoint_dirs.WEIGHTS_FILE).write_bytes(b"")
    (dirs["hf"] / "config.json").write_text("{}\n")
    (dirs["run"] / checkpoint_dirs.CHECKPOINTS_DIR / "step_00000002").mkdir(parents=True)  # no COMPLETE
    (dirs["step"] / "mp_rank_00_model_states.pt").write_bytes(b"")
    return dirs


@pytest.mark.parametrize("kind", ["plain", "consolidated", "hf", "run", "step"])
def test_resume_of_a_dir_that_is_no_checkpoint_stops_before_anything(
        kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_lite.training import loop

    def reached(*args: object, **kwargs: object) -> None:
        raise AssertionError("run_training started (DeepSpeed, the data, the run dir) for a bad --resume")

    monkeypatch.setattr(loop, "run_training", reached)
    target = _not_checkpoints(tmp_path)[kind]
    run_dir = tmp_path / "new_run"
    train = load_script("train.py")
    code = train.main(["--config", str(REPO / "configs/tiny/coca_slack.yml"), "--run-dir", str(run_dir),
                       "--resume", str(target)])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and line.startswith(f"error: --resume {target}: ") and not run_dir.exists()
    if kind in ("plain", "consolidated", "hf"):
        assert "auto, none, a run dir" in line and "a step dir" in line
    if kind in ("consolidated", "hf"):
        assert f"train.init_from={target}" in line
    assert "Hugging Face dir (config.json)" not in line  # not offered as something --resume accepts


def test_verbose_flag_reaches_the_data_summary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_lite.training import data as training_data
    from megatron_lite.training import loop

    seen: list[bool] = []

    def run_training(*args: object, **kwargs: object) -> SimpleNamespace:
        seen.append(training_data.VERBOSE_SUMMARY["on"])
        return SimpleNamespace(exit_code=0)

    monkeypatch.setattr(loop, "run_training", run_training)
    monkeypatch.setattr(training_data, "VERBOSE_SUMMARY", {"on": False})
    train = load_script("train.py")
    config = str(REPO / "configs/tiny/coca_slack.yml")
    for extra in (["--verbose"], []):
        assert train.main(["--config", config, "--run-dir", str(tmp_path / "run"), *extra]) == 0
    assert seen == [True, False]


# ----------------------------------------------------------------------------------------------
# The data summary


def test_data_summary_in_full_when_built_one_line_when_reused(training_corpus, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    mix, cache = training_corpus
    shutil.copytree(cache, tmp_path / "cache")
    config = config_lib.from_dict(tiny_train_config(mix, tmp_path / "cache"))
    (tmp_path / "cache" / "manifest.json").unlink()  # the shards to build again (the tokenizer is kept)

    prepare_data(config.data, config.model.vocab_size, brief_when_cached=True)
    built = capsys.readouterr().out.strip().splitlines()
    assert len(built) >= 4 and re.search(r"^code +code +built ", "\n".join(built), re.MULTILINE)
    assert "reused" not in built[0]
    prepare_data(config.data, config.model.vocab_size, brief_when_cached=True)
    (reused,) = capsys.readouterr().out.strip().splitlines()
    assert reused.startswith(f"data cache {tmp_path / 'cache'}: reused, 2 source(s) (")
    assert "--verbose" in reused
    prepare_data(config.data, config.model.vocab_size)  # train.py --verbose, tools/preprocess_data.py
    full = capsys.readouterr().out.strip().splitlines()
    assert len(full) == len(built) and re.search(r"^code +code +cached ", "\n".join(full), re.MULTILINE)


# ----------------------------------------------------------------------------------------------
# The JIT build lock


def test_no_jit_lock_notice_for_this_runs_own_build(tmp_path: Path) -> None:
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_RDWR)  # this process builds, as torch's FileBaton holds it
    try:
        assert jit_lock.processes_holding(lock) == [os.getpid()]
        assert jit_lock._describe(lock) is None
        child = subprocess.Popen(["sleep", "60"], pass_fds=(fd,))  # a build this process started
    finally:
        os.close(fd)
    try:
        assert jit_lock.processes_holding(lock) == [child.pid]
        assert jit_lock._describe(lock) is None
    finally:
        child.kill()
        child.wait()
    message = jit_lock._describe(lock)  # nobody holds it: stale, still named
    assert message is not None and "no process on this host has it open" in message


# ----------------------------------------------------------------------------------------------
# The converter's wording


def test_converter_names_a_run_dir_as_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    cli = load_script("tools/convert_checkpoint.py")
    run = tmp_path / "runs" / "coca"
    (run / checkpoint_dirs.CHECKPOINTS_DIR).mkdir(parents=True)
    result = ConversionResult(tmp_path / "out", "step", tiny_config(), False, 30)  # what a run dir's conversion returns
    monkeypatch.setattr(cli, "convert_checkpoint", lambda *args, **kwargs: result)
    assert cli.main([str(run), str(tmp_path / "out"), "--to", "safetensors"]) == 0
    line = capsys.readouterr().out.strip()
    assert f"{run} (run dir: its latest complete checkpoint, training step 30) -> " in line
    assert "step dir" not in line


# ----------------------------------------------------------------------------------------------
# .gitignore


def _docs_outputs() -> set[str]:
    """Relative paths the README's and docs' commands write or download into the checkout."""
    patterns = [r"tools/convert_checkpoint\.py +\S+ +([^\s\\`]+) +--to", r"--out +([^\s\\`|\]]+)",
                r"--local-dir +([^\s\\`|]+)", r"--json +([^\s\\`|\]]+)", r"--run-dir +([^\s\\`|]+)",
                r"tools/gpu/(?:check_gpu|speedrun_pair|acceptance)\.sh +(?:--dry-run +)?\S+ +\S+ +([^\s\\`]+)"]
    found: set[str] = set()
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for pattern in patterns:
            found.update(re.findall(pattern, doc.read_text()))
    placeholder = re.compile(r"[A-Z_]+\]?")  # OUT, DIR, OUTPUT
    return {path.replace("...", "x").replace("<scheme>", "x").rstrip(";") for path in found
            if not path.startswith(("/", "$", "~")) and not placeholder.fullmatch(path.split("/")[0])}


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs a git checkout")
def test_gitignore_covers_the_docs_example_outputs(tmp_path: Path) -> None:
    outputs = _docs_outputs()
    assert {"hf/coca_350m", "ckpt/coca_350m", "wheels", "pythia-160m"} <= outputs  # the extraction works
    # The committed .gitignore alone, in a scratch repository: this checkout's .git/info/exclude and the
    # developer's global excludes are not in a user's clone (CI's clean clone caught '.gpu/whl' that way).
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    shutil.copy(REPO / ".gitignore", tmp_path / ".gitignore")
    checked = subprocess.run(["git", "-C", str(tmp_path), "-c", "core.excludesFile=/dev/null", "check-ignore",
                              "--stdin", "--no-index"],
                             input="\n".join(sorted(outputs)), capture_output=True, text=True)
    assert set(checked.stdout.split()) == outputs, f"not ignored: {sorted(outputs - set(checked.stdout.split()))}"


# ----------------------------------------------------------------------------------------------
# The README's entry points


def test_readme_entry_points_are_checked_commands() -> None:
    """The users' command on 1 and 8 GPUs, docker run of the image and the converter, each parsed as
    tests/test_docker.py parses the at-scale guide (launcher, docker options, flags, configs, batch arithmetic)."""
    from test_docker import check_batches, check_document

    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Train the paper's model\n", 1)[1].split("\n## ", 1)[0]
    found = check_document(section)
    check_batches(found)
    launchers = [entry["launcher"] for entry in found.deepspeed]
    assert sorted(launcher.num_gpus for launcher in launchers) == [1, 8, 8]  # 1 and 8 GPUs, and 8 in the image
    assert all(launcher.user_args == ["--config", "configs/coca_350m.yml"] for launcher in launchers)
    assert len(found.docker_runs) == 1
    assert "python tools/convert_checkpoint.py runs/coca_350m hf/coca_350m --to hf" in section
    assert readme.index("## Train the paper's model") > readme.index("python -m pytest -q")  # the first commands stay first
