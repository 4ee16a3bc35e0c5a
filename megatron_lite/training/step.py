"""One optimizer step and one evaluation, as plain functions of the DeepSpeed engine.

DeepSpeed stays behind the engine's forward/backward/step; ``train_step`` is a function of (engine,
micro batches), and ``take_step`` adds what the ranks agree on (the non-finite skip, a stop signal) and
the update itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from megatron_lite.config import Config
from megatron_lite.model.loss import IGNORE_INDEX
from megatron_lite.training.distributed import all_reduce_sum
from megatron_lite.training.engine import StagedEngine


def train_step(engine: Any, micro_batches: list[dict[str, torch.Tensor]], device: torch.device,
               inject_nonfinite: bool = False, cuda_graphs: bool = False) -> torch.Tensor:
    """Forward/backward over one step's micro batches (DeepSpeed accumulates); returns the (local)
    summed loss of the micro batches, before the optimizer step is taken or skipped by the caller.
    ``cuda_graphs``: the compiled graphs replay as CUDA graphs (``StagedEngine.cuda_graphs``)."""
    losses = []
    for batch in micro_batches:
        input_ids = batch["input_ids"].to(device, non_blocking=True)  # (B, T)
        labels = batch["labels"].to(device, non_blocking=True)  # (B, T), already shifted
        if cuda_graphs:  # each micro batch a new step of the graphs, whose outputs the next replay overwrites
            torch.compiler.cudagraph_mark_step_begin()
        loss = engine(input_ids, labels=labels)  # fused LM head + cross entropy (train.fused_loss)
        if inject_nonfinite:
            loss = loss * float("nan")
        engine.backward(loss)
        losses.append(loss.detach().clone() if cuda_graphs else loss.detach())  # kept past the next replay
        if len(losses) < len(micro_batches):
            engine.step()  # not a boundary: DeepSpeed only counts the micro step
    return torch.stack(losses).float().sum()


@dataclass(frozen=True)
class StepOutcome:
    finite: bool  # every rank's loss was finite, so the update was taken (else it was skipped)
    loss: float  # mean over ranks and micro batches (meaningless when not finite)
    signalled: bool  # some rank has received SIGTERM/SIGINT
    own_grad_norm: float | None  # where DeepSpeed keeps no gradient norm and the step is logged


def take_step(staged: StagedEngine, micro_batches: list[dict[str, torch.Tensor]], lr: float, inject_nonfinite: bool,
              signalled_here: bool, logged: bool) -> StepOutcome:
    """Forward/backward, one all-reduce for the ranks' agreement, then the update (skipped when some rank's
    loss was not finite); ``logged``: the step's metrics row is written (so its gradient norm is wanted)."""
    engine, dist_info = staged.engine, staged.dist_info
    for group in staged.optimizer.param_groups:
        group["lr"] = lr
    local_loss = train_step(engine, micro_batches, dist_info.device, inject_nonfinite, staged.cuda_graphs)
    finite = torch.isfinite(local_loss)
    step_values = torch.stack([torch.where(finite, local_loss, torch.zeros_like(local_loss)), finite.float(),
                               local_loss.new_tensor(float(signalled_here))])  # (3,)
    # the step's one host read: summed over ranks for the non-finite skip and the stop agreement
    loss_sum, finite_ranks, stop_ranks = all_reduce_sum(step_values, dist_info.device)
    skip = finite_ranks < dist_info.world_size
    own_grad_norm = (_grad_norm(engine) if logged and not skip and _deepspeed_skips_grad_norm(staged.config)
                     else None)
    staged.optimizer.skip_next_step = skip
    engine.step()  # the accumulation boundary: optimizer step (or skipped update) + zero grads
    mean_loss = loss_sum / (dist_info.world_size * staged.batch_sizes.gradient_accumulation_steps)
    return StepOutcome(not skip, mean_loss, stop_ranks > 0, own_grad_norm)


def micro_batches(iterator: Iterator[dict[str, torch.Tensor]], count: int) -> list[dict[str, torch.Tensor]]:
    try:
        return [next(iterator) for _ in range(count)]
    except StopIteration:  # the index is built for exactly total_steps; running out is a bug
        raise RuntimeError("training data ran out before the last step") from None


def evaluate(engine: Any, loader: DataLoader, device: torch.device,
             check_interrupt: Callable[[], None] = lambda: None) -> float:
    """Mean validation loss per token over all ranks' shares of the validation set (``ValidationShare``):
    each batch's mean loss weighted by its scored tokens, so the value does not depend on how the samples
    are split over ranks and batches. ``check_interrupt`` runs before each batch (and may raise to stop)."""
    engine.eval()
    try:
        weighted_sum, tokens = local_validation_sums(engine, loader, device, check_interrupt)
    finally:
        engine.train()
    summed, counted = all_reduce_sum([weighted_sum, tokens], device)
    return summed / max(counted, 1.0)


@torch.no_grad()
def local_validation_sums(engine: Any, loader: DataLoader, device: torch.device,
                          check_interrupt: Callable[[], None] = lambda: None) -> tuple[float, float]:
    """This rank's (sum over batches of mean loss x scored tokens, scored tokens); padding labels score nothing."""
    weighted_sum, tokens = 0.0, 0.0
    for batch in loader:
        check_interrupt()
        loss = engine(batch["input_ids"].to(device), labels=batch["labels"].to(device))  # every rank runs it
        scored = int((batch["labels"] != IGNORE_INDEX).sum())
        if scored:  # an all-padding batch's mean is 0/0
            weighted_sum += float(loss) * scored
            tokens += scored
    return weighted_sum, tokens


def _deepspeed_skips_grad_norm(config: Config) -> bool:
    """DeepSpeed clips fp32 ZeRO-0 gradients without keeping the norm (get_global_grad_norm() is None)."""
    return config.train.zero_stage == 0 and config.precision == "fp32"


def _grad_norm(engine: Any) -> float:
    """Global L2 norm of the accumulated gradients (ZeRO 0: every rank holds all of them after the reduce)."""
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
