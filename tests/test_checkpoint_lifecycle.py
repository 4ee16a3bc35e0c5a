"""A checkpoint's lifecycle when a step is written twice or a save fails: real train.py runs.

1. A redone step (``--resume none`` in the same run dir, on 2 ranks) replaces its step dir as a unit: the
   earlier save's ``universal/`` conversion does not survive, and a later resume on 1 rank converts the new save
   instead of training on from the abandoned run's state (slow: 2 ranks). On 1 rank: the redone step survives
   pruning, and ``--resume auto``'s fallback never picks the abandoned history's later checkpoint.
2. A derived folder that fails verification never makes its step be skipped: a ``universal/`` without its
   manifest leaves the step usable (1 rank), and a truncated file in it is deleted and rebuilt, the resume
   continuing exactly as from the intact conversion (slow: a 2-rank checkpoint resumed on 1 rank).
3. A failed final save ends the run with exit code 4 and ``stopped_by: final_save_failed`` naming the last
   complete checkpoint (1 rank).
4. A resume at another ZeRO stage on the same rank count: 1 <-> 2 continues exactly, 0 and 3 stop in one line
   (1 rank).
5. A universal conversion on a real small filesystem (a tmpfs; skipped where it cannot be mounted) says how
   much space it needs before it starts.
6. SIGTERM to the deepspeed launcher's process group (slow): the ``deepspeed`` command returns 143 at once, while
   its ranks still run and stop at one step; the job script of docs/training.md waits for them with ``python -m
   megatron_lite.training.run_lock`` and gets the run's own exit code; the checkpoint is complete and resumes.
   Ctrl-C under the launcher is recorded as SIGINT, not as the SIGTERM the launcher sends after it.
And the issue's item 2 as it happened (slow): 2 ranks killed mid-save, the step re-saved on 1 rank, the next
resume takes that step dir.

The 1-rank tests share one run (``zero1_run``: checkpoints at steps 4 and 6) and copy it where they change it.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from megatron_lite import checkpoint_dirs
from megatron_lite.checkpoint_integrity import MANIFEST_FILE, read_manifest
from megatron_lite.console import Notice
from megatron_lite.training.distributed import DistributedInfo
from megatron_lite.training.run_lock import LOCK_FILE
from megatron_lite.training.stopping import STOP_LINGER_ENV, StopRequest
from training_helpers import REPO, metrics, run_train, tiny_train_config, train_command, train_losses, write_config

SAVED = 4


def lifecycle_config(root: Path, corpus: tuple[Path, Path], name: str = "config.yml", **train: object) -> Path:
    """The tiny run of training_helpers at ZeRO 1: 4 steps of 8 samples (the accumulation derived from the rank
    count), dropout 0, no evaluation, a checkpoint every 4 steps."""
    mix, cache = corpus
    data = tiny_train_config(mix, cache, **{"train_iters": SAVED, "save_interval": SAVED, "eval_interval": 0,
                                            "zero_stage": 1, "gradient_accumulation_steps": None,
                                            "train_batch_size": 8, **train})
    data["model"].update(attention_dropout=0.0, hidden_dropout=0.0)
    return write_config(root / name, data)


def step_dir(run: Path, step: int) -> Path:
    return run / checkpoint_dirs.CHECKPOINTS_DIR / checkpoint_dirs.step_tag(step)


ONE_RANK = DistributedInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def unlisted_files(directory: Path) -> list[str]:
    """Files of a step dir that its manifest does not list (COMPLETE and the manifest itself aside)."""
    listed = set(read_manifest(directory) or {})
    return sorted(path.relative_to(directory).as_posix() for path in directory.rglob("*") if path.is_file()
                  and path.relative_to(directory).as_posix() not in listed | {MANIFEST_FILE, "COMPLETE"})


@pytest.fixture(scope="module")
def zero1_run(training_corpus, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(config, a run dir: 1 rank, ZeRO 1, 6 steps, checkpoints at steps 4 and 6), read-only: tests copy it."""
    root = tmp_path_factory.mktemp("zero1")
    config = lifecycle_config(root, training_corpus)
    run_train(config, root / "run", "--train-iters", "6")
    return config, root / "run"


# ----------------------------------------------------------------------------------------------
# 1. A redone step on 1 rank: the later checkpoints are another history's


def test_a_redone_step_is_kept_and_never_falls_back_to_the_abandoned_history(zero1_run, tmp_path: Path) -> None:
    """Checkpoints at steps 4 and 6, then ``--resume none`` to step 4 in the same run dir keeping 1 checkpoint: the
    new step 4 must survive pruning (the abandoned step 6 is not counted against it), and a fallback from a damaged
    step 4 must not pick the abandoned step 6."""
    from megatron_lite.training.checkpointing import find_resume_checkpoint

    config, first = zero1_run
    run = tmp_path / "run"
    shutil.copytree(first, run)
    run_train(config, run, "--resume", "none", "--set", "train.keep_last_checkpoints=1")
    assert checkpoint_dirs.latest_complete(run / "checkpoints") == step_dir(run, SAVED)
    (step_dir(run, SAVED) / "mp_rank_00_model_states.pt").write_bytes(b"damaged")
    with pytest.warns(Notice, match="skipping"), pytest.raises(ValueError, match="none of the 1 complete checkpoint"):
        find_resume_checkpoint("auto", run, ONE_RANK)


# ----------------------------------------------------------------------------------------------
# 3. A failed final save


def test_a_failed_final_save_exits_non_zero_naming_the_last_complete_checkpoint(training_corpus, tmp_path: Path
                                                                                 ) -> None:
    config = lifecycle_config(tmp_path, training_corpus, save_interval=2, zero_stage=0,
                              fault_injection={"fail_save_step": SAVED})
    result = run_train(config, tmp_path / "run", check=False)
    last_good = step_dir(tmp_path / "run", 2)
    assert result.returncode == 4, result.stdout[-2000:] + result.stderr[-2000:]
    assert "warning: checkpoint at step 4 failed" in result.stdout
    assert f"steps after step 2 are in no checkpoint; last complete checkpoint: {last_good}" in result.stdout
    assert "done: final save failed at step 4/4" in result.stdout
    assert metrics(tmp_path / "run")[-1] == {"step": SAVED, "stopped_by": "final_save_failed",
                                             "last_checkpoint": str(last_good)}
    assert checkpoint_dirs.latest_complete(tmp_path / "run" / checkpoint_dirs.CHECKPOINTS_DIR) == last_good


# ----------------------------------------------------------------------------------------------
# 2. A damaged derived folder keeps its step


def test_a_universal_folder_without_its_manifest_does_not_skip_its_step(zero1_run, tmp_path: Path) -> None:
    """A ``universal/`` whose manifest is gone (a removal or copy cut short) sits in the newest step dir; the
    same-size resume, which never reads it, resumes from that step, not from the one before."""
    config, first = zero1_run
    run = tmp_path / "run"
    shutil.copytree(first, run)
    damaged = step_dir(run, 6) / checkpoint_dirs.UNIVERSAL_DIR / "zero" / "embed_in.weight"
    damaged.mkdir(parents=True)
    torch.save({"param": torch.zeros(3)}, damaged / "fp32.pt")
    resumed = run_train(config, run, "--train-iters", "7")
    assert f"resumed from {step_dir(run, 6)} at step 6" in resumed.stdout, resumed.stdout
    assert "skipping" not in resumed.stdout + resumed.stderr


# ----------------------------------------------------------------------------------------------
# 4. Another ZeRO stage on the same rank count


def test_a_zero_stage_change_continues_exactly_or_stops_in_one_line(zero1_run, tmp_path: Path) -> None:
    """ZeRO 1 -> 2 (the same files) continues with the losses of the run that stayed at ZeRO 1; ZeRO 1 -> 3 and
    1 -> 0, which DeepSpeed's load fails on with a traceback, stop in one line before DeepSpeed starts (3 through
    train.py; 0 by the same check, asked in-process)."""
    from megatron_lite import config as config_lib
    from megatron_lite.training.checkpointing import plan_resume

    config, first = zero1_run
    saved = step_dir(first, SAVED)
    run_train(config, tmp_path / "zero2", "--resume", str(saved), "--train-iters", "6", "--set", "train.zero_stage=2")
    stayed = {step: loss for step, loss in train_losses(first).items() if step > SAVED}  # steps 5-6 at ZeRO 1
    assert train_losses(tmp_path / "zero2") == stayed

    def refusal(stage: int) -> str:
        return (f"cannot resume {saved} at ZeRO {stage}: it was saved at ZeRO 1, and a checkpoint changes its ZeRO "
                "stage only between 1 and 2")

    refused = run_train(config, tmp_path / "zero3", "--resume", str(saved), "--train-iters", "6", "--set",
                        "train.zero_stage=3", check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert f"error: {refusal(3)}" in refused.stderr
    assert not (tmp_path / "zero3" / checkpoint_dirs.CHECKPOINTS_DIR).exists()
    with pytest.raises(ValueError) as raised:
        plan_resume(saved, checkpoint_dirs.read_complete_marker(saved),
                    config_lib.load(str(config), ["train.zero_stage=0"]), ONE_RANK)
    assert str(raised.value).startswith(refusal(0))


# ----------------------------------------------------------------------------------------------
# 5. The conversion on a small disk


def test_a_conversion_without_the_space_it_needs_says_so_before_it_starts(zero1_run, tmp_path: Path) -> None:
    """A real small filesystem (tmpfs) holding the step dir and 200 kB more: the conversion names the space it
    needs and the space free, in one line, and leaves nothing behind."""
    import subprocess

    from megatron_lite.convert.universal import convert_step_to_universal

    _, run = zero1_run
    source = step_dir(run, SAVED)
    size = sum(path.stat().st_size for path in source.rglob("*") if path.is_file())
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size + 200_000}", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        copy = disk / source.name
        shutil.copytree(source, copy)
        with pytest.raises(ValueError) as raised:
            convert_step_to_universal(copy, copy / checkpoint_dirs.UNIVERSAL_DIR)
        message = str(raised.value)
        needed = 1.5 * sum(path.stat().st_size for path in copy.glob("*_states.pt"))  # the DeepSpeed files
        assert "\n" not in message and message.startswith(f"{copy}: not enough free disk space for the universal "
                                                          f"conversion: it needs about {needed / 1e6:.1f} MB"), message
        assert sorted(path.name for path in copy.iterdir()) == sorted(path.name for path in source.iterdir())
    finally:
        subprocess.run(["umount", str(disk)], check=True)


# ----------------------------------------------------------------------------------------------
# 1 and 2 on another rank count (slow): one 2-rank checkpoint, its 1-rank resumes


@pytest.fixture(scope="module")
def two_rank_run(training_corpus, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, float]]:
    """(a run dir: 2 ranks to step 4, then 1 rank to step 5, converting step 4; that resume's losses)."""
    if shutil.which("deepspeed") is None:
        pytest.skip("the deepspeed launcher is not on PATH")
    root = tmp_path_factory.mktemp("lifecycle")
    config = lifecycle_config(root, training_corpus)
    run_train(config, root / "run", ranks=2, timeout=300)
    resumed = run_train(config, root / "run", "--train-iters", str(SAVED + 1))
    assert "(saved by 2 rank(s)) on 1 rank(s)" in resumed.stderr + resumed.stdout and "converted it in" in (
        resumed.stderr + resumed.stdout)
    return root, train_losses(root / "run")


@pytest.mark.slow
def test_a_truncated_universal_file_is_rebuilt_and_the_resume_goes_on_exactly(two_rank_run, tmp_path: Path) -> None:
    root, losses = two_rank_run
    source = step_dir(root / "run", SAVED)
    shutil.copytree(source, tmp_path / source.name)
    universal = tmp_path / source.name / checkpoint_dirs.UNIVERSAL_DIR
    truncated = universal / "zero" / "embed_in.weight" / "exp_avg.pt"
    truncated.write_bytes(truncated.read_bytes()[:100])
    resumed = run_train(root / "config.yml", tmp_path / "run", "--resume", str(tmp_path / source.name),
                        "--train-iters", str(SAVED + 1), check=False)
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-3000:]
    assert f"{universal}: fails verification ({truncated}: 100 bytes" in output
    assert train_losses(tmp_path / "run")[SAVED + 1] == losses[SAVED + 1]  # as from the intact conversion


@pytest.mark.slow
def test_a_redone_step_replaces_its_step_dir_and_its_conversion(two_rank_run, tmp_path: Path) -> None:
    """The issue's sequence: 2 ranks to step 4, a 1-rank resume (converts), ``--resume none`` on 2 ranks with
    another lr to step 4 (the same step dir), a 1-rank resume: it must convert the new save, not reuse the old."""
    root, losses = two_rank_run
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    assert (step_dir(run, SAVED) / checkpoint_dirs.UNIVERSAL_DIR / MANIFEST_FILE).is_file()
    data = yaml.safe_load((root / "config.yml").read_text())
    data["train"]["lr"] = 1.0e-3
    config = write_config(tmp_path / "config.yml", data)
    run_train(config, run, "--resume", "none", ranks=2, timeout=300)
    redone = step_dir(run, SAVED)
    left_over = unlisted_files(redone)  # files of the earlier save
    resumed = run_train(config, run, "--resume", str(redone), "--train-iters", str(SAVED + 1))
    output = resumed.stdout + resumed.stderr
    assert "converted it in" in output and "reusing the conversion" not in output
    assert train_losses(run)[SAVED + 1] != losses[SAVED + 1]  # the new save's state, not the abandoned run's
    assert left_over == []


# ----------------------------------------------------------------------------------------------
# 2 as the issue found it (slow): a crash mid-save on 2 ranks, the step re-saved on 1 rank


@pytest.mark.slow
def test_a_step_re_saved_on_1_rank_after_a_2_rank_crash_mid_save_is_resumed_from(training_corpus, tmp_path: Path
                                                                                 ) -> None:
    """2 ranks killed while saving step 6 (their files written, no COMPLETE); a 1-rank run from step 4 saves step 6
    again: the re-saved dir holds none of the crashed save's files (rank 1's), so the next resume takes it instead
    of skipping it as unverifiable and redoing steps 5-6 (the issue: ``rng_state_rank00001.pt: not listed``)."""
    from megatron_lite.training.checkpointing import find_resume_checkpoint

    config = lifecycle_config(tmp_path, training_corpus, train_iters=6, zero_stage=0)  # ZeRO 0: no conversion
    run = tmp_path / "run"
    crashed = run_train(config, run, "--set", "train.fault_injection.kill_during_save_step=6", ranks=2, timeout=300,
                        check=False)
    assert crashed.returncode != 0 and (step_dir(run, 6) / "rng_state_rank00001.pt").is_file(), crashed.stderr[-3000:]
    assert checkpoint_dirs.latest_complete(run / checkpoint_dirs.CHECKPOINTS_DIR) == step_dir(run, SAVED)
    run_train(config, run)  # 1 rank, --resume auto: from step 4, saves step 6 into the crashed save's dir
    assert unlisted_files(step_dir(run, 6)) == []
    assert find_resume_checkpoint("auto", run, ONE_RANK) == step_dir(run, 6)  # skips it with a Notice if unverifiable


# ----------------------------------------------------------------------------------------------
# 6. A signal under the deepspeed launcher: what a job script sees, and how it waits for the ranks


def test_the_first_signal_is_the_one_reported() -> None:
    """Ctrl-C under the launcher: the ranks get the terminal's SIGINT, then the launcher's SIGTERM."""
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signal_name == "SIGINT"


def test_the_wait_names_a_run_still_holding_its_lock_and_a_killed_one(tmp_path: Path) -> None:
    """The wait gives up after --timeout on a live holder (exit 2); a killed run's lock (a dead pid) is no wait,
    and a run without a closing metrics row exits 1."""
    from megatron_lite.training.run_lock import EXIT_NO_ENDING, acquire
    from megatron_lite.training.run_lock import main as wait_main

    live = acquire(tmp_path / "live")
    try:
        with pytest.warns(Notice, match="waiting up to"):
            assert wait_main([str(tmp_path / "live"), "--timeout", "0.2"]) == 2
    finally:
        live.release()
    killed = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; from megatron_lite.training."
                             "run_lock import acquire; acquire(Path(sys.argv[1])); import os; os._exit(0)",
                             str(tmp_path / "killed")], capture_output=True, text=True)
    assert killed.returncode == 0 and (tmp_path / "killed" / LOCK_FILE).is_file(), killed.stderr[-2000:]
    with pytest.warns(Notice, match="its process .* is gone"):
        assert wait_main([str(tmp_path / "killed"), "--timeout", "60"]) == EXIT_NO_ENDING


JOB_SCRIPT = """trap : TERM INT
{launch}
echo "deepspeed exited $? with $(pgrep -c -g 0 -f -- --local_rank=) rank(s) running"
(trap '' TERM; exec {python} -m megatron_lite.training.run_lock {run})
"""  # docs/training.md's job script, with a line reporting what the deepspeed command returned


@pytest.mark.slow
def test_sigterm_to_a_launcher_job_exits_143_at_once_and_the_wait_returns_once_the_ranks_saved(training_corpus,
                                                                                                tmp_path: Path) -> None:
    """SIGTERM to the job's process group (scancel, a time limit): ``deepspeed`` exits 143 while its ranks still
    run; the job script's wait returns once they have saved, exiting 143 as train.py does as one process, and a
    second SIGTERM to the group while the ranks stop ends neither their save nor the wait; the checkpoint records
    the stop and a 1-rank run resumes from it."""
    config = lifecycle_config(tmp_path, training_corpus, train_iters=5000, save_interval=0, zero_stage=0)
    run = tmp_path / "run"
    script = tmp_path / "job.sh"
    script.write_text(JOB_SCRIPT.format(launch=shlex.join(train_command(config, run, ranks=2)),
                                        python=shlex.quote(sys.executable), run=shlex.quote(str(run))))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", STOP_LINGER_ENV: "60"}
    log = tmp_path / "job.log"
    with log.open("w") as sink:  # a file, not a pipe: the script's end is awaited, not the ranks' (seconds later)
        job = subprocess.Popen(["bash", str(script)], cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not ((run / "metrics.jsonl").is_file() and len(metrics(run)) >= 2):
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        os.killpg(job.pid, signal.SIGTERM)
        while "waiting up to" not in log.read_text():  # the ranks still stop; the script's wait has begun
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        time.sleep(1.5)  # past the launcher's copy of the first signal
        os.killpg(job.pid, signal.SIGTERM)  # a second SIGTERM (scancel after a time limit's warning)
        job.wait(timeout=120)
        output = log.read_text()
        assert "run_lock: SIGTERM received; still waiting for the run" in output, output[-3000:]
        returned = re.search(r"deepspeed exited (\d+) with (\d+) rank\(s\) running", output)
        # deepspeed returns at once; its ranks usually still run then (2 of 2 on an idle machine), but on a busy one
        # they may have saved and gone before the echo counts them, so the count is not asserted
        assert returned is not None and returned.groups()[0] == "143", output[-3000:]
        final = checkpoint_dirs.latest_complete(run / checkpoint_dirs.CHECKPOINTS_DIR)
        assert final is not None and not (run / LOCK_FILE).exists(), output[-3000:]
        step = checkpoint_dirs.read_complete_marker(final)["step"]
        assert f"{run}: stopped by SIGTERM at step {step}; --resume auto starts from {final}" in output
        assert job.returncode == 143, output[-3000:]
        assert checkpoint_dirs.read_complete_marker(final)["stopped_by"] == "signal"
        assert metrics(run)[-1] == {"step": step, "stopped_by": "signal", "signal": "SIGTERM"}
        # both ranks stopped at one step: each saved its RNG state into it
        assert len(list(final.glob("rng_state_rank*.pt"))) == 2 and unlisted_files(final) == []
        resumed = run_train(config, run, "--train-iters", str(step + 1))
        assert f"resumed from {final} at step {step}" in resumed.stdout, resumed.stdout[-3000:]
    finally:
        _end_process_group(job.pid)


def _end_process_group(pgid: int, grace: float = 30.0) -> None:
    """Wait for the processes of group ``pgid`` to exit (SIGKILL those left after ``grace`` seconds)."""
    deadline = time.monotonic() + grace
    try:
        while time.monotonic() < deadline:
            os.killpg(pgid, 0)
            time.sleep(0.2)
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:  # none left
        pass
