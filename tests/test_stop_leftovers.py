"""A stop that survives a second signal, nothing left behind by a killed save, nothing changed by a refused run:
real train.py runs, real signals, a real SIGKILL mid-save (train.fault_injection.kill_during_save_step).

* Plain python: a SIGTERM, a second one once the stop's step dir appears (its save under way), a third once the
  stop is printed (the run finishing): the save completes, the run exits 143 with its lock released and its loss
  curve drawn (before, the last signal killed it: exit -15, run.lock left).
* A save killed midway leaves an incomplete step dir; the next run (or a conversion of the run dir) removes it
  with one notice naming its size, and resumes from the previous complete checkpoint.
* Each kind of refusal (a resume at another width, a run dir locked by a live run; the FP8 device check comes
  before the run dir is touched at all) leaves the run dir byte-identical, and a refused run makes no fresh run
  dir; an empty config is one line.
* Lock contention under the SLURM flow (tools/slurm/train.sbatch with the stand-ins of tests/test_slurm_requeue.py):
  every rank exits 2, no rank aborts, the job exits 2.

The second signal under the deepspeed launcher, torchrun and the SLURM flow: tests/test_checkpoint_lifecycle.py
and tests/test_slurm_requeue.py (their stop tests signal twice).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_lite import checkpoint_dirs
from megatron_lite.training.run_lock import LOCK_FILE, acquire
from training_helpers import REPO, metrics, run_train, tiny_train_config, train_command, write_config

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def configs(training_corpus, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    mix, cache = training_corpus
    root = tmp_path_factory.mktemp("stop_leftovers")
    plain = tiny_train_config(mix, cache, train_iters=4, save_interval=2, eval_interval=0)
    killing = tiny_train_config(mix, cache, train_iters=4, save_interval=2, eval_interval=0,
                                fault_injection={"kill_during_save_step": 4})
    long = tiny_train_config(mix, cache, train_iters=5000, save_interval=0, eval_interval=0)
    return {name: write_config(root / f"{name}.yml", data)
            for name, data in (("plain", plain), ("killing", killing), ("long", long))}


@pytest.fixture(scope="module")
def killed_run(configs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run SIGKILLed while writing its step-4 checkpoint: step 2 complete, step 4 without its COMPLETE marker."""
    run = tmp_path_factory.mktemp("killed") / "run"
    killed = run_train(configs["killing"], run, check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    checkpoints = run / checkpoint_dirs.CHECKPOINTS_DIR
    assert [p.name for p in checkpoint_dirs.incomplete_step_dirs(checkpoints)] == [checkpoint_dirs.step_tag(4)]
    assert checkpoint_dirs.latest_complete(checkpoints) == checkpoints / checkpoint_dirs.step_tag(2)
    return run


def snapshot(directory: Path) -> dict[str, bytes | None]:
    """Every path under ``directory`` with its bytes (None for a directory)."""
    return {str(path.relative_to(directory)): None if path.is_dir() else path.read_bytes()
            for path in sorted(directory.rglob("*"))}


def refused(config: Path, run: Path, *extra: str) -> str:
    """train.py's one-line refusal (exit 2, one stderr line)."""
    result = subprocess.run(train_command(config, run, *extra), cwd=REPO, env=ENV, text=True, capture_output=True,
                            timeout=300)
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return errors[0]


@pytest.mark.slow  # train.py runs
def test_each_refusal_leaves_the_run_dir_byte_identical(configs: dict[str, Path], killed_run: Path,
                                                         tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(killed_run, run)
    (run / LOCK_FILE).unlink()  # the killed run's, which any next run takes over (tests/test_run_lock.py)
    before = snapshot(run)
    # a resume of a checkpoint of another width: refused after the data is ready, config.yml untouched
    assert "cannot resume from" in refused(configs["plain"], run, "--set", "model.hidden_size=128")
    assert snapshot(run) == before
    # the run dir held by a live run
    lock = acquire(run)
    try:
        held = snapshot(run)
        assert "is in use by" in refused(configs["plain"], run)
        assert snapshot(run) == held
    finally:
        lock.release()
    assert snapshot(run) == before
    # a refused run into a fresh run dir leaves none
    fresh = tmp_path / "fresh"
    assert "cannot resume from" in refused(configs["plain"], fresh, "--resume", str(run), "--set", "model.hidden_size=128")
    assert not fresh.exists()


def test_an_empty_or_non_mapping_config_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from script_loading import load_script

    train = load_script("train.py")
    for name, text, error in (("empty.yml", "", "empty config (no keys)"),
                              ("blank.yml", "# nothing yet\n", "empty config (no keys)"),
                              ("list.yml", "- 1\n- 2\n", "top level must be a mapping, got list")):
        (tmp_path / name).write_text(text)
        assert train.main(["--config", str(tmp_path / name), "--run-dir", str(tmp_path / "run")]) == 2
        stderr = capsys.readouterr().err
        assert stderr.startswith("error: ") and stderr.count("\n") == 1 and error in stderr, stderr
    assert not (tmp_path / "run").exists()


def test_the_fp8_cpu_example_ends_with_the_fp8_line_offline_and_writes_nothing(tmp_path: Path) -> None:
    """docs/float8.md's example as written, from a scratch working directory: the device check comes first (no hub
    access, no data cache, no run dir)."""
    result = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(REPO / "configs/coca_350m.yml"),
                             "--set", "train.fp8=mlp"], cwd=tmp_path, env=ENV, text=True, capture_output=True,
                            timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith("error: train.fp8=mlp: FP8 matmuls need a CUDA GPU")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # train.py runs
def test_the_next_run_removes_a_killed_save_with_one_notice_and_resumes_before_it(configs: dict[str, Path],
                                                                                  killed_run: Path,
                                                                                  tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(killed_run, run)
    killed = run / checkpoint_dirs.CHECKPOINTS_DIR / checkpoint_dirs.step_tag(4)
    size = checkpoint_dirs.dir_size(killed)
    resumed = run_train(configs["plain"], run)
    notices = [line for line in resumed.stdout.splitlines() + resumed.stderr.splitlines()
               if "incomplete checkpoint dir" in line]
    assert len(notices) == 1 and f"{killed.name} ({size / 1e6:.1f} MB)" in notices[0], notices
    assert f"resumed from {run / checkpoint_dirs.CHECKPOINTS_DIR / checkpoint_dirs.step_tag(2)} at step 2" \
        in resumed.stdout
    assert checkpoint_dirs.is_complete(killed)  # written again by this run, whole
    # a conversion of a run dir that nobody writes removes one too
    converted = tmp_path / "converted"
    shutil.copytree(killed_run, converted)
    result = subprocess.run([sys.executable, str(REPO / "tools" / "convert_checkpoint.py"), str(converted),
                             str(tmp_path / "out"), "--to", "megatron_lite"], cwd=REPO, env=ENV, text=True,
                            capture_output=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (result.stdout + result.stderr).count("incomplete checkpoint dir") == 1, result.stdout[-3000:]
    assert checkpoint_dirs.incomplete_step_dirs(converted / checkpoint_dirs.CHECKPOINTS_DIR) == []


@pytest.mark.slow  # a train.py run
def test_plain_python_survives_a_second_and_third_sigterm_and_exits_143(configs: dict[str, Path],
                                                                         tmp_path: Path) -> None:
    run = tmp_path / "run"
    checkpoints = run / checkpoint_dirs.CHECKPOINTS_DIR
    job = subprocess.Popen(train_command(configs["long"], run), cwd=REPO, env=ENV,
                           text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while not ((run / "metrics.jsonl").is_file() and len(metrics(run)) >= 2):
            assert job.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        job.send_signal(signal.SIGTERM)
        while not checkpoint_dirs.step_dirs(checkpoints):  # the stop's save has begun
            assert job.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        job.send_signal(signal.SIGTERM)
        assert job.stdout is not None
        for line in job.stdout:
            output.append(line)
            if "stopped by SIGTERM at step" in line:  # the run finishing: closing row, loss curve, lock release
                job.send_signal(signal.SIGTERM)
                break
        output.append(job.communicate(timeout=120)[0])
    finally:
        if job.poll() is None:
            job.kill()
    text = "".join(output)
    assert job.returncode == 143, text[-3000:]
    saved = checkpoint_dirs.latest_complete(checkpoints)
    assert saved is not None and checkpoint_dirs.read_complete_marker(saved)["stopped_by"] == "signal"
    assert checkpoint_dirs.incomplete_step_dirs(checkpoints) == []
    assert not (run / LOCK_FILE).exists() and (run / "loss_curve.png").is_file(), text[-3000:]
    assert metrics(run)[-1]["stopped_by"] == "signal"


def test_the_strict_scheme_name_points_at_the_constraint() -> None:
    from megatron_lite import config as config_lib

    with pytest.raises(ValueError, match=r"must be one of .*; CoCA's variant is model.position.constraint: "
                                         r"--set model.position.scheme=coca --set model.position.constraint=strict"):
        config_lib.load(REPO / "configs" / "tiny" / "coca_slack.yml", ["model.position.scheme=coca_strict"])


@pytest.mark.slow  # the killed run
def test_the_wait_says_saved_only_when_the_newest_step_dir_is_complete(killed_run: Path, tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A closing row that says "stopped by SIGTERM" next to a save cut short (its step dir incomplete): the wait
    reports the incomplete dir and exits 1, so a job script does not requeue as if the stop had saved."""
    import json

    from megatron_lite.training.run_lock import EXIT_NO_ENDING
    from megatron_lite.training.run_lock import main as wait_main

    run = tmp_path / "run"
    shutil.copytree(killed_run, run)
    with (run / "metrics.jsonl").open("a") as handle:
        handle.write(json.dumps({"step": 4, "stopped_by": "signal", "signal": "SIGTERM"}) + "\n")
    with pytest.warns(UserWarning, match="its process .* is gone"):
        assert wait_main([str(run), "--timeout", "10"]) == EXIT_NO_ENDING
    assert f"newest checkpoint {run / 'checkpoints' / 'step_00000004'} incomplete" in capsys.readouterr().out


def test_lock_contention_under_the_slurm_flow_exits_2_before_any_rank_starts(configs: dict[str, Path],
                                                                             tmp_path: Path) -> None:
    """A second allocation that finds the run dir held by a live run (train.sbatch's WAIT_FOR_LOCK=0): the batch
    script says so in one line and exits 2 before srun starts a node (left to the ranks, each refused on its own and
    --kill-on-bad-exit SIGKILLed the slower node: exit 137, or a rank aborting in its teardown)."""
    from test_slurm_requeue import JOB_ID, SLURM_SCRIPT, install_stand_ins, launcher_env

    run = tmp_path / "run"
    stand_ins = install_stand_ins(tmp_path / "bin")
    env = {**launcher_env(), "PATH": os.pathsep.join([str(stand_ins), str(Path(sys.executable).parent),
                                                      os.environ["PATH"]]),
           "SLURM_JOB_ID": JOB_ID, "SLURM_JOB_NODELIST": "127.0.0.1,localhost", "SLURM_NNODES": "2",
           "SLURM_GPUS_PER_NODE": "cpu:1", "SLURM_CPUS_ON_NODE": "2", "HOSTFILE": str(tmp_path / "hostfile"),
           "SRUN_OPTIONS_FILE": str(tmp_path / "srun_options"), "SRUN_LOG_FILE": str(tmp_path / "srun.log"),
           "SRUN_PID_FILE": str(tmp_path / "srun.pid"), "SCONTROL_REQUEUE_FILE": str(tmp_path / "requeues"),
           "WAIT_FOR_LOCK": "0", "MASTER_PORT": "29500"}
    lock = acquire(run)
    try:
        before = snapshot(run)
        job = subprocess.run(["bash", str(SLURM_SCRIPT), "--config", str(configs["plain"]), "--run-dir", str(run)],
                             cwd=REPO, env=env, text=True, capture_output=True, timeout=300)
        assert snapshot(run) == before
    finally:
        lock.release()
    log = job.stdout + job.stderr
    assert job.returncode == 2, log[-4000:]
    assert log.count("error: ") == 1 and f"error: {run}: its run has not ended after 0 s (held by train.py pid " \
        f"{os.getpid()}" in log, log[-4000:]
    assert not (tmp_path / "srun.log").exists() and not (tmp_path / "requeues").exists()


@pytest.mark.slow  # a 2-rank torchrun launch
def test_lock_contention_under_torchrun_exits_2_on_every_rank_without_an_abort(configs: dict[str, Path],
                                                                                tmp_path: Path) -> None:
    """Both ranks refuse the held run dir after one all-rank agreement, destroy their process group and exit 2: no
    "terminate called without an active exception" (SIGABRT) in gloo's teardown."""
    from test_slurm_requeue import torchrun

    run = tmp_path / "run"
    lock = acquire(run)
    try:
        job = subprocess.run(torchrun(configs["plain"], run), cwd=REPO, env=ENV, text=True, capture_output=True,
                             timeout=300)
    finally:
        lock.release()
    log = job.stdout + job.stderr
    assert job.returncode == 1 and "terminate called" not in log and "Signal 6" not in log, log[-4000:]
    assert log.count(f"error: run dir {run} is in use by") == 1, log[-4000:]
    # torchrun's failure report: every rank exited 2
    ranks = set(re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", log))
    assert ranks == {("0", "2"), ("1", "2")}, log[-4000:]
