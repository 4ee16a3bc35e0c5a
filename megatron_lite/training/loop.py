"""The training run: set up (data, engine, resume), the step loop, finish.

Each step is ``step.take_step``; what it shows is ``reporting.StepReport``; whether the run goes on, stops
or starts its next stage is ``stopping.StopPolicies``; the engine and its rebuild at a stage boundary are
``engine.StagedEngine``.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_lite import checkpoint_dirs
from megatron_lite import config as config_lib
from megatron_lite.config import Config
from megatron_lite.console import console, notice
from megatron_lite.model.params import counted_parameter_count
from megatron_lite.training import metrics as metrics_lib
from megatron_lite.training.checkpointer import Checkpointer
from megatron_lite.training.checkpointing import (
    ResumePlan, TrainingState, check_resume_compatible, find_resume_checkpoint, load_counters, load_training_state,
    plan_resume, restore_rng_state,
)
from megatron_lite.training.data import TrainingData, prepare_training_data
from megatron_lite.training.deepspeed_config import BatchSizes, resolve_batch_sizes
from megatron_lite.training.distributed import DistributedInfo, barrier, init_distributed
from megatron_lite.training.engine import StagedEngine, compile_announcement, resumes_weights_only, start_engine
from megatron_lite.training.evaluations import EXTRAPOLATION, due_evaluations, missing_evaluations, run_evaluations
from megatron_lite.training.exit_codes import exit_code_for
from megatron_lite.training.extrapolation import ExtrapolationEval
from megatron_lite.training.identity import TokenizerChange, tokenizer_change
from megatron_lite.training.profiling import StepProfiler, describe_window
from megatron_lite.training.reporting import StepReport
from megatron_lite.training.run_lock import hold_run_dir
from megatron_lite.training.sample_record import SampleIndexRecorder
from megatron_lite.training.schedule import run_learning_rate
from megatron_lite.training.sequence_parallel import with_sequence_parallel
from megatron_lite.training.stages import Stage, plan_stages
from megatron_lite.training.step import micro_batches, take_step
from megatron_lite.training.stopping import (
    CONTINUE, Action, Decision, StepEnd, StopPolicies, StopRequest, evaluation_interrupt_check,
)


@dataclass
class TrainingResult:
    run_dir: Path
    steps: int  # optimizer steps done when the run ended
    total_steps: int
    first_loss: float | None  # the run's first logged training loss (metrics.jsonl, resumes included; rank 0)
    final_loss: float | None  # its last logged training loss (rank 0)
    val_loss: float | None
    skipped_steps: int
    stopped_by: str  # "completed" | "already_complete" | "signal" | "exit_interval" | "nonfinite" | "failed_saves"
    # | "final_save_failed"
    last_checkpoint: Path | None
    # The signal that stopped a one-process run, exiting 128 + its number. None with several ranks: a rank exiting
    # non-zero makes the deepspeed launcher kill the others' final work (the launcher itself exits 128 + the signal
    # at once; docs/training.md, "Stopping and exit codes").
    exit_signal: str | None = None

    @property
    def exit_code(self) -> int:
        return exit_code_for(self.stopped_by, self.exit_signal)


def run_training(config: Config, run_dir: Path, resume: str = "auto", train_iters: int | None = None,
                 verify_data: bool = False, wait_for_lock: float = 0.0) -> TrainingResult:
    """Train ``config`` into ``run_dir``; see docs/training.md for everything it writes. ``verify_data``
    checks every shard even where the cache's stamp says it was verified (train.py --verify-data);
    ``wait_for_lock``: seconds to wait for another run holding ``run_dir`` (train.py --wait-for-lock)."""
    stages = plan_stages(config.train)
    train_iters = _staged_train_iters(stages, train_iters)  # ValueError before DeepSpeed starts
    dist_info = with_sequence_parallel(init_distributed(), config.train.sequence_parallel_size)
    batch_sizes = resolve_batch_sizes(config, dist_info.data_parallel_size)  # ValueError before any work
    with hold_run_dir(run_dir, dist_info.is_main, dist_info.device, wait_for_lock):  # before anything is written
        return _train(config, run_dir, dist_info, batch_sizes, stages, resume, train_iters, verify_data)


def _train(config: Config, run_dir: Path, dist_info: DistributedInfo, batch_sizes: BatchSizes, stages: list[Stage],
           resume: str, train_iters: int | None, verify_data: bool) -> TrainingResult:
    """The run, once rank 0 holds the run dir's lock: data, engine, resume, the step loop, finish."""
    run_dir.mkdir(parents=True, exist_ok=True)
    data = prepare_training_data(config, batch_sizes, dist_info, train_iters, verify_data=verify_data)
    if stages:
        data = dataclasses.replace(data, steps_source=f"the sum of {len(stages)} train.stages")
    config = _with_train_iters(config, data.total_steps)  # the run's copy, so config.yml and checkpoints record them
    # the held-out books read now: a missing or short one stops the run before DeepSpeed starts
    extrapolation = (ExtrapolationEval.from_run(config, data.tokenizer_path, dist_info.device)
                     if config.train.extrapolation_eval.interval else None)

    resume_dir = find_resume_checkpoint(resume, run_dir, dist_info)
    marker: dict[str, Any] = {}
    redo: list[str] = []  # the evaluations due at the resumed step without a row (a stop dropped them)
    if resume_dir is not None:
        check_resume_compatible(resume_dir, config)
        marker = checkpoint_dirs.read_complete_marker(resume_dir)
        if marker["step"] <= data.total_steps:
            redo = missing_evaluations(run_dir / "metrics.jsonl", marker["step"],
                                       due_evaluations(config, marker["step"], data.total_steps), dist_info)
        if marker["step"] >= data.total_steps and not redo:
            return _already_complete(run_dir, resume_dir, marker, data.total_steps, dist_info)
    changed_tokenizer = _tokenizer_change(config, resume_dir, data.tokenizer_path)
    # decided before deepspeed.initialize, which fixes checkpoint.load_universal
    plan = (plan_resume(resume_dir, marker, config, dist_info)
            if resume_dir is not None and not resumes_weights_only(stages, resume_dir, marker) else None)
    staged, _ = start_engine(config, batch_sizes, dist_info, stages, resume_dir, marker,
                             load_universal=plan is not None and plan.universal)
    state = _starting_state(staged, resume_dir, plan, data.total_steps)
    if dist_info.is_main:  # only now, every check passed: a refused run leaves its run dir as it was
        config_lib.save(config, run_dir / checkpoint_dirs.CONFIG_FILE)
        checkpoint_dirs.remove_abandoned_saves(run_dir / checkpoint_dirs.CHECKPOINTS_DIR)  # ours: we hold the lock
    train_loader, valid_loader = data.loaders(config, batch_sizes, dist_info, state.consumed_samples)
    logger = metrics_lib.MetricsLogger(config, run_dir, enabled=dist_info.is_main, start_step=state.step)
    if dist_info.is_main:
        _announce(config, batch_sizes, data, staged, run_dir, resume_dir, state, logger.dropped_rows)
        if extrapolation is not None:
            console(extrapolation.describe())
        if config.train.profile.start_step:
            console(describe_window(config.train.profile, state.step, data.total_steps, run_dir))
    if changed_tokenizer is not None:
        logger.log(changed_tokenizer.metrics_row(state.step))
        if dist_info.is_main:
            notice(f"train.allow_tokenizer_change: training on with another tokenizer: the checkpoint's "
                   f"{changed_tokenizer.describe()}")

    result = TrainingResult(run_dir, state.step, data.total_steps, None, None, None, state.skipped_steps, "completed",
                            resume_dir)
    train = config.train
    policies = StopPolicies(train, data.total_steps, [stage.end for stage in stages], last_good=lambda:
                            checkpoint_dirs.latest_complete(run_dir / checkpoint_dirs.CHECKPOINTS_DIR))
    report = StepReport(logger, config, batch_sizes, dist_info, state.step, data.total_steps)
    checkpointer = Checkpointer(staged, run_dir, config, data.tokenizer_path, dist_info, policies)
    injected = set(train.fault_injection.nonfinite_loss_steps)
    iterator = iter(train_loader)
    samples = SampleIndexRecorder(run_dir, dist_info, train.record_sample_indices, state.step)
    decision = CONTINUE
    profiler = StepProfiler(train.profile, run_dir, dist_info.rank, dist_info.device)
    with StopRequest() as stop, report.closed_on_error(), profiler:
        def evaluate(kinds: list[str]) -> bool:
            """``kinds`` at this step, their rows logged; whether a stop signal dropped them. A signal, received
            before or during an evaluation, drops it: a scheduler's grace period is short. With
            train.fault_injection.sigterm_during_evaluation_step at this step rank 0 sends itself one first."""
            inject = dist_info.is_main and train.fault_injection.sigterm_during_evaluation_step == state.step
            val_loss, dropped = run_evaluations(kinds, staged, report, state, valid_loader, extrapolation,
                                                evaluation_interrupt_check(stop, dist_info.device,
                                                                           dist_info.world_size, inject))
            result.val_loss = result.val_loss if val_loss is None else val_loss
            return dropped

        side_work_start = time.perf_counter()
        if extrapolation is not None and state.step == 0 and train.extrapolation_eval.at_start:
            if evaluate([EXTRAPOLATION]):  # the first step sees the signal and saves
                _say_evaluation_dropped(dist_info, state.step, stop)
        if redo:  # the resumed step's evaluations that a stop dropped, before the next step
            if dist_info.is_main:
                console(f"step {state.step}: due at this step and not in metrics.jsonl: {', '.join(redo)}; "
                        "evaluating before the next step")
            if evaluate(redo):  # stopped again: before any step, so the next resume redoes them again
                decision = Decision(Action.STOP, "signal", f"stopped by {stop.received(on_any_rank=True)} at step "
                                    f"{state.step}, during its redone evaluation (dropped again: the next resume "
                                    "redoes it); resume with --resume auto")
        report.throughput.exclude_since(side_work_start)
        if resume_dir is not None:  # after the redone evaluations: training goes on with the checkpoint's generators
            restore_rng_state(resume_dir, dist_info, config.seed, state.step)
        while decision.action is not Action.STOP and state.step < data.total_steps:
            lr = run_learning_rate(state.step, data.total_steps, train)
            batches = micro_batches(iterator, batch_sizes.gradient_accumulation_steps)
            samples.record(state.step + 1, batches)
            profiler.before_step(state.step + 1)
            outcome = take_step(staged, batches, lr,
                                inject_nonfinite=(state.step + 1) in injected,
                                signalled_here=stop.signal_name is not None, logged=report.logs(state.step + 1))
            state.step += 1
            state.consumed_samples += batch_sizes.global_batch_size
            state.skipped_steps += 0 if outcome.finite else 1
            decision = policies.after_update(state.step, outcome.finite)
            report.step_taken(state, outcome, policies.consecutive_nonfinite)
            if decision.action is Action.STOP:
                break
            report.show_loss(staged, state, lr, outcome)
            if train.fault_injection.kill_after_step == state.step:
                os.kill(os.getpid(), signal.SIGKILL)
            end = policies.step_end(state.step, stop.received(on_any_rank=outcome.signalled))
            side_work_start = time.perf_counter()
            profiler.after_step(state.step)  # the window's last step: its files written, not training time
            due = due_evaluations(config, state.step, data.total_steps)
            if due and evaluate(due):
                _say_evaluation_dropped(dist_info, state.step, stop)
                end = policies.step_end(state.step, stop.received(on_any_rank=True))
            decision = checkpointer.after_step(end, state, _ending_at(end, stop.signal_name))
            if decision.action is Action.NEXT_STAGE:
                staged.next_stage(checkpointer.last_saved, state.step)
                state.stage = staged.stage_index
            report.throughput.exclude_since(side_work_start)
            if decision.action is Action.STOP:
                break
        decision = checkpointer.finish(decision)
    result.last_checkpoint = checkpointer.last_saved or result.last_checkpoint
    return _finish(result, decision, state, report, dist_info, stop.signal_name)


def _staged_train_iters(stages: list[Stage], train_iters: int | None) -> int | None:
    """With train.stages the run is their steps (--train-iters may only repeat that); else unchanged."""
    if not stages:
        return train_iters
    total = stages[-1].end
    if train_iters is not None and train_iters != total:
        raise ValueError(f"--train-iters {train_iters} conflicts with train.stages, whose steps sum to {total}")
    return total


def _tokenizer_change(config: Config, resume_dir: Path | None, run_tokenizer: Path) -> TokenizerChange | None:
    """The tokenizer of the checkpoint the run continues from (its resume, else train.init_from's) against
    the run's: None when the same; ValueError unless train.allow_tokenizer_change (identity.tokenizer_change)."""
    allowed = config.train.allow_tokenizer_change
    if resume_dir is not None:
        return tokenizer_change(resume_dir, run_tokenizer, allowed, f"cannot resume from {resume_dir}")
    if config.train.init_from:
        source = checkpoint_dirs.resolve_checkpoint(config.train.init_from)
        return tokenizer_change(source, run_tokenizer, allowed, f"train.init_from={config.train.init_from}")
    return None


def _with_train_iters(config: Config, total_steps: int) -> Config:
    """A copy of ``config`` whose train.train_iters is the run's resolved step count; ``config`` stays as validated."""
    return dataclasses.replace(config, train=dataclasses.replace(config.train, train_iters=total_steps))


def _starting_state(staged: StagedEngine, resume_dir: Path | None, plan: ResumePlan | None, total_steps: int
                    ) -> TrainingState:
    """Fresh counters, or the checkpoint's: with DeepSpeed's model and optimizer state (``plan``), or (at a
    stage's start) the counters only."""
    state = TrainingState(total_steps=total_steps)
    if resume_dir is not None:
        state = (load_training_state(staged.engine, plan, staged.optimizer) if plan is not None
                 else load_counters(resume_dir))
        state.total_steps = total_steps
    state.stage = staged.stage_index
    return state


def _announce(config: Config, batch_sizes: BatchSizes, data: TrainingData, staged: StagedEngine, run_dir: Path,
              resume_dir: Path | None, state: TrainingState, dropped_rows: int) -> None:
    """Rank 0's header: the model, batch, steps and run dir; the stage and optimizer groups; dropped rows; and,
    for a compiled run, that the first step compiles."""
    dist_info = staged.dist_info
    console(
        f"model: {counted_parameter_count(config.model):,} parameters, scheme {config.model.position.label}, "
        f"precision {config.precision}{_compiled_label(staged)}, ZeRO {config.train.zero_stage}, "
        f"{dist_info.world_size} rank(s)"
        + (f" (sequence parallel {dist_info.sequence_parallel_size})" if dist_info.sequence_parallel_size > 1 else "")
        + " on "
        f"{dist_info.device.type}; {batch_sizes.describe()}; {data.total_steps} steps "
        f"({data.steps_source}); run dir {run_dir}"
        + (f"; resumed from {resume_dir} at step {state.step}" if resume_dir else ""))
    staged.log_stage()
    if dropped_rows:
        console(f"metrics.jsonl: dropped {dropped_rows} row(s) logged after step {state.step} "
                "by an earlier attempt (those steps are redone)")
    if staged.compiled:  # last, just before the first step: the long wait follows it
        console(compile_announcement(config.train.compile_mode, staged.cuda_graphs,
                                     config.train.compile_cpp_wrapper, config.train.compile_blocks_per_region))


def _compiled_label(staged: StagedEngine) -> str:
    return " (compiled, CUDA graphs)" if staged.cuda_graphs else " (compiled)" if staged.compiled else ""


def _say_evaluation_dropped(dist_info: DistributedInfo, step: int, stop: StopRequest) -> None:
    if dist_info.is_main:
        then = "its checkpoint saved first" if step else "the first step is saved and the run stops"
        console(f"step {step}: {stop.received(on_any_rank=True)} received: the step's evaluation is dropped, {then}")


def _ending(stopped_by: str, signal_name: str | None) -> dict[str, str]:
    """How a run ended, as its final checkpoint's COMPLETE marker and its last metrics.jsonl row record it."""
    signalled = stopped_by in ("signal", "final_save_failed") and signal_name
    return {"stopped_by": stopped_by, **({"signal": signal_name} if signalled else {})}


def _ending_at(end: StepEnd, signal_name: str | None) -> dict[str, str] | None:
    """The ending a step's checkpoint records: a requested stop's, the final step's, else none."""
    if end.requested_stop is not None:
        return _ending(end.requested_stop.stopped_by, signal_name)
    return _ending("completed", None) if end.last else None


def _finish(result: TrainingResult, decision: Decision, state: TrainingState, report: StepReport,
            dist_info: DistributedInfo, signal_name: str | None) -> TrainingResult:
    """The ended loop's result (why it stopped, if early; its counters), its last metrics row saying so
    (``stopped_by``) and rank 0's loss curve and summary."""
    if decision.action is Action.STOP:
        if dist_info.is_main:
            console(decision.message)
        result.stopped_by = decision.stopped_by
        if decision.names_last_good:
            result.last_checkpoint = decision.last_good
        if decision.stopped_by == "signal" and dist_info.world_size == 1:
            result.exit_signal = signal_name
    row: dict[str, Any] = {"step": state.step, **_ending(result.stopped_by, signal_name)}
    if decision.names_last_good:  # a failure stop: where a resume would start
        row["last_checkpoint"] = str(decision.last_good) if decision.last_good else None
    report.logger.log(row)
    report.close()
    result.steps, result.skipped_steps = state.step, state.skipped_steps
    if dist_info.is_main:
        run_dir = result.run_dir
        curve = metrics_lib.plot_loss_curve(report.logger.path, run_dir / "loss_curve.png", f"{run_dir.name}: loss")
        _print_summary(result, run_dir, curve)
    # No rank returns (and exits, non-zero for a failure stop) before rank 0 has written the closing row: the
    # deepspeed launcher kills the other ranks when one exits non-zero.
    barrier()
    return result


def _already_complete(run_dir: Path, step_dir: Path, marker: dict[str, Any], total_steps: int,
                      dist_info: DistributedInfo) -> TrainingResult:
    """Re-invoking a finished run: say so, repeat its summary, train nothing."""
    result = TrainingResult(run_dir, marker["step"], total_steps, None, None, None, marker.get("skipped_steps", 0),
                            "already_complete", step_dir)
    if dist_info.is_main:
        console(f"already complete at step {marker['step']}/{total_steps} ({step_dir}): nothing to "
                "train; raise --train-iters to train further")
        curve = run_dir / "loss_curve.png"
        _print_summary(result, run_dir, curve if curve.is_file() else None)
    return result


def _print_summary(result: TrainingResult, run_dir: Path, curve: Path | None) -> None:
    """Fill in the run's first/final loss and print the summary; both from metrics.jsonl, so a resumed
    run reports its whole history."""
    rows = metrics_lib.read_metrics(run_dir / "metrics.jsonl")
    logged = [row["loss"] for row in rows if row.get("loss") is not None]
    result.first_loss, result.final_loss = (logged[0], logged[-1]) if logged else (None, None)
    lines = [
        f"done: {result.stopped_by.replace('_', ' ')} at step {result.steps}/{result.total_steps}; "
        f"{metrics_lib.loss_summary(rows)}; skipped updates {result.skipped_steps}",
        f"  checkpoint  {result.last_checkpoint or 'none'}",
        f"  metrics     {run_dir / 'metrics.jsonl'}",
        f"  config      {run_dir / checkpoint_dirs.CONFIG_FILE}",
    ]
    if curve is not None:
        lines.append(f"  loss curve  {curve}")
    if (run_dir / "wandb").is_dir():
        lines.append(f"  wandb       {run_dir / 'wandb'}")
    print("\n".join(lines), flush=True)
