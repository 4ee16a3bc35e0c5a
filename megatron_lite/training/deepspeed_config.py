"""The DeepSpeed config derived from ours: batch triple, ZeRO stage, precision, clipping, passthrough."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from megatron_lite.config import Config


@dataclass(frozen=True)
class BatchSizes:
    """The batch triple of a run, resolved once against the world size (``resolve_batch_sizes``)."""

    micro_batch_size: int  # samples per rank per forward/backward
    gradient_accumulation_steps: int
    data_parallel_size: int
    accumulation_derived: bool = False  # train.gradient_accumulation_steps was null, so it was computed

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps * self.data_parallel_size

    def tokens_per_step(self, seq_length: int) -> int:
        """Tokens of one optimizer step over all data-parallel ranks."""
        return self.global_batch_size * seq_length

    def describe(self) -> str:
        """The start-up line's account: ``batch 256 = 16 micro x 2 accumulation (derived) x 8 rank(s)``."""
        derived = " (derived)" if self.accumulation_derived else ""
        return (f"batch {self.global_batch_size} = {self.micro_batch_size} micro x {self.gradient_accumulation_steps} "
                f"accumulation{derived} x {self.data_parallel_size} rank(s)")


MAX_SUGGESTED_MICRO_SIZES = 4


def resolve_batch_sizes(config: Config, world_size: int) -> BatchSizes:
    """The triple for ``world_size`` data-parallel ranks. A null train.gradient_accumulation_steps is derived:
    train_batch_size / (micro x ranks), or 1 when train_batch_size is null too; an explicit one must multiply
    out to train_batch_size. ValueError (one line, naming the numbers) when it cannot."""
    train = config.train
    micro, accumulation, target = (train.train_micro_batch_size_per_gpu, train.gradient_accumulation_steps,
                                   train.train_batch_size)
    if accumulation is None:
        if target is None:
            return BatchSizes(micro, 1, world_size, accumulation_derived=True)
        if target % (micro * world_size):
            raise ValueError(
                f"train.train_batch_size={target} is not a multiple of train.train_micro_batch_size_per_gpu={micro} "
                f"x {world_size} data-parallel ranks = {micro * world_size}; "
                + _micro_sizes_that_fit(target, micro, world_size))
        return BatchSizes(micro, target // (micro * world_size), world_size, accumulation_derived=True)
    batch = BatchSizes(micro, accumulation, world_size)
    if target is not None and target != batch.global_batch_size:
        raise ValueError(
            f"train.train_batch_size={target} != train.train_micro_batch_size_per_gpu="
            f"{micro} x train.gradient_accumulation_steps={accumulation} x "
            f"{world_size} data-parallel ranks = {batch.global_batch_size} (a null "
            "train.gradient_accumulation_steps derives it from the other two)"
        )
    return batch


def _micro_sizes_that_fit(global_batch: int, micro: int, world_size: int) -> str:
    """The advice closing the not-a-multiple error: the largest micro batch sizes up to ``micro`` (it may be
    what fits in memory) that keep ``global_batch`` on ``world_size`` ranks."""
    if global_batch % world_size:
        return f"no micro batch size keeps it on {world_size} ranks; change train.train_batch_size"
    per_rank = global_batch // world_size
    sizes = [size for size in range(min(micro, per_rank), 0, -1) if per_rank % size == 0][:MAX_SUGGESTED_MICRO_SIZES]
    listed = ", ".join(map(str, sizes[:-1])) + (" or " if len(sizes) > 1 else "") + str(sizes[-1])
    return f"train.train_micro_batch_size_per_gpu={listed} keeps it (set it with --set)"


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge; ``extra`` wins."""
    merged = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def bf16_gradient_sums(grad_accum_dtype: str, zero_stage: int) -> dict[str, Any]:
    """DeepSpeed keys for where a bf16 run sums gradients (``train.grad_accum_dtype``). DeepSpeed's default sums
    the micro batches' bf16 gradients in bf16 and all-reduces them in bf16 (its issue #1800); Megatron-LM
    accumulates and all-reduces them in float32 for bf16. ``fp32``: the all-reduce in float32 at every stage, the
    accumulation too at ZeRO 1-3 (ZeRO 1: BF16_Optimizer; ZeRO 2-3: float32 gradient partitions). DeepSpeed
    refuses a float32 accumulator without ZeRO (NotImplementedError), so ZeRO 0 accumulates in bf16."""
    if grad_accum_dtype == "model":
        return {}
    sums: dict[str, Any] = {"communication_data_type": "fp32"}
    if zero_stage > 0:
        sums["data_types"] = {"grad_accum_dtype": "fp32"}
    if zero_stage == 1:
        # BF16_Optimizer sums after backward, where training/fp32_grad_sums.py makes it one add_ per group; its
        # immediate update (DeepSpeed's default is off) would add each gradient from a Python hook per parameter
        sums["bf16"] = {"immediate_grad_update": False}
    return sums


def bf16_accumulation_notice(config: Config, batch: BatchSizes) -> str | None:
    """One line for a bf16 run that asked for float32 sums where DeepSpeed cannot give them (ZeRO 0 with
    accumulation), or None."""
    train = config.train
    if (config.precision != "bf16" or train.grad_accum_dtype != "fp32" or train.zero_stage > 0
            or batch.gradient_accumulation_steps == 1 or "data_types" in train.deepspeed):
        return None
    return (f"train.grad_accum_dtype=fp32: at ZeRO 0 DeepSpeed sums the {batch.gradient_accumulation_steps} micro "
            "batches' gradients in bf16 (it has no float32 accumulator without ZeRO); train.zero_stage=1 sums "
            "them in float32, with the same memory on one GPU")


def bf16_zero0_sync_notice(config: Config, device_type: str) -> str | None:
    """One line for a bf16 run at ZeRO 0 on a GPU, or None: DeepSpeed's bf16 wrapper without ZeRO (FP16_Optimizer)
    reads every parameter's inf/NaN check back to the host each step, a synchronisation per tensor (the 41.6M
    speedrun model on an H200, 2026-11-27: 105 per step, the GPU busy 24% of it); ZeRO 1's BF16_Optimizer checks
    once."""
    if config.precision != "bf16" or config.train.zero_stage > 0 or device_type != "cuda":
        return None
    return ("bf16 at train.zero_stage=0: DeepSpeed's bf16 wrapper waits for the GPU once per parameter tensor every "
            "step (its inf/NaN check); train.zero_stage=1 checks once, and on one GPU partitions nothing")


def deepspeed_config(config: Config, batch: BatchSizes) -> dict[str, Any]:
    """The dict handed to ``deepspeed.initialize``; ``train.deepspeed`` is merged in last."""
    train = config.train
    generated: dict[str, Any] = {
        "train_batch_size": batch.global_batch_size,
        "train_micro_batch_size_per_gpu": batch.micro_batch_size,
        "gradient_accumulation_steps": batch.gradient_accumulation_steps,
        "gradient_clipping": train.gradient_clipping,
        "zero_optimization": {"stage": train.zero_stage},
        # our AdamW (weight-decay groups, skippable step) is passed as the client optimizer
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**62,  # we log ourselves
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer (on by default) synchronises the device when each micro batch starts and
        # ends: the host waits for the GPU to drain, then the GPU for the host (two cudaDeviceSynchronize per micro
        # batch in the users' command on the H200, 2026-11-27). The loop times steps itself.
        "timers": {"throughput": {"enabled": False}},
    }
    if config.precision == "bf16":
        generated = _merge({**generated, "bf16": {"enabled": True}},
                           bf16_gradient_sums(train.grad_accum_dtype, train.zero_stage))
    elif config.precision == "fp16":
        generated["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": train.initial_loss_scale_power}
    if train.sequence_parallel_size > 1 and train.zero_stage == 3:
        # ZeRO-3's reduce-scatter divides by data-parallel x P ranks, not the data-parallel ranks: gradients would be
        # P x too small (training/sequence_parallel.py); its all-reduce path divides right
        generated["zero_optimization"]["reduce_scatter"] = False
    merged = _merge(generated, train.deepspeed)
    if train.sequence_parallel_size > 1 and train.zero_stage == 3 and merged["zero_optimization"].get("reduce_scatter"):
        raise ValueError("train.deepspeed.zero_optimization.reduce_scatter=true: not with train.sequence_parallel_size > 1 "
                         "at ZeRO-3 (its gradients would be P times too small)")
    return merged
