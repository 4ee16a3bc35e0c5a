"""The pure parts of sequence parallelism: slices and their positions, head slices against DeepSpeed's own
all-to-all layout, the rank arithmetic, the DeepSpeed config under ZeRO-3 and the one-line errors. The
multi-rank equivalences are tests/test_sequence_parallel.py and tests/test_sequence_parallel_training.py."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_config
from megatron_lite import config as config_lib
from megatron_lite.model.sequence_parallel import SequenceShard, check_sequence_parallel, head_slice
from megatron_lite.training.deepspeed_config import BatchSizes, deepspeed_config, resolve_batch_sizes
from megatron_lite.training.distributed import DistributedInfo
from megatron_lite.training.sequence_parallel import with_sequence_parallel


def test_a_shard_holds_consecutive_tokens_at_their_global_positions() -> None:
    shard = SequenceShard(rank=2, size=4, global_length=16)
    assert (shard.start, shard.length) == (8, 4)
    assert shard.positions("cpu").tolist() == [8, 9, 10, 11]
    assert shard.global_positions("cpu").tolist() == list(range(16))
    tokens = torch.arange(32).view(2, 16)
    assert shard.local(tokens).tolist() == [[8, 9, 10, 11], [24, 25, 26, 27]]
    slices = [SequenceShard(rank, 4, 16).local(tokens) for rank in range(4)]
    assert torch.equal(torch.cat(slices, dim=1), tokens)  # the group's slices are the sequence


@pytest.mark.parametrize("heads, size", [(4, 2), (8, 4), (6, 2), (12, 3)])
def test_head_slices_follow_deepspeeds_all_to_all_layout(heads: int, size: int) -> None:
    """What DeepSpeed's all-to-all sends to rank r (chunk r of its pre-all-to-all layout) is head_slice(r)."""
    from deepspeed.sequence.layer import _generate_layout_params, pre_all2all_fun

    batch, local_length, head_dim = 2, 3, 5
    heads_BtHD = torch.arange(heads).view(1, 1, heads, 1).expand(batch, local_length, heads, head_dim)
    permute, shape, _, _ = _generate_layout_params(2, 0, size, heads_BtHD)  # scatter heads, batch first
    chunks = pre_all2all_fun(permute, shape, heads_BtHD)  # (P, B, T/P, H/P, D): chunk r goes to rank r
    for rank in range(size):
        sent = chunks[rank, 0, 0, :, 0].tolist()
        assert sent == list(range(heads))[head_slice(heads, rank, size)]


def test_rank_arithmetic() -> None:
    info = with_sequence_parallel(DistributedInfo(rank=5, local_rank=5, world_size=8, device=torch.device("cpu")), 2)
    assert (info.data_parallel_size, info.data_parallel_rank, info.sequence_parallel_rank) == (4, 2, 1)
    alone = DistributedInfo(rank=3, local_rank=3, world_size=4, device=torch.device("cpu"))
    assert (alone.data_parallel_size, alone.data_parallel_rank, alone.sequence_parallel_rank) == (4, 3, 0)
    with pytest.raises(ValueError, match=r"^train.sequence_parallel_size=4 does not divide the 6 rank\(s\) launched"):
        with_sequence_parallel(DistributedInfo(0, 0, 6, torch.device("cpu")), 4)


def test_batch_arithmetic_counts_data_parallel_ranks() -> None:
    config = config_lib.from_dict({**config_lib.to_dict(tiny_config()), "train": {
        "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "sequence_parallel_size": 2}})
    info = with_sequence_parallel(DistributedInfo(0, 0, 4, torch.device("cpu")), 2)
    batch = resolve_batch_sizes(config, info.data_parallel_size)  # 4 ranks, 2 groups of 2: 2 data-parallel ranks
    assert (batch.gradient_accumulation_steps, batch.global_batch_size) == (4, 32)
    generated = deepspeed_config(config, batch)
    assert (generated["train_batch_size"], generated["gradient_accumulation_steps"]) == (32, 4)


def _config(stage: int, size: int, **deepspeed: object) -> config_lib.Config:
    return config_lib.from_dict({**config_lib.to_dict(tiny_config()), "train": {
        "zero_stage": stage, "sequence_parallel_size": size, "deepspeed": deepspeed}})


def test_zero3_reduce_scatter_is_off_under_sequence_parallelism() -> None:
    batch = BatchSizes(2, 1, 1)
    assert deepspeed_config(_config(3, 2), batch)["zero_optimization"]["reduce_scatter"] is False
    assert "reduce_scatter" not in deepspeed_config(_config(3, 1), batch)["zero_optimization"]
    assert "reduce_scatter" not in deepspeed_config(_config(2, 2), batch)["zero_optimization"]
    with pytest.raises(ValueError, match=r"^train.deepspeed.zero_optimization.reduce_scatter=true: not with"):
        deepspeed_config(_config(3, 2, zero_optimization={"reduce_scatter": True}), batch)


@pytest.mark.parametrize("overrides, message", [
    ({"train": {"sequence_parallel_size": 3}},
     "train.sequence_parallel_size=3 does not divide model.num_attention_heads=4"),
    ({"train": {"sequence_parallel_size": 0}}, "train.sequence_parallel_size=0: must be >= 1"),
    ({"train": {"sequence_parallel_size": 4}, "model": {"seq_length": 18}},
     "train.sequence_parallel_size=4 does not divide model.seq_length=18"),
])
def test_config_errors_are_one_line(overrides: dict, message: str) -> None:
    data = config_lib.to_dict(tiny_config())
    data["train"].update(overrides["train"])
    data["model"].update(overrides.get("model", {}))
    with pytest.raises(ValueError) as caught:
        config_lib.from_dict(data)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_model_side_check() -> None:
    check_sequence_parallel(2, 4, 16)
    with pytest.raises(ValueError, match=r"^train.sequence_parallel_size=2 does not divide the sequence length 15$"):
        check_sequence_parallel(2, 4, 15)
    with pytest.raises(ValueError, match=r"^train.sequence_parallel_size=3 does not divide model.num_attention_heads"):
        check_sequence_parallel(3, 4, 12)
