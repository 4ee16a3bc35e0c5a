"""What each training step shows: the progress bar, the loss window, metrics.jsonl rows (training,
skipped, validation) and their console lines on rank 0."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch.utils.data import DataLoader

from megatron_lite.config import Config
from megatron_lite.console import console
from megatron_lite.training import metrics as metrics_lib
from megatron_lite.training.checkpointing import TrainingState
from megatron_lite.training.deepspeed_config import BatchSizes
from megatron_lite.training.distributed import DistributedInfo
from megatron_lite.training.engine import StagedEngine
from megatron_lite.training.extrapolation import PLOT_FILE, ExtrapolationEval, plot_curve
from megatron_lite.training.extrapolation import format_row as format_extrapolation_row
from megatron_lite.training.step import StepOutcome, evaluate


class _Throughput:
    def __init__(self) -> None:
        self.time = time.perf_counter()
        self.steps = 0

    def exclude_since(self, start: float) -> None:
        """Evaluation and checkpoint time is not training time."""
        self.time += time.perf_counter() - start

    def take(self) -> tuple[float, int]:
        now = time.perf_counter()
        elapsed, steps = now - self.time, self.steps
        self.time, self.steps = now, 0
        return elapsed, steps


class StepReport:
    """The run's progress bar, loss window and throughput clock; rank 0 writes and prints, the others only count."""

    def __init__(self, logger: metrics_lib.MetricsLogger, config: Config, batch_sizes: BatchSizes,
                 dist_info: DistributedInfo, start_step: int, total_steps: int) -> None:
        from tqdm import tqdm

        self.logger, self.dist_info, self.total_steps = logger, dist_info, total_steps
        self.log_interval = config.train.log_interval
        self.losses = metrics_lib.LossWindow(config.train.log_interval)
        self.throughput = _Throughput()
        self.progress = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                             disable=not dist_info.is_main, dynamic_ncols=True, file=sys.stderr, mininterval=1.0)
        self.seq_length = config.model.seq_length
        self.tokens_per_step = batch_sizes.tokens_per_step(config.model.seq_length)
        self.flops_per_step = (metrics_lib.model_flops_per_token(config.model) * self.tokens_per_step
                               if dist_info.device.type == "cuda" else None)  # TFLOP/s and MFU are GPU figures
        self.peak = metrics_lib.peak_tflops(config)

    def logs(self, step: int) -> bool:
        """Whether step ``step`` (counted from 1) writes a training row: every train.log_interval, the first, the last."""
        return step % self.log_interval == 0 or step == 1 or step == self.total_steps

    def step_taken(self, state: TrainingState, outcome: StepOutcome, consecutive_nonfinite: int) -> None:
        """``state`` counts the step; a skipped update gets its row and console line at once."""
        self.throughput.steps += 1
        self.progress.update(1)
        if outcome.finite:
            self.losses.add(state.step, outcome.loss)
            return
        self.logger.log({"step": state.step, "loss": None, "nonfinite_loss": True, "skipped_steps": state.skipped_steps})
        if self.dist_info.is_main:
            console(f"step {state.step}: non-finite loss, update skipped "
                    f"({consecutive_nonfinite} in a row, {state.skipped_steps} in total)")

    def show_loss(self, staged: StagedEngine, state: TrainingState, lr: float, outcome: StepOutcome) -> None:
        """The loss window on the progress bar and, at a logged step, in a metrics row."""
        shown_loss = self.losses.mean(state.step)
        if shown_loss is None:
            return
        self.progress.set_postfix(loss=f"{shown_loss:.4f}", lr=f"{lr:.2e}", refresh=False)
        if self.logs(state.step):
            row = self._train_row(staged.engine, state, shown_loss, lr, outcome.own_grad_norm)
            if staged.stage is not None and staged.selection is not None:
                row.update(stage=staged.stage.index + 1, trainable_parameters=staged.selection.trainable)
            self.logger.log(row)
            if self.dist_info.is_main:
                console(metrics_lib.format_row(row, self.total_steps))

    def validation(self, engine: Any, loader: DataLoader, step: int, check_interrupt: Callable[[], None]) -> float:
        val_loss = evaluate(engine, loader, self.dist_info.device, check_interrupt)
        row = {"step": step, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}
        self.logger.log(row)
        if self.dist_info.is_main:
            console(metrics_lib.format_row(row, self.total_steps))
        return val_loss

    def extrapolation(self, evaluation: ExtrapolationEval, engine: Any, state: TrainingState,
                      check_interrupt: Callable[[], None]) -> None:
        """One long-context evaluation: its metrics row, console line and the curve's plot, redrawn."""
        row = {"step": state.step, "tokens_seen": state.consumed_samples * self.seq_length,
               **evaluation.evaluate(engine, check_interrupt)}
        self.logger.log(row)
        if self.dist_info.is_main:
            console(format_extrapolation_row(row, evaluation.windows, self.total_steps))
            evaluation.warn_if_over_budget(row["extrapolation_seconds"])
            run_dir = self.logger.run_dir
            plot_curve(self.logger.path, run_dir / PLOT_FILE, f"{run_dir.name}: extrapolation while training")

    def close(self) -> None:
        self.progress.close()
        self.logger.close()

    @contextmanager
    def closed_on_error(self) -> Iterator[None]:
        """An error leaving the block closes the report first: the bar ends its line, so the ``error:`` line
        (e.g. a shard's bad token id found by the loader) prints on its own, and the metrics are flushed."""
        try:
            yield
        except BaseException:
            self.close()
            raise

    def _train_row(self, engine: Any, state: TrainingState, loss: float, lr: float,
                   own_grad_norm: float | None) -> dict[str, Any]:
        elapsed, steps = self.throughput.take()
        grad_norm = own_grad_norm if own_grad_norm is not None else engine.get_global_grad_norm()
        tflops = (None if self.flops_per_step is None  # per device
                  else self.flops_per_step * steps / max(elapsed, 1e-9) / 1e12 / max(engine.world_size, 1))
        return {
            "step": state.step, "loss": loss, "lr": lr,
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "tokens_per_sec": self.tokens_per_step * steps / max(elapsed, 1e-9),
            "tflops": tflops, "mfu": tflops / self.peak if tflops is not None and self.peak else None,
            "memory_gb": metrics_lib.memory_gb(), "skipped_steps": state.skipped_steps,
            "consumed_samples": state.consumed_samples,
        }
