"""A step's evaluations: which are due, running them (a stop signal drops the rest), and which a resumed step lacks.

A signal received before or during a step's evaluations drops them and the step's checkpoint is saved at once
(docs/training.md, "Stopping and exit codes"). A run resumed from that checkpoint runs them first, before its
next step: the due evaluations without a row at that step in the run's metrics.jsonl. They draw no random
numbers that training keeps (the loop restores the checkpoint's generators after them), so the steps that follow
are the uninterrupted run's, and the curve keeps its point.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

from megatron_lite.config import Config
from megatron_lite.training import metrics as metrics_lib
from megatron_lite.training.checkpointing import TrainingState
from megatron_lite.training.data import validates
from megatron_lite.training.distributed import DistributedInfo, all_reduce_sum
from megatron_lite.training.engine import StagedEngine
from megatron_lite.training.extrapolation import ExtrapolationEval, ppl_key
from megatron_lite.training.reporting import StepReport
from megatron_lite.training.stopping import EvaluationInterrupted

VALIDATION, EXTRAPOLATION = "validation", "extrapolation"
# the key of each evaluation's metrics.jsonl row
ROW_KEYS = {VALIDATION: "val_loss", EXTRAPOLATION: ppl_key(1)}


def due_evaluations(config: Config, step: int, total_steps: int) -> list[str]:
    """The evaluations due after ``step`` (each at its interval, and at the run's last step), in the order they
    run: validation where the run has a validation set (``validates``), the long-context curve where it is on."""
    last = step == total_steps
    due = []
    if validates(config) and (step % config.train.eval_interval == 0 or last):
        due.append(VALIDATION)
    interval = config.train.extrapolation_eval.interval
    if interval and (step % interval == 0 or last):
        due.append(EXTRAPOLATION)
    return due


def lacking_rows(rows: list[dict[str, Any]], step: int, due: list[str]) -> list[str]:
    """Of ``due`` (at ``step``), those without a row at that step among a run's metrics ``rows``."""
    at_step = [row for row in rows if row.get("step") == step]
    return [kind for kind in due if not any(ROW_KEYS[kind] in row for row in at_step)]


def missing_evaluations(metrics_path: Path, step: int, due: list[str], dist_info: DistributedInfo) -> list[str]:
    """``lacking_rows`` of the run's metrics.jsonl: rank 0 reads it, and every rank gets its answer (every rank
    runs every evaluation)."""
    if not due:
        return []
    missing = [0.0] * len(due)
    if dist_info.is_main:
        lacking = lacking_rows(metrics_lib.read_metrics(metrics_path), step, due)
        missing = [float(kind in lacking) for kind in due]
    if dist_info.world_size > 1:
        missing = all_reduce_sum(missing, dist_info.device)
    return [kind for kind, flag in zip(due, missing) if flag > 0]


def run_evaluations(kinds: list[str], staged: StagedEngine, report: StepReport, state: TrainingState,
                    valid_loader: DataLoader | None, extrapolation: ExtrapolationEval | None,
                    check_interrupt: Callable[[], None]) -> tuple[float | None, bool]:
    """``kinds`` at ``state.step``, each logging its row; returns (the validation loss, if validation ran to its
    end; whether a stop signal dropped what was left: ``check_interrupt`` raised)."""
    val_loss = None
    try:
        with staged.evaluating():
            if VALIDATION in kinds:
                assert valid_loader is not None
                val_loss = report.validation(staged.engine, valid_loader, state.step, check_interrupt)
            if EXTRAPOLATION in kinds:
                assert extrapolation is not None
                report.extrapolation(extrapolation, staged.engine, state, check_interrupt)
    except EvaluationInterrupted:
        return val_loss, True
    return val_loss, False
