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

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps * self.data_parallel_size

    def tokens_per_step(self, seq_length: int) -> int:
        """Tokens of one optimizer step over all data-parallel ranks."""
        return self.global_batch_size * seq_length


def resolve_batch_sizes(config: Config, world_size: int) -> BatchSizes:
    """micro x accumulation x ranks must equal train_batch_size when that is set; ValueError names all three."""
    train = config.train
    batch = BatchSizes(train.train_micro_batch_size_per_gpu, train.gradient_accumulation_steps, world_size)
    if train.train_batch_size is not None and train.train_batch_size != batch.global_batch_size:
        raise ValueError(
            f"train.train_batch_size={train.train_batch_size} != train.train_micro_batch_size_per_gpu="
            f"{batch.micro_batch_size} x train.gradient_accumulation_steps={batch.gradient_accumulation_steps} x "
            f"{world_size} data-parallel ranks = {batch.global_batch_size}"
        )
    return batch


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge; ``extra`` wins."""
    merged = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


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
    }
    if config.precision == "bf16":
        generated["bf16"] = {"enabled": True}
    elif config.precision == "fp16":
        generated["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": train.initial_loss_scale_power}
    return _merge(generated, train.deepspeed)
