"""Training the four models: skip finished ones, resume interrupted ones, log train.py's output."""

from __future__ import annotations

import os
import shlex
import signal
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_lite import checkpoint_dirs
from megatron_lite.config import Config
from megatron_lite.repro.settings import (REPO_ROOT, ReproSettings, all_overrides, config_path, log,
                                          curve_interval, speedrun_save_interval)
from megatron_lite.repro.settings import run_dir as run_dir_of
from megatron_lite.training.deepspeed_config import resolve_batch_sizes

TRAIN_COMMAND_RANKS = 1  # cpu-tiny / gpu-speedrun: train.py as one process (no launcher), one data-parallel rank


class TrainingFailed(RuntimeError):
    """train.py exited with an error, or stopped before train_iters."""


@dataclass(frozen=True)
class TrainingStatus:
    step: int  # step of the latest complete checkpoint; 0 when there is none
    checkpoint: Path | None
    finished: bool  # that checkpoint is the final one (step == train_iters) and, given the config, has its evaluations
    data_parallel_size: int  # the ranks that trained it (its COMPLETE marker's world_size)


def training_status(directory: Path, train_iters: int, config: Config | None = None) -> TrainingStatus:
    """Where the run in ``directory`` stands; with its ``config``, a final checkpoint whose step lacks an
    evaluation row (a stop dropped it: train.py runs it when resumed) is not finished."""
    latest = checkpoint_dirs.latest_complete(directory / checkpoint_dirs.CHECKPOINTS_DIR)
    if latest is None:
        return TrainingStatus(0, None, False, TRAIN_COMMAND_RANKS)
    marker = checkpoint_dirs.read_complete_marker(latest)
    step = int(marker["step"])
    finished = step == train_iters
    if finished and config is not None:
        from megatron_lite.training.evaluations import due_evaluations, lacking_rows
        from megatron_lite.training.metrics import read_metrics

        finished = not lacking_rows(read_metrics(directory / "metrics.jsonl"), step,
                                    due_evaluations(config, step, train_iters))
    return TrainingStatus(step, latest, finished, int(marker.get("world_size", TRAIN_COMMAND_RANKS)))


def launched_through_deepspeed(settings: ReproSettings) -> bool:
    """paper-350m starts train.py through the deepspeed launcher (every rank); the others run it as one process."""
    return settings.profile == "paper-350m"


def train_command(settings: ReproSettings, scheme: str, train_iters: int, run_dir: Path | None = None) -> list[str]:
    directory = run_dir or run_dir_of(settings, scheme)
    if launched_through_deepspeed(settings):
        from megatron_lite.repro import paper

        command = paper.launcher_prefix(settings, paper.world_size(settings))
    else:
        command = [settings.python]
    command += [str(REPO_ROOT / "train.py"), "--config", str(config_path(settings, scheme)),
                "--run-dir", str(directory), "--resume", "auto", "--train-iters", str(train_iters)]
    for override in all_overrides(settings):
        command += ["--set", override]
    if settings.profile == "gpu-speedrun":
        command += ["--set", f"train.save_interval={speedrun_save_interval(train_iters)}",
                    "--set", f"train.extrapolation_eval.interval={curve_interval(train_iters, settings.budget)}"]
    return command


class _TerminationForwarder:
    """SIGTERM (a scheduler's or ``timeout``'s) reaches only this process, not train.py: pass it on, so
    train.py saves a checkpoint and exits, then stop like Ctrl-C once it has.

    Through the deepspeed launcher on one node (``to_ranks``) the signal goes to the ranks, the children of
    its launch.py: the runner would die of it without passing it on, and launch.py would pass it on to
    every process below the ranks too (the DataLoader workers, whose death stops a rank before it saves)."""

    def __init__(self, process: subprocess.Popen, to_ranks: bool = False) -> None:
        self.process = process
        self.to_ranks = to_ranks
        self.received = False

    def __enter__(self) -> _TerminationForwarder:
        self.previous = signal.signal(signal.SIGTERM, self._forward)
        return self

    def _forward(self, signum: int, frame: object) -> None:
        self.received = True
        ranks = self._ranks() if self.to_ranks else []
        for rank in ranks:
            rank.send_signal(signal.SIGTERM)
        if not ranks:
            self.process.send_signal(signal.SIGTERM)

    def _ranks(self) -> list[Any]:
        import psutil  # a DeepSpeed requirement

        try:
            return [rank for launch in psutil.Process(self.process.pid).children() for rank in launch.children()]
        except psutil.Error:
            return []

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGTERM, self.previous)


def run_logged(command: Sequence[str], log_path: Path, echo: bool, threads: int,
               extra_env: dict[str, str] | None = None, signal_ranks: bool = False) -> int:
    """Run ``command`` with ``threads`` OpenMP/MKL threads, appending its output to ``log_path`` (and to
    stdout when ``echo``); returns its exit code.

    Ctrl-C reaches train.py too (same process group); a SIGTERM to us is forwarded (``signal_ranks``: to the
    ranks the deepspeed launcher started). Either way train.py saves a checkpoint and exits, we wait for it,
    and KeyboardInterrupt stops the reproduction.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           **(extra_env or {})}
    if not echo:
        env["TQDM_DISABLE"] = "1"
    with log_path.open("ab") as log_file:
        log_file.write(f"\n$ {shlex.join(command)}\n".encode())
        log_file.flush()
        process = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        assert process.stdout is not None
        descriptor = process.stdout.fileno()

        def pump() -> None:
            while chunk := os.read(descriptor, 65536):
                log_file.write(chunk)
                if echo:
                    sys.stdout.buffer.write(chunk)
                    sys.stdout.flush()

        with _TerminationForwarder(process, to_ranks=signal_ranks) as termination:
            try:
                pump()
            except KeyboardInterrupt:
                pump()  # train.py is saving its checkpoint; keep its pipe drained until it exits
                process.wait()
                raise
            code = process.wait()
            process.stdout.close()
        if termination.received:
            raise KeyboardInterrupt
        return code


def _log_tail(path: Path, num_lines: int = 15) -> str:
    lines = [line for line in path.read_text(errors="replace").replace("\r", "\n").splitlines() if line.strip()]
    return "\n".join(lines[-num_lines:])


def tokens_per_step(config: Config, data_parallel_size: int) -> int:
    """Tokens of one optimizer step of ``config`` trained on ``data_parallel_size`` ranks."""
    return resolve_batch_sizes(config, data_parallel_size).tokens_per_step(config.model.seq_length)


def steady_median(rows: Sequence[dict[str, Any]], key: str) -> float | None:
    """Median ``key`` of the logged intervals after the first (which holds the compile and warm-up)."""
    values = [row[key] for row in rows if row.get(key)]
    return float(statistics.median(values[1:] or values)) if values else None


def steady_tokens_per_second(rows: Sequence[dict[str, Any]]) -> float | None:
    """Median steady tokens/s (``steady_median``)."""
    return steady_median(rows, "tokens_per_sec")


def training_summary(directory: Path, config: Config, train_iters: int, action: str) -> dict[str, Any]:
    """What the run reports about itself: steps, tokens, the last training and validation loss, steady
    tokens/s and MFU, peak memory (GB)."""
    from megatron_lite.model.params import counted_parameter_count
    from megatron_lite.training.extrapolation import curve_rows
    from megatron_lite.training.metrics import read_metrics

    status = training_status(directory, train_iters)
    metrics_path = directory / "metrics.jsonl"
    rows = read_metrics(metrics_path) if metrics_path.is_file() else []
    losses = [row for row in rows if row.get("loss") is not None]
    validation = [row for row in rows if row.get("val_loss") is not None]
    rate, mfu = steady_tokens_per_second(rows), steady_median(rows, "mfu")  # MFU: logged on CUDA only
    memory = [row["memory_gb"] for row in rows if row.get("memory_gb") is not None]
    return {"action": action, "display_name": config.model.position.display_name,
            "rotary": config.model.uses_rotary, "steps": status.step,
            "tokens": status.step * tokens_per_step(config, status.data_parallel_size),
            "parameters": counted_parameter_count(config.model),
            "final_train_loss": losses[-1]["loss"] if losses else None,
            "final_val_loss": validation[-1]["val_loss"] if validation else None,
            "final_val_ppl": validation[-1].get("val_ppl") if validation else None,
            "tokens_per_sec": None if rate is None else round(rate, 1),
            "mfu": None if mfu is None else round(mfu, 4), "peak_memory_gb": max(memory) if memory else None,
            "checkpoint": str(status.checkpoint) if status.checkpoint else None,
            "extrapolation_curve": curve_rows(rows)}  # train.extrapolation_eval's rows; [] when it was off


def train_scheme(settings: ReproSettings, scheme: str, config: Config, train_iters: int,
                 extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """Skip a finished model, else run train.py (resuming from the latest complete checkpoint)."""
    directory = run_dir_of(settings, scheme)
    before = training_status(directory, train_iters, config)
    if before.step > train_iters:
        raise ValueError(f"--train-iters {train_iters}: {directory} already holds a checkpoint at step {before.step}; "
                         "use the original --train-iters or a fresh --out")
    if before.finished:
        log(settings, f"train {scheme}: finished ({before.checkpoint}), skipped")
        return training_summary(directory, config, train_iters, "skipped (finished)")
    action = f"resumed from step {before.step}" if before.step else "trained"
    log_path = settings.out_dir / "logs" / f"train_{scheme}.log"
    log(settings, f"train {scheme}: {action.replace('trained', 'starting')}, {train_iters} steps; log {log_path}")
    exit_code = run_logged(train_command(settings, scheme, train_iters), log_path, settings.progress,
                           settings.threads, extra_env,
                           signal_ranks=launched_through_deepspeed(settings) and settings.paper.hostfile is None)
    after = training_status(directory, train_iters, config)
    if exit_code != 0:
        raise TrainingFailed(f"train.py for {scheme} exited with code {exit_code} (log {log_path}):\n"
                             f"{_log_tail(log_path)}")
    if not after.finished:
        raise TrainingFailed(f"train.py for {scheme} stopped at step {after.step} of {train_iters} (log {log_path}); "
                             "run the same command again to resume")
    return training_summary(directory, config, train_iters, action)
