"""DeepSpeed-Ulysses sequence parallelism, the model's side (docs/sequence_parallel.md).

P ranks (a sequence-parallel group) train on the same samples; rank r holds tokens
[r T/P, (r + 1) T/P) of each. Everything outside attention is per token, so it runs on the slice as is,
with the slice's GLOBAL positions: rotary tables (RoPE, both CoCA constraints: slack's query transform
uses the absolute query position), every RoPE scaling (dynamic NTK sees the whole length T), learned and
sinusoidal embeddings. Attention needs every key, so DeepSpeed's ``DistributedAttention`` all-to-all turns
the transformed (B, T/P, H, D) q', k', v into (B, T, H/P, D) — the whole sequence, rank r's heads
[r H/P, (r + 1) H/P) — runs the ordinary kernel (ALiBi slopes of those heads), and turns the output back.

The loss: rank r backpropagates its tokens' loss sum over the WHOLE sequence's token count, so the group's
gradients sum (DeepSpeed reduces over data-parallel x P ranks and divides by the data-parallel ranks only)
to the gradient of the full sequence's mean; the value every rank returns is that full mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from megatron_lite.model.gqa import repeat_kv
from megatron_lite.model.loss import IGNORE_INDEX

# (B, H/P, T, D) q', k', v of this rank's heads over the whole sequence -> (B, H/P, T, D) attention output
HeadKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def check_sequence_parallel(size: int, num_heads: int, seq_length: int) -> None:
    """ValueError (one line) unless P = ``size`` divides the attention heads and the sequence."""
    if size < 1:
        raise ValueError(f"train.sequence_parallel_size={size}: must be >= 1")
    if num_heads % size:
        raise ValueError(f"train.sequence_parallel_size={size} does not divide model.num_attention_heads={num_heads}")
    if seq_length % size:
        raise ValueError(f"train.sequence_parallel_size={size} does not divide the sequence length {seq_length}")


@dataclass(frozen=True)
class SequenceShard:
    """Rank ``rank`` of ``size``'s tokens of a ``global_length`` sequence: [start, start + length)."""

    rank: int
    size: int
    global_length: int

    @property
    def length(self) -> int:
        return self.global_length // self.size

    @property
    def start(self) -> int:
        return self.rank * self.length

    def positions(self, device: torch.device | str) -> torch.Tensor:
        """(T/P,) the slice's global positions."""
        return torch.arange(self.start, self.start + self.length, device=device)

    def global_positions(self, device: torch.device | str) -> torch.Tensor:
        """(T,) every position, as the attention kernel sees them after the all-to-all."""
        return torch.arange(self.global_length, device=device)

    def local(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        """(B, T) -> (B, T/P): this rank's tokens (input ids or labels)."""
        return tokens_BT[:, self.start:self.start + self.length]


def head_slice(num_heads: int, rank: int, size: int) -> slice:
    """The query heads rank ``rank`` attends over after the all-to-all: DeepSpeed scatters the head dim in
    ``size`` consecutive chunks, chunk r to rank r."""
    per_rank = num_heads // size
    return slice(rank * per_rank, (rank + 1) * per_rank)


def _local_attention(q_BTHD: torch.Tensor, k_BTHD: torch.Tensor, v_BTHD: torch.Tensor,
                     kernel: HeadKernel) -> torch.Tensor:
    """DistributedAttention's local attention: its (B, T, H/P, D) layout to the kernels' (B, H/P, T, D)."""
    return kernel(q_BTHD.transpose(1, 2), k_BTHD.transpose(1, 2), v_BTHD.transpose(1, 2)).transpose(1, 2)


class SequenceParallel:
    """A model's sequence-parallel group and its all-to-all (``GPT.enable_sequence_parallel``)."""

    def __init__(self, group: dist.ProcessGroup, num_heads: int, num_kv_heads: int) -> None:
        from deepspeed.sequence.layer import DistributedAttention

        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)  # heads and length: shard()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        # (B, T/P, H, D) -> scatter heads (dim 2), gather the sequence (dim 1) -> (B, T, H/P, D), and back
        self.exchange = DistributedAttention(_local_attention, group, scatter_idx=2, gather_idx=1)

    def shard(self, global_length: int) -> SequenceShard:
        check_sequence_parallel(self.size, self.num_heads, global_length)
        return SequenceShard(self.rank, self.size, global_length)

    @property
    def heads(self) -> slice:
        return head_slice(self.num_heads, self.rank, self.size)

    def repeats_kv(self) -> bool:
        """Grouped K/V heads go through the all-to-all as they are when P divides them (query head h of
        rank r then finds its K/V head on r); else they are repeated to the query heads first."""
        return self.num_kv_heads % self.size != 0

    def attend(self, q_BHtD: torch.Tensor, k_BKtD: torch.Tensor, v_BKtD: torch.Tensor,
               kernel: HeadKernel) -> torch.Tensor:
        """(B, H, T/P, D) q', (B, H_kv, T/P, D) k', v -> (B, H, T/P, D): ``kernel`` on this rank's heads over
        the whole sequence, between DeepSpeed's two all-to-alls."""
        if self.repeats_kv():
            k_BKtD, v_BKtD = repeat_kv(k_BKtD, self.num_heads), repeat_kv(v_BKtD, self.num_heads)
        out_BtHD = self.exchange(q_BHtD.transpose(1, 2), k_BKtD.transpose(1, 2), v_BKtD.transpose(1, 2), 0, None,
                                 kernel)
        return out_BtHD.transpose(1, 2)

    def sequence_loss(self, local_mean: torch.Tensor, labels_local_BT: torch.Tensor,
                      labels_BT: torch.Tensor) -> torch.Tensor:
        """The full sequence's mean loss as the value on every rank of the group; its gradient is this rank's
        share, its tokens' loss sum over the whole sequence's scored tokens (the group's gradients add up to
        the full mean's)."""
        local_count = (labels_local_BT != IGNORE_INDEX).sum()
        total_count = (labels_BT != IGNORE_INDEX).sum()
        # a slice with no scored token has a 0/0 mean; its share is 0 (and so is its gradient)
        share = torch.where(local_count > 0, local_mean * local_count / total_count, torch.zeros_like(local_mean))
        whole = share.detach().clone()
        dist.all_reduce(whole, group=self.group)
        return share + (whole - share.detach())
