"""Sequence-parallel groups for a training run (train.sequence_parallel_size; docs/sequence_parallel.md).

The groups are DeepSpeed's own Ulysses mpu (``deepspeed.runtime.sequence_parallel.parallel_state_sp``):
sequence-parallel groups of P consecutive ranks, and one sequence-data-parallel group of all ranks, over which
DeepSpeed reduces gradients and shards ZeRO state, dividing by the data-parallel ranks (world / P) only, so
the P partial gradients of a sample add up. Two traps this avoids, both found by trying: passing
``mesh_param=(dp, P)`` to ``deepspeed.initialize`` leaves ``seq_dp_world_size = dp`` and never sums the
gradients over the P ranks; and ZeRO-3's reduce-scatter pre-divides by the whole world (dp x P), leaving
gradients P x too small, so ``deepspeed_config`` turns it off under sequence parallelism.
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Any

from megatron_lite.training.distributed import DistributedInfo


def with_sequence_parallel(dist_info: DistributedInfo, size: int) -> DistributedInfo:
    """``dist_info`` with P = ``size``; ValueError (one line) unless P divides the ranks launched."""
    if size < 1 or dist_info.world_size % size:
        raise ValueError(f"train.sequence_parallel_size={size} does not divide the {dist_info.world_size} rank(s) "
                         "launched (ranks = data-parallel ranks x P)")
    return dataclasses.replace(dist_info, sequence_parallel_size=size)


class UlyssesMpu:
    """DeepSpeed's Ulysses mpu, which aliases model parallelism to sequence parallelism (so ZeRO counts each
    replicated gradient once per sequence-parallel group in the norm), plus a tensor-parallel degree of 1:
    the weights are whole on every rank. Without it DeepSpeed records tp_degree=P in every checkpoint, which
    ``ds_to_universal`` refuses (one model-states file, not P), and a universal load at P > 1 asks the mpu
    for a tensor-parallel size it lacks: a resume on another number of ranks would fail either way. Only
    the size is added: DeepSpeed reads the tensor-parallel *rank* (for the norm) from the alias as before."""

    def __init__(self, groups: ModuleType) -> None:
        self._groups = groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._groups, name)

    @staticmethod
    def get_tensor_model_parallel_world_size() -> int:
        return 1


def sequence_parallel_mpu(size: int) -> UlyssesMpu | None:
    """DeepSpeed's Ulysses mpu with groups of ``size`` ranks (created once per process), for
    ``deepspeed.initialize(mpu=...)``; None for P = 1."""
    if size == 1:
        return None
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    if parallel_state_sp._SEQUENCE_PARALLEL_GROUP is None:
        parallel_state_sp.initialize_sequence_parallel(size)
    elif parallel_state_sp.get_sequence_parallel_world_size() != size:
        raise ValueError(f"train.sequence_parallel_size={size}: this process already has sequence-parallel groups "
                         f"of {parallel_state_sp.get_sequence_parallel_world_size()} ranks")
    return UlyssesMpu(parallel_state_sp)
