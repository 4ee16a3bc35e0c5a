"""The real training loop end to end: train.py under plain python and under the deepspeed launcher
(2 CPU ranks), exact resume, crashes mid-save, SIGTERM, non-finite losses, failed saves, what the
console reports (one loss definition, notices once on rank 0)."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_lite import checkpoint_dirs
from megatron_lite.training.sample_record import read_sample_indices
from megatron_lite.weights import load_model, load_step_state_dict
from training_helpers import metrics, run_train, tiny_train_config, train_command, train_losses, write_config

pytestmark = pytest.mark.slow  # multi-rank or end-to-end runs of train.py


def weights(step_dir: Path) -> dict[str, torch.Tensor]:
    return load_step_state_dict(step_dir)


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"tensors differ: {different}"


def random_config(mix: Path, cache: Path, **train: Any) -> dict[str, Any]:
    """``tiny_train_config`` whose every step draws random numbers (hidden and attention dropout 0.1) and
    whose evaluations (every 2 steps) fall between the saves (every 4): an exact resume must restore every
    stream a step draws from, and no data loader may draw from them."""
    config = tiny_train_config(mix, cache, **{"eval_interval": 2, "record_sample_indices": True, **train})
    config["model"].update(hidden_dropout=0.1, attention_dropout=0.1)
    return config


@pytest.fixture(scope="module")
def baseline(training_corpus, tmp_path_factory) -> Path:
    """8 uninterrupted steps with dropout (checkpoints at 4 and 8, evaluations every 2), wandb offline."""
    mix, cache = training_corpus
    root = tmp_path_factory.mktemp("baseline")
    config = write_config(root / "config.yml", random_config(mix, cache, wandb={"mode": "offline"}))
    run_train(config, root / "run")
    return root / "run"


def test_run_trains_and_writes_everything(baseline: Path) -> None:
    losses = train_losses(baseline)
    assert sorted(losses) == list(range(1, 9))
    assert losses[8] < 0.85 * losses[1]
    rows = metrics(baseline)
    train_row = next(r for r in rows if r.get("loss") is not None)
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_sec", "memory_gb"):
        assert train_row[key] is not None, key
    assert [r["step"] for r in rows if "val_loss" in r] == [2, 4, 6, 8]
    assert (baseline / "loss_curve.png").stat().st_size > 1000
    assert (baseline / "wandb").is_dir()  # offline wandb files, no prompt, no network
    wandb_id = (baseline / "wandb_run_id").read_text().strip()  # a resume continues this wandb run
    assert [p.name.endswith(f"-{wandb_id}") for p in (baseline / "wandb").glob("offline-run-*")] == [True]
    checkpoints = baseline / checkpoint_dirs.CHECKPOINTS_DIR
    assert (checkpoints / checkpoint_dirs.LATEST_FILE).read_text().strip() == "step_00000008"
    assert [p.name for p in checkpoint_dirs.complete_checkpoints(checkpoints)] == ["step_00000004", "step_00000008"]
    marker = checkpoint_dirs.read_complete_marker(checkpoints / "step_00000008")
    assert marker["step"] == 8 and marker["consumed_samples"] == 64
    loaded = load_model(baseline)  # what evaluation and conversion read
    assert loaded.tokenizer_path is not None and loaded.config.model.hidden_size == 64


def test_exact_resume_single_rank(training_corpus, baseline: Path, tmp_path: Path) -> None:
    mix, cache = training_corpus
    config = write_config(tmp_path / "config.yml", random_config(mix, cache, exit_interval=4))
    first = run_train(config, tmp_path / "run")
    assert "stopped by train.exit_interval at step 4" in first.stdout
    with (tmp_path / "run/metrics.jsonl").open("a") as metrics:  # what a full disk leaves: half a row
        metrics.write('{"step": 5, "loss": 2.71')
    second = run_train(config, tmp_path / "run")
    assert "resumed from" in second.stdout and "step_00000004" in second.stdout
    assert f"warning: {tmp_path / 'run/metrics.jsonl'}: dropped its cut-off last line" in second.stdout
    assert "Traceback" not in second.stderr
    assert train_losses(tmp_path / "run") == train_losses(baseline)  # the same trace, exactly
    indices = read_sample_indices(baseline)  # each step 8 samples (micro 4 x accumulation 2), none seen twice
    assert sorted(indices) == list(range(1, 9)) and all(len(step) == 8 for step in indices.values())
    assert len({index for step in indices.values() for index in step}) == 64
    assert read_sample_indices(tmp_path / "run") == indices  # the resumed run trained on the same samples
    losses = train_losses(baseline)
    assert f"loss {losses[1]:.4f} (step 1) -> {losses[8]:.4f} (step 8)" in second.stdout  # the whole run's, not X -> X
    assert_bitwise_equal(weights(tmp_path / "run/checkpoints/step_00000008"), weights(baseline / "checkpoints/step_00000008"))


def test_bar_log_lines_and_summary_report_one_loss(training_corpus, baseline: Path, tmp_path: Path) -> None:
    """log_interval=3: the bar, the log lines and the summary all show the mean loss of the last 3 steps
    (the baseline, identical but for its log_interval=1, gives each step's loss)."""
    mix, cache = training_corpus
    config = write_config(tmp_path / "config.yml", random_config(mix, cache, log_interval=3))
    result = run_train(config, tmp_path / "run", progress_bar=True)
    per_step, logged = train_losses(baseline), train_losses(tmp_path / "run")
    assert sorted(logged) == [1, 3, 6, 8]  # every 3 steps, plus the first and the last
    for step, loss in logged.items():
        window = [per_step[s] for s in range(max(1, step - 2), step + 1)]
        assert loss == pytest.approx(sum(window) / len(window), rel=1e-12), step
    assert f"step 8/8 | loss {logged[8]:.4f}" in result.stdout
    assert re.findall(r"loss=(\d+\.\d+)", result.stderr)[-1] == f"{logged[8]:.4f}"  # the bar's last state
    summary = f"loss {logged[1]:.4f} (step 1) -> {logged[8]:.4f} (step 8)"
    assert summary in result.stdout
    again = run_train(config, tmp_path / "run")  # a finished run says so, and trains nothing
    assert "already complete at step 8/8" in again.stdout and summary in again.stdout and "n/a" not in again.stdout
    assert train_losses(tmp_path / "run") == logged


def test_two_ranks_zero2_trains_and_resumes_exactly(training_corpus, tmp_path: Path) -> None:
    """With dropout: steps 1-4 without activation checkpointing, 5-8 resumed with it (its recompute replays
    the same dropout masks), bitwise the run that never stopped."""
    mix, cache = training_corpus
    common = {"zero_stage": 2, "gradient_accumulation_steps": 1}
    straight = write_config(tmp_path / "straight.yml", random_config(mix, cache, **common))
    run_train(straight, tmp_path / "straight", ranks=2)
    losses = train_losses(tmp_path / "straight")
    assert losses[8] < 0.85 * losses[1]
    stepped = write_config(tmp_path / "stepped.yml", random_config(mix, cache, exit_interval=4, **common))
    run_train(stepped, tmp_path / "stepped", ranks=2)
    # warmup_start_lr only sets step 0's lr (warm-up is 1 step), so the trace stays exact; the change is a notice.
    second = run_train(stepped, tmp_path / "stepped", "--set", "train.warmup_start_lr=2e-7",
                       "--set", "model.checkpoint_activations=true", ranks=2)
    assert "resumed from" in second.stdout
    output = second.stdout + second.stderr  # notices: once (rank 0), a console line; no messages that do not apply
    assert output.count("train.warmup_start_lr changed from 1e-07 to 2e-07") == 1
    assert "warning: resuming with train.warmup_start_lr changed" in second.stdout
    for unwanted in ("UserWarning", "untested optimizer", "script_method` is deprecated",
                     "all_gather_into_tensor` is deprecated", "TFLOP/s", "Traceback"):
        assert unwanted not in output, unwanted
    assert train_losses(tmp_path / "stepped") == losses
    step_dir = tmp_path / "stepped/checkpoints/step_00000008"
    assert len(list(step_dir.glob("zero_pp_rank_*_optim_states.pt"))) == 2  # ZeRO-2 partitions, one per rank
    assert_bitwise_equal(weights(step_dir), weights(tmp_path / "straight/checkpoints/step_00000008"))


def test_sigkill_while_saving_resumes_from_previous_checkpoint(training_corpus, baseline: Path, tmp_path: Path) -> None:
    mix, cache = training_corpus
    config = write_config(tmp_path / "config.yml",
                          random_config(mix, cache, fault_injection={"kill_during_save_step": 8}))
    crashed = run_train(config, tmp_path / "run", check=False)
    assert crashed.returncode == -signal.SIGKILL
    checkpoints = tmp_path / "run" / checkpoint_dirs.CHECKPOINTS_DIR
    assert (checkpoints / "step_00000008").is_dir() and not checkpoint_dirs.is_complete(checkpoints / "step_00000008")
    assert checkpoint_dirs.latest_complete(checkpoints) == checkpoints / "step_00000004"
    resumed = run_train(write_config(tmp_path / "config.yml", random_config(mix, cache)), tmp_path / "run")
    assert "step_00000004" in resumed.stdout and "resumed from" in resumed.stdout
    # the killed run's lock stayed behind; its pid is dead, so the next run takes it over and says so
    assert re.search(r"warning: taking over the run lock \S+run\.lock of train\.py pid \d+ .*: its process \d+ is gone",
                     resumed.stdout), resumed.stdout[-3000:]
    assert not (tmp_path / "run/run.lock").exists()
    assert_bitwise_equal(weights(checkpoints / "step_00000008"), weights(baseline / "checkpoints/step_00000008"))
    # steps 5-8 ran twice; metrics.jsonl keeps one row per step (the crashed attempt's are dropped)
    assert "dropped" in resumed.stdout and "after step 4" in resumed.stdout
    assert [(r["step"], "val_loss" in r) for r in metrics(tmp_path / "run")] == \
        [(r["step"], "val_loss" in r) for r in metrics(baseline)]


def test_sigint_and_sigterm_write_a_final_checkpoint_exit_as_signalled_and_resume_exactly(training_corpus,
                                                                                           tmp_path: Path) -> None:
    """Ctrl-C, then SIGTERM to the resumed run (dropout, activation checkpointing, evaluations a run not stopped
    there may not make): each saves, records why it stopped (the checkpoint's marker, the last metrics row) and
    exits 128 + the signal's number; the final checkpoint at s, resumed to s + 2, gives that run's weights bitwise."""
    mix, cache = training_corpus

    def config(name: str, **train: Any) -> Path:
        data = random_config(mix, cache, train_iters=5000, save_interval=0, **train)
        data["model"]["checkpoint_activations"] = True
        return write_config(tmp_path / f"{name}.yml", data)

    run_dir = tmp_path / "run"
    for signum, exit_code in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        logged = len(metrics(run_dir)) if (run_dir / "metrics.jsonl").is_file() else 0
        process = subprocess.Popen(train_command(config("signalled"), run_dir), text=True, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while time.time() < deadline and not ((run_dir / "metrics.jsonl").is_file()
                                              and len(metrics(run_dir)) >= logged + 3):
            time.sleep(0.2)
        process.send_signal(signum)
        output, _ = process.communicate(timeout=120)
        assert process.returncode == exit_code, output[-3000:]
        assert f"stopped by {signum.name}" in output
        final = checkpoint_dirs.latest_complete(run_dir / checkpoint_dirs.CHECKPOINTS_DIR)
        assert final is not None
        marker = checkpoint_dirs.read_complete_marker(final)
        assert 3 <= marker["step"] < 5000 and final.name == checkpoint_dirs.step_tag(marker["step"])
        ending = {"stopped_by": "signal", "signal": signum.name}
        assert {key: marker.get(key) for key in ending} == ending
        assert metrics(run_dir)[-1] == {"step": marker["step"], **ending}
    step = marker["step"]
    run_train(config("signalled"), run_dir, "--set", f"train.exit_interval={step + 2}")
    run_train(config("straight", exit_interval=step + 2), tmp_path / "straight")
    tag = checkpoint_dirs.step_tag(step + 2)
    assert_bitwise_equal(weights(run_dir / "checkpoints" / tag), weights(tmp_path / "straight/checkpoints" / tag))


def test_nonfinite_loss_is_skipped_and_counted(training_corpus, tmp_path: Path) -> None:
    mix, cache = training_corpus
    config = write_config(tmp_path / "config.yml",
                          tiny_train_config(mix, cache, fault_injection={"nonfinite_loss_steps": [3]}))
    result = run_train(config, tmp_path / "run")
    rows = metrics(tmp_path / "run")
    assert any(r["step"] == 3 and r.get("nonfinite_loss") for r in rows)
    assert rows[-1]["step"] == 8 and "skipped updates 1" in result.stdout
    assert checkpoint_dirs.read_complete_marker(tmp_path / "run/checkpoints/step_00000008")["skipped_steps"] == 1
    assert 3 not in train_losses(tmp_path / "run")


def test_consecutive_nonfinite_losses_stop_the_run(training_corpus, tmp_path: Path) -> None:
    mix, cache = training_corpus
    config = write_config(tmp_path / "config.yml", tiny_train_config(
        mix, cache, max_consecutive_nonfinite=3, fault_injection={"nonfinite_loss_steps": [5, 6, 7]}))
    result = run_train(config, tmp_path / "run", check=False)
    assert result.returncode == 3
    assert "3 consecutive non-finite losses, the last at step 7" in result.stdout
    assert "last good checkpoint: " in result.stdout and "step_00000004" in result.stdout


def test_failed_save_is_reported_and_previous_checkpoint_kept(training_corpus, tmp_path: Path) -> None:
    mix, cache = training_corpus
    config = write_config(tmp_path / "config.yml", tiny_train_config(mix, cache, fault_injection={"fail_save_step": 8}))
    result = run_train(config, tmp_path / "run", check=False)
    assert result.returncode == 4  # the final save: the run ends as final_save_failed (test_checkpoint_lifecycle.py)
    assert "warning: checkpoint at step 8 failed" in result.stdout and "No space left on device" in result.stdout
    checkpoints = tmp_path / "run" / checkpoint_dirs.CHECKPOINTS_DIR
    assert not (checkpoints / "step_00000008").exists()
    assert checkpoint_dirs.latest_complete(checkpoints) == checkpoints / "step_00000004"


def test_disk_full_saves_are_dropped_then_stop_the_run_and_resume_exactly(training_corpus, baseline: Path,
                                                                           tmp_path: Path) -> None:
    """A real full disk (RLIMIT_FSIZE during the saves of steps 4 and 6): the failed writes are caught,
    the partial step dirs removed, training goes on after the first and stops cleanly after 2 in a row."""
    mix, cache = training_corpus
    faults = {"disk_full_save_steps": [4, 6], "disk_full_bytes": 0}
    config = write_config(tmp_path / "config.yml", random_config(
        mix, cache, save_interval=2, max_consecutive_failed_saves=2, fault_injection=faults))
    failed = run_train(config, tmp_path / "run", check=False)
    output = failed.stdout + failed.stderr
    assert failed.returncode == 4, output[-3000:]
    assert "Traceback" not in output
    assert "warning: checkpoint at step 4 failed on 1 rank(s) (OSError: [Errno 27] File too large" in failed.stdout
    assert "warning: checkpoint at step 6 failed" in failed.stdout
    assert "stopping: 2 consecutive checkpoint saves failed, the last at step 6" in failed.stdout
    checkpoints = tmp_path / "run" / checkpoint_dirs.CHECKPOINTS_DIR
    assert sorted(path.name for path in checkpoints.iterdir() if path.is_dir()) == ["step_00000002"]
    assert (checkpoints / checkpoint_dirs.LATEST_FILE).read_text().strip() == "step_00000002"
    resumed = run_train(write_config(tmp_path / "config.yml", random_config(mix, cache, save_interval=2)),
                        tmp_path / "run")
    assert "resumed from" in resumed.stdout and "step_00000002" in resumed.stdout
    assert_bitwise_equal(weights(checkpoints / "step_00000008"), weights(baseline / "checkpoints/step_00000008"))


@pytest.mark.parametrize(("where", "expected"), [
    # rank 0's config/MANIFEST/COMPLETE/latest writes, after both ranks wrote their files
    ({"disk_full_after_agreement": True}, "failed on 1 rank(s) (OSError: [Errno 27] File too large"),
    # rank 1's optimizer-state write inside engine.save_checkpoint, between DeepSpeed's own barriers
    ({"disk_full_rank": 1}, "failed on 1 rank(s); removed"),
], ids=["rank0_after_agreement", "rank1_inside_deepspeed"])
def test_two_ranks_one_rank_write_failing_neither_rank_hangs(training_corpus, tmp_path: Path, where: dict,
                                                             expected: str) -> None:
    """One rank's write of step 2 hits a real file-size limit: both ranks agree the save failed and train on;
    step 4 saves normally, its manifest listing both ranks' files."""
    from megatron_lite.checkpoint_integrity import read_manifest

    mix, cache = training_corpus
    faults = {"disk_full_save_steps": [2], "disk_full_bytes": 0, **where}
    config = write_config(tmp_path / "config.yml", tiny_train_config(
        mix, cache, train_iters=4, save_interval=2, eval_interval=0, zero_stage=2, gradient_accumulation_steps=1,
        fault_injection=faults))
    started = time.perf_counter()
    result = run_train(config, tmp_path / "run", ranks=2, timeout=240)
    elapsed = time.perf_counter() - started
    output = result.stdout + result.stderr
    assert f"warning: checkpoint at step 2 {expected}" in result.stdout
    assert "Traceback" not in output
    checkpoints = tmp_path / "run" / checkpoint_dirs.CHECKPOINTS_DIR
    assert not (checkpoints / "step_00000002").exists()
    assert checkpoint_dirs.latest_complete(checkpoints) == checkpoints / "step_00000004"
    assert {record.rank for record in (read_manifest(checkpoints / "step_00000004") or {}).values()} == {0, 1}
    assert sorted(train_losses(tmp_path / "run")) == [1, 2, 3, 4]
    assert elapsed < 180, f"{elapsed:.0f} s"


def test_resume_with_another_model_shape_is_a_clear_error(training_corpus, baseline: Path, tmp_path: Path) -> None:
    mix, cache = training_corpus
    wider = tiny_train_config(mix, cache)
    wider["model"]["hidden_size"] = 128
    result = run_train(write_config(tmp_path / "config.yml", wider), tmp_path / "run", "--resume", str(baseline),
                       check=False)
    assert result.returncode == 2
    assert "cannot resume from" in result.stderr and "model shape differs" in result.stderr
    assert "embed_in.weight: checkpoint (384, 64) vs config (384, 128)" in result.stderr


@pytest.mark.parametrize("change, expected", [
    ({"train": {"train_batch_size": 10}}, "train.train_batch_size=10 != train.train_micro_batch_size_per_gpu=4 x "
                                          "train.gradient_accumulation_steps=2 x 1 data-parallel ranks = 8"),
    ({"train": {"learning_rate": 1}}, "unknown config key train.learning_rate"),
    ({"data": {"mix": "/nonexistent/mix.yml"}}, "/nonexistent/mix.yml"),
])
def test_config_errors_are_one_line(training_corpus, tmp_path: Path, change: dict, expected: str) -> None:
    mix, cache = training_corpus
    data = tiny_train_config(mix, cache)
    for section, values in change.items():
        data[section].update(values)
    result = run_train(write_config(tmp_path / "config.yml", data), tmp_path / "run", check=False)
    assert result.returncode == 2
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and expected in error_lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_init_from_starts_with_the_given_weights(training_corpus, baseline: Path, tmp_path: Path) -> None:
    mix, cache = training_corpus
    config = write_config(tmp_path / "config.yml", tiny_train_config(
        mix, cache, train_iters=2, eval_interval=0, save_interval=0, init_from=str(baseline)))
    result = run_train(config, tmp_path / "run")
    assert "initialised weights from" in result.stdout
    assert "optimizer groups: decay " in result.stdout and "; no_decay " in result.stdout  # start-up line
    # Step 1 sees the same first batch as the baseline's step 1, now with trained weights.
    assert train_losses(tmp_path / "run")[1] < train_losses(baseline)[8] + 0.3 < train_losses(baseline)[1]


def test_resume_checks_the_runs_identity(training_corpus, baseline: Path, tmp_path: Path) -> None:
    """From the baseline's step 4: another position scheme stops in one short line; another tokenizer (a cache
    whose SentencePiece model trained on fewer characters) stops naming both files, and with
    train.allow_tokenizer_change trains on, metrics.jsonl recording the change."""
    mix, cache = training_corpus
    config = write_config(tmp_path / "config.yml", random_config(mix, cache))
    step_4 = str(baseline / "checkpoints/step_00000004")
    scheme = run_train(config, tmp_path / "run", "--resume", step_4, "--set", "model.position.scheme=rope", check=False)
    errors = [line for line in scheme.stderr.splitlines() if line.startswith("error:")]
    assert scheme.returncode == 2 and len(errors) == 1, scheme.stderr[-2000:]
    assert "model.position.scheme: checkpoint 'coca', config 'rope'" in errors[0] and len(errors[0]) < 200

    other = ["--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "data.tokenizer.sample_chars=60000"]
    refused = run_train(config, tmp_path / "run", "--resume", step_4, *other, check=False)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert refused.returncode == 2 and len(errors) == 1, refused.stderr[-2000:]
    assert f"{step_4}/tokenizer.model" in errors[0] and f"{tmp_path / 'cache'}/tokenizer/tokenizer.model" in errors[0]
    assert "train.allow_tokenizer_change=true" in errors[0]
    allowed = run_train(config, tmp_path / "run", "--resume", step_4, *other, "--set",
                        "train.allow_tokenizer_change=true")
    assert "warning: train.allow_tokenizer_change: training on with another tokenizer" in allowed.stdout
    change = next(row for row in metrics(tmp_path / "run") if "tokenizer_change" in row)
    assert change["step"] == 4 and change["tokenizer_change"]["checkpoint"] == f"{step_4}/tokenizer.model"
    assert sorted(train_losses(tmp_path / "run")) == [5, 6, 7, 8]
