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
from torch.utils.data import DataLoader

from megatron_lite.config import TrainConfig
from megatron_lite.training import metrics as metrics_lib
from megatron_lite.training.checkpointing import TrainingState
from megatron_lite.training.distributed import DistributedInfo, all_reduce_sum
from megatron_lite.training.engine import StagedEngine
from megatron_lite.training.extrapolation import ExtrapolationEval, ppl_key
from megatron_lite.training.reporting import StepReport
from megatron_lite.training.stopping import EvaluationInterrupted

VALIDATION, EXTRAPOLATION = "validation", "extrapolation"
# the key of each evaluation's metrics.jsonl row
ROW_KEYS = {VALIDATION: "val_loss", EXTRAPOLATION: ppl_key(1)}


def due_evaluations(train: TrainConfig, step: int, total_steps: int, validates: bool,
                    extrapolation: ExtrapolationEval | None) -> list[str]:
    """The evaluations due after ``step`` (every interval, and at the run's last step), in the order they run.
    ``validates``: the run has a validation set (train.eval_interval set, and data to hold out)."""
    last = step == total_steps
    due = []
    if validates and train.eval_interval and (step % train.eval_interval == 0 or last):
        due.append(VALIDATION)
    if extrapolation is not None and extrapolation.due(step, last):
        due.append(EXTRAPOLATION)
    return due


def missing_evaluations(metrics_path: Path, step: int, due: list[str], dist_info: DistributedInfo) -> list[str]:
    """Of ``due`` (at ``step``), those without a row at that step in ``metrics_path``: rank 0 reads it, and every
    rank gets its answer (every rank runs every evaluation)."""
    if not due:
        return []
    missing = [0.0] * len(due)
    if dist_info.is_main:
        rows = [row for row in metrics_lib.read_metrics(metrics_path) if row.get("step") == step]
        missing = [0.0 if any(ROW_KEYS[kind] in row for row in rows) else 1.0 for kind in due]
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
