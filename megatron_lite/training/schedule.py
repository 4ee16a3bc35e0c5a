"""Learning-rate schedule (the paper's: linear warm-up from 1e-7 to 1e-4 over 1% of the steps, then
linear decay to 1e-5 at the last step). A pure function of the step, so resume is exact and lr/iters
changes on resume take effect at once."""

from __future__ import annotations

import dataclasses
import math

from megatron_lite.config import TrainConfig
from megatron_lite.training.stages import plan_stages, stage_at


def warmup_steps(train: TrainConfig, total_steps: int) -> int:
    """round(warmup * total); at least 1 when warm-up is on, at most total - 1."""
    if train.warmup == 0 or total_steps <= 1:
        return 0
    return min(max(1, round(train.warmup * total_steps)), total_steps - 1)


def learning_rate(step: int, total_steps: int, train: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based; the last one is total_steps - 1).

    warm-up:  warmup_start_lr + (lr - warmup_start_lr) * step / W        for step <= W
    decay:    lr + (min_lr - lr) * (step - W) / (total_steps - 1 - W)     for step > W (linear)
    """
    if not 0 <= step < total_steps:
        raise ValueError(f"step={step}: must be in [0, {total_steps})")
    warmup = warmup_steps(train, total_steps)
    if step < warmup:
        return train.warmup_start_lr + (train.lr - train.warmup_start_lr) * step / warmup
    decay_steps = total_steps - 1 - warmup
    if train.lr_decay_style == "constant" or decay_steps == 0:
        return train.lr
    progress = (step - warmup) / decay_steps  # 0 at the end of warm-up, 1 at the last step
    if train.lr_decay_style == "cosine":
        return train.min_lr + (train.lr - train.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return train.lr + (train.min_lr - train.lr) * progress


def run_learning_rate(step: int, total_steps: int, train: TrainConfig) -> float:
    """``learning_rate`` of the run; with train.stages, that of the stage ``step`` is in, peaking at the
    stage's lr: over the stage's own steps (stage_schedule per_stage, the schedule restarting in every
    stage) or over the whole run (across)."""
    stages = plan_stages(train)
    if not stages:
        return learning_rate(step, total_steps, train)
    stage = stage_at(stages, step)
    peak = dataclasses.replace(train, lr=stage.lr)
    if train.stage_schedule == "across":
        return learning_rate(step, total_steps, peak)
    return learning_rate(step - stage.start, stage.steps, peak)
