"""The training run: data, DeepSpeed engine, the step loop, evaluation, checkpoints, signals.

DeepSpeed stays behind ``deepspeed.initialize`` and the engine's forward/backward/step/save/load;
``train_step`` is a plain function of (engine, micro batches).
"""

from __future__ import annotations

import contextlib
import gc
import io
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader

from megatron_lite import checkpoint_dirs
from megatron_lite import config as config_lib
from megatron_lite.config import Config
from megatron_lite.console import console, notice
from megatron_lite.model import GPT
from megatron_lite.model.params import counted_parameter_count
from megatron_lite.training import metrics as metrics_lib
from megatron_lite.training.checkpointing import (
    TrainingState, check_resume_compatible, find_resume_checkpoint, load_counters, load_training_state, save_checkpoint,
)
from megatron_lite.training.data import prepare_training_data
from megatron_lite.training.deepspeed_config import BatchSizes, deepspeed_config, resolve_batch_sizes
from megatron_lite.training.distributed import DistributedInfo, all_reduce_sum, init_distributed
from megatron_lite.training.optim import SkippableAdamW, build_optimizer
from megatron_lite.training.schedule import run_learning_rate
from megatron_lite.training.stages import Selection, Stage, apply_selection, plan_stages, select, stage_at, stage_summary
from megatron_lite.weights import load_state_dict, load_step_state_dict, load_weights

EXIT_OK = 0
EXIT_NONFINITE = 3
EXIT_FAILED_SAVES = 4


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
    last_checkpoint: Path | None

    @property
    def exit_code(self) -> int:
        return {"nonfinite": EXIT_NONFINITE, "failed_saves": EXIT_FAILED_SAVES}.get(self.stopped_by, EXIT_OK)


class StopRequest:
    """SIGTERM/SIGINT set a flag the loop checks after each step (all ranks agree via all-reduce);
    a second SIGINT interrupts at once."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def _set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def use_compile(config: Config, device: torch.device) -> bool:
    """train.compile, where null means on for CUDA and off on CPU (compiling costs more than it saves
    on CPU at the sizes that train there)."""
    return config.train.compile if config.train.compile is not None else device.type == "cuda"


def _compile_in_place(model: torch.nn.Module, config: Config, dist_info: DistributedInfo) -> bool:
    """``model.compile()``: the module's own call is compiled, so its state-dict keys stay as they are
    (no ``_orig_mod.`` prefix) and checkpoints move freely between compiled and eager runs."""
    if not use_compile(config, dist_info.device):
        return False
    if config.train.zero_stage == 3:  # ZeRO-3 gathers parameters in module hooks that a compiled graph would trace
        if dist_info.is_main:
            notice("train.compile: not with train.zero_stage=3 (its parameter-gathering hooks do not trace); "
                   "training eagerly")
        return False
    model.compile()
    return True


def train_step(engine: Any, micro_batches: list[dict[str, torch.Tensor]], device: torch.device,
               inject_nonfinite: bool = False) -> torch.Tensor:
    """Forward/backward over one step's micro batches (DeepSpeed accumulates); returns the (local)
    summed loss of the micro batches, before the optimizer step is taken or skipped by the caller."""
    losses = []
    for batch in micro_batches:
        input_ids = batch["input_ids"].to(device, non_blocking=True)  # (B, T)
        labels = batch["labels"].to(device, non_blocking=True)  # (B, T), already shifted
        loss = engine(input_ids, labels=labels)  # fused LM head + cross entropy (train.fused_loss)
        if inject_nonfinite:
            loss = loss * float("nan")
        engine.backward(loss)
        losses.append(loss.detach())
        if len(losses) < len(micro_batches):
            engine.step()  # not a boundary: DeepSpeed only counts the micro step
    return torch.stack(losses).float().sum()


@torch.no_grad()
def evaluate(engine: Any, loader: DataLoader, num_batches: int, device: torch.device) -> float:
    """Mean validation loss over ``num_batches`` micro batches per rank, averaged over ranks."""
    engine.eval()
    total, count = 0.0, 0
    for index, batch in enumerate(loader):
        if index == num_batches:
            break
        total += float(engine(batch["input_ids"].to(device), labels=batch["labels"].to(device)))
        count += 1
    engine.train()
    summed, counted = all_reduce_sum([total, float(count)], device)
    return summed / max(counted, 1.0)


def _micro_batches(iterator: Iterator[dict[str, torch.Tensor]], count: int) -> list[dict[str, torch.Tensor]]:
    try:
        return [next(iterator) for _ in range(count)]
    except StopIteration:  # the index is built for exactly total_steps; running out is a bug
        raise RuntimeError("training data ran out before the last step") from None


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


def run_training(config: Config, run_dir: Path, resume: str = "auto", train_iters: int | None = None,
                 verify_data: bool = False) -> TrainingResult:
    """Train ``config`` into ``run_dir``; see README "Training" for everything it writes. ``verify_data``
    checks every shard even where the cache's stamp says it was verified (train.py --verify-data)."""
    from megatron_lite.training import checkpoint_engine  # imports deepspeed

    dist_info = init_distributed()
    batch_sizes = resolve_batch_sizes(config, dist_info.world_size)  # ValueError before any work
    stages = plan_stages(config.train)
    train_iters = _staged_train_iters(stages, train_iters)
    run_dir.mkdir(parents=True, exist_ok=True)
    data = prepare_training_data(config, batch_sizes, dist_info, train_iters, verify_data=verify_data)
    if stages:
        data.steps_source = f"the sum of {len(stages)} train.stages"
    config.train.train_iters = data.total_steps  # resolved, so checkpoints record it
    if dist_info.is_main:
        config_lib.save(config, run_dir / checkpoint_dirs.CONFIG_FILE)

    resume_dir = find_resume_checkpoint(resume, run_dir, dist_info)
    marker: dict[str, Any] = {}
    if resume_dir is not None:
        check_resume_compatible(resume_dir, config)
        marker = checkpoint_dirs.read_complete_marker(resume_dir)
        if marker["step"] >= data.total_steps:
            return _already_complete(run_dir, resume_dir, marker, data.total_steps, dist_info)
    stage = stage_at(stages, marker.get("step", 0)) if stages else None
    # A checkpoint holds the optimizer state of the stage that wrote it (0 in older ones); one written at the
    # end of a stage starts the next stage from its weights, with a new engine and fresh optimizer state.
    weights_only = stage is not None and resume_dir is not None and marker.get("stage", 0) != stage.index
    torch.manual_seed(config.seed)
    model = _new_model(config, dist_info)
    for each in stages:  # every stage's patterns checked now, not hours later at its start
        select(model, each.trainable, _stage_key(each))
    if resume_dir is None and config.train.init_from:
        _load_initial_weights(model, config)
        if dist_info.is_main:
            console(f"initialised weights from {config.train.init_from}")
    elif weights_only:
        assert resume_dir is not None
        load_weights(model, _consolidated(resume_dir), f"stage start from {resume_dir}")
    engine, optimizer, compiled, selection = _build_engine(model, config, batch_sizes, dist_info, stage)
    del model  # the engine holds it; a stage boundary must be able to free it
    checkpoint_engine.install(engine, dist_info.rank)  # safe loads, hashed writes, no rank left in a barrier
    state = TrainingState(total_steps=data.total_steps)
    if resume_dir is not None:
        state = (load_counters(resume_dir, dist_info) if weights_only
                 else load_training_state(engine, resume_dir, dist_info))
        state.total_steps = data.total_steps
    state.stage = stage.index if stage is not None else 0
    train_loader, valid_loader = data.loaders(config, batch_sizes, dist_info, state.consumed_samples)

    logger = metrics_lib.MetricsLogger(config, run_dir, enabled=dist_info.is_main, start_step=state.step)
    tokens_per_step = batch_sizes.global_batch_size * config.model.seq_length
    flops_per_step = (metrics_lib.model_flops_per_token(config.model) * tokens_per_step
                      if dist_info.device.type == "cuda" else None)  # TFLOP/s and MFU are GPU figures
    peak = metrics_lib.peak_tflops(config)
    if dist_info.is_main:
        console(
            f"model: {counted_parameter_count(config.model):,} parameters, scheme {config.model.position.label}, "
            f"precision {config.precision}{' (compiled)' if compiled else ''}, ZeRO {config.train.zero_stage}, "
            f"{dist_info.world_size} rank(s) on "
            f"{dist_info.device.type}; batch {batch_sizes.global_batch_size} = {batch_sizes.micro_batch_size} x "
            f"{batch_sizes.gradient_accumulation_steps} x {batch_sizes.data_parallel_size}; {data.total_steps} steps "
            f"({data.steps_source}); run dir {run_dir}"
            + (f"; resumed from {resume_dir} at step {state.step}" if resume_dir else ""))
        _log_stage(stage, stages, selection, optimizer)
        if logger.dropped_rows:
            console(f"metrics.jsonl: dropped {logger.dropped_rows} row(s) logged after step {state.step} "
                    "by the interrupted attempt (those steps are redone)")

    result = TrainingResult(run_dir, state.step, data.total_steps, None, None, None, state.skipped_steps, "completed",
                            resume_dir)
    train = config.train
    injected = set(train.fault_injection.nonfinite_loss_steps)
    consecutive_nonfinite = 0
    consecutive_failed_saves = 0
    losses = metrics_lib.LossWindow(train.log_interval)
    throughput = _Throughput()
    iterator = iter(train_loader)
    progress = _progress_bar(dist_info, state.step, data.total_steps)
    with StopRequest() as stop:
        while state.step < data.total_steps:
            lr = run_learning_rate(state.step, data.total_steps, train)
            _set_learning_rate(optimizer, lr)
            micro = _micro_batches(iterator, batch_sizes.gradient_accumulation_steps)
            local_loss = train_step(engine, micro, dist_info.device, inject_nonfinite=(state.step + 1) in injected)
            finite = torch.isfinite(local_loss)
            step_values = torch.stack([torch.where(finite, local_loss, torch.zeros_like(local_loss)), finite.float(),
                                       local_loss.new_tensor(float(stop.signal_name is not None))])  # (3,)
            # the step's one host read: summed over ranks for the non-finite skip and the stop agreement
            loss_sum, finite_ranks, stop_ranks = all_reduce_sum(step_values, dist_info.device)
            skip = finite_ranks < dist_info.world_size
            log_now = (state.step + 1) % train.log_interval == 0 or state.step == 0 or state.step + 1 == data.total_steps
            own_grad_norm = _grad_norm(engine) if log_now and not skip and _deepspeed_skips_grad_norm(config) else None
            optimizer.skip_next_step = skip
            engine.step()  # the accumulation boundary: optimizer step (or skipped update) + zero grads
            state.step += 1
            state.consumed_samples += batch_sizes.global_batch_size
            throughput.steps += 1
            progress.update(1)
            if skip:
                state.skipped_steps += 1
                consecutive_nonfinite += 1
                logger.log({"step": state.step, "loss": None, "nonfinite_loss": True, "skipped_steps": state.skipped_steps})
                if dist_info.is_main:
                    console(f"step {state.step}: non-finite loss, update skipped "
                            f"({consecutive_nonfinite} in a row, {state.skipped_steps} in total)")
                if consecutive_nonfinite >= train.max_consecutive_nonfinite:
                    last_good = checkpoint_dirs.latest_complete(run_dir / checkpoint_dirs.CHECKPOINTS_DIR)
                    if dist_info.is_main:
                        console(
                            f"stopping: {consecutive_nonfinite} consecutive non-finite losses, the last at step "
                            f"{state.step}; last good checkpoint: {last_good or 'none'} "
                            f"(resume with --resume {last_good} after fixing the cause, e.g. a lower train.lr)")
                    result.stopped_by, result.last_checkpoint = "nonfinite", last_good
                    break
            else:
                consecutive_nonfinite = 0
                losses.add(state.step, loss_sum / (dist_info.world_size * batch_sizes.gradient_accumulation_steps))
            shown_loss = losses.mean(state.step)
            if shown_loss is not None:
                progress.set_postfix(loss=f"{shown_loss:.4f}", lr=f"{lr:.2e}", refresh=False)
            if shown_loss is not None and log_now:
                row = _train_row(engine, state, shown_loss, lr, throughput, flops_per_step, peak,
                                 tokens_per_step, own_grad_norm)
                if stage is not None and selection is not None:
                    row.update(stage=stage.index + 1, trainable_parameters=selection.trainable)
                logger.log(row)
                if dist_info.is_main:
                    console(metrics_lib.format_row(row, data.total_steps))
            if train.fault_injection.kill_after_step == state.step:
                os.kill(os.getpid(), signal.SIGKILL)
            last = state.step == data.total_steps
            boundary = stage is not None and state.step == stage.end and not last  # the next stage starts from here
            exit_now = bool(train.exit_interval) and state.step % train.exit_interval == 0 and not last
            stopping = stop_ranks > 0 or exit_now
            side_work_start = time.perf_counter()
            if valid_loader is not None and train.eval_interval and (state.step % train.eval_interval == 0 or last):
                result.val_loss = _run_eval(engine, valid_loader, train.eval_iters, dist_info, logger, state.step,
                                            data.total_steps)
            if (train.save_interval and state.step % train.save_interval == 0) or last or stopping or boundary:
                saved = save_checkpoint(engine, run_dir, state, config, data.tokenizer_path, dist_info,
                                        train.keep_last_checkpoints)
                result.last_checkpoint = saved or result.last_checkpoint
                if saved and dist_info.is_main:
                    console(f"saved checkpoint {saved}")
                consecutive_failed_saves = 0 if saved else consecutive_failed_saves + 1
                if consecutive_failed_saves >= train.max_consecutive_failed_saves:  # every rank agrees on `saved`
                    last_good = checkpoint_dirs.latest_complete(run_dir / checkpoint_dirs.CHECKPOINTS_DIR)
                    if dist_info.is_main:
                        console(f"stopping: {consecutive_failed_saves} consecutive checkpoint saves failed, the last "
                                f"at step {state.step}; last good checkpoint: {last_good or 'none'} (free disk space "
                                "or fix the cause, then resume with --resume auto)")
                    result.stopped_by, result.last_checkpoint = "failed_saves", last_good
                    break
                if boundary and not saved:
                    if dist_info.is_main:
                        console(f"stopping: the checkpoint at the end of stage {state.stage + 1} (step {state.step}) "
                                "failed, and the next stage starts from it; free disk space or fix the cause, then "
                                "resume with --resume auto")
                    result.stopped_by = "failed_saves"
                    break
            if boundary and not stopping:
                assert saved and stage is not None
                engine.destroy()
                engine = optimizer = None  # the previous stage's model and optimizer state go before the next ones come
                _free_memory(dist_info)
                stage = stage_at(stages, state.step)
                engine, optimizer, selection = _next_stage(saved, config, batch_sizes, dist_info, stage, stages)
                state.stage = stage.index
            throughput.exclude_since(side_work_start)
            if stopping:
                reason = "train.exit_interval" if exit_now else stop.signal_name or "a signal on another rank"
                if dist_info.is_main:
                    console(f"stopped by {reason} at step {state.step}; resume with --resume auto")
                result.stopped_by = "exit_interval" if exit_now else "signal"
                break
    progress.close()
    logger.close()
    result.steps, result.skipped_steps = state.step, state.skipped_steps
    if dist_info.is_main:
        curve = metrics_lib.plot_loss_curve(logger.path, run_dir / "loss_curve.png", f"{run_dir.name}: loss")
        _print_summary(result, run_dir, curve)
    return result


def _staged_train_iters(stages: list[Stage], train_iters: int | None) -> int | None:
    """With train.stages the run is their steps (--train-iters may only repeat that); else unchanged."""
    if not stages:
        return train_iters
    total = stages[-1].end
    if train_iters is not None and train_iters != total:
        raise ValueError(f"--train-iters {train_iters} conflicts with train.stages, whose steps sum to {total}")
    return total


def _stage_key(stage: Stage) -> str:
    return f"train.stages[{stage.index}].trainable"


def _new_model(config: Config, dist_info: DistributedInfo) -> GPT:
    with torch.device(dist_info.device):
        return GPT(config.model)  # fp32 master weights; DeepSpeed casts for bf16/fp16


def _build_engine(model: GPT, config: Config, batch_sizes: BatchSizes, dist_info: DistributedInfo,
                  stage: Stage | None) -> tuple[Any, SkippableAdamW, bool, Selection | None]:
    """(engine, optimizer, compiled, the stage's selection): ``stage``'s parameters frozen first, so the
    optimizer and DeepSpeed hold state for its trainable elements only."""
    import deepspeed

    selection = None
    if stage is not None:
        selection = select(model, stage.trainable, _stage_key(stage))
        apply_selection(model, selection)
    model.lm_head.fused = config.train.fused_loss
    compiled = _compile_in_place(model, config, dist_info)
    optimizer = build_optimizer(model, config.train)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(config, batch_sizes))
    return engine, optimizer, compiled, selection


def _free_memory(dist_info: DistributedInfo) -> None:
    gc.collect()
    if dist_info.device.type == "cuda":
        torch.cuda.empty_cache()


def _next_stage(saved: Path, config: Config, batch_sizes: BatchSizes, dist_info: DistributedInfo, stage: Stage,
                stages: list[Stage]) -> tuple[Any, SkippableAdamW, Selection | None]:
    """Build ``stage`` at its start exactly as a resume from the boundary checkpoint ``saved`` does: a new
    model with its consolidated weights, the stage's freezing, a new optimizer and engine."""
    from megatron_lite.training import checkpoint_engine

    cuda = [dist_info.device.index or 0] if dist_info.device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):  # as in a resume, where the checkpoint's RNG state is restored after
        model = _new_model(config, dist_info)
        load_weights(model, _consolidated(saved), f"stage start from {saved}")
        engine, optimizer, _, selection = _build_engine(model, config, batch_sizes, dist_info, stage)
    checkpoint_engine.install(engine, dist_info.rank)
    if dist_info.is_main:
        _log_stage(stage, stages, selection, optimizer)
    return engine, optimizer, selection


def _consolidated(step_dir: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's fp32 weights by DeepSpeed's consolidation, whose progress prints are left out of the log."""
    with contextlib.redirect_stdout(io.StringIO()):
        return load_step_state_dict(step_dir)


def _log_stage(stage: Stage | None, stages: list[Stage], selection: Selection | None,
               optimizer: SkippableAdamW) -> None:
    if stage is not None and selection is not None:
        console(stage_summary(stage, len(stages), selection))
    console(optimizer.groups_summary)


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


def _load_initial_weights(model: GPT, config: Config) -> None:
    """train.init_from: weights only; every tensor must match the config."""
    state, _, _ = load_state_dict(config.train.init_from)
    load_weights(model, state, f"train.init_from={config.train.init_from}")


def _progress_bar(dist_info: DistributedInfo, start: int, total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc="train", unit="step", disable=not dist_info.is_main,
                dynamic_ncols=True, file=sys.stderr, mininterval=1.0)


def _deepspeed_skips_grad_norm(config: Config) -> bool:
    """DeepSpeed clips fp32 ZeRO-0 gradients without keeping the norm (get_global_grad_norm() is None)."""
    return config.train.zero_stage == 0 and config.precision == "fp32"


def _grad_norm(engine: Any) -> float:
    """Global L2 norm of the accumulated gradients (ZeRO 0: every rank holds all of them after the reduce)."""
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0


def _train_row(engine: Any, state: TrainingState, loss: float, lr: float, throughput: _Throughput,
               flops_per_step: float | None, peak: float | None, tokens_per_step: int,
               own_grad_norm: float | None) -> dict[str, Any]:
    elapsed, steps = throughput.take()
    grad_norm = own_grad_norm if own_grad_norm is not None else engine.get_global_grad_norm()
    tflops = (None if flops_per_step is None  # per device
              else flops_per_step * steps / max(elapsed, 1e-9) / 1e12 / max(engine.world_size, 1))
    return {
        "step": state.step, "loss": loss, "lr": lr,
        "grad_norm": float(grad_norm) if grad_norm is not None else None,
        "tokens_per_sec": tokens_per_step * steps / max(elapsed, 1e-9),
        "tflops": tflops, "mfu": tflops / peak if tflops is not None and peak else None,
        "memory_gb": metrics_lib.memory_gb(), "skipped_steps": state.skipped_steps,
        "consumed_samples": state.consumed_samples,
    }


def _run_eval(engine: Any, loader: DataLoader, eval_iters: int, dist_info: DistributedInfo,
              logger: metrics_lib.MetricsLogger, step: int, total_steps: int) -> float:
    val_loss = evaluate(engine, loader, eval_iters, dist_info.device)
    row = {"step": step, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50.0))}
    logger.log(row)
    if dist_info.is_main:
        console(metrics_lib.format_row(row, total_steps))
    return val_loss


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
