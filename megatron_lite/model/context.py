"""The per-forward context every attention layer shares: the call's positions and rotary tables, and the
attention mask as the call's structure decides it (mask mode, document ids, FlexAttention block mask).
Built once per forward by ``build_context``; the position schemes themselves live in position.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from megatron_lite.config import AttentionConfig
from megatron_lite.model import flex
from megatron_lite.model.masks import sdpa_mask
from megatron_lite.model.position import PositionScheme
from megatron_lite.model.rope import RotaryEmbedding, RotaryTables
from megatron_lite.model.sequence_parallel import SequenceParallel, SequenceShard

# Which keys a query sees, decided from the call's structure (never by reading device tensors, which
# would be a host sync per layer on a GPU and a graph break under torch.compile):
#   causal   no cached keys: keys are the queries' own tokens, key j visible to query i iff j <= i;
#   decode   one query after cached keys: it sees every key (all precede it);
#   general  several queries after cached keys: an explicit (T, S) mask from the positions.
# Positions are ascending and continue after what the cache holds (GPT.forward's contract).
MaskMode = Literal["causal", "decode", "general"]


@dataclass
class PositionContext:
    """Per-forward state, built once by ``build_context`` and shared by all layers: the positions and
    their rotary tables, and which keys each query sees."""

    positions: torch.Tensor  # (T,) int64 positions of the current tokens
    rope_length: int  # sequence length that fixes the dynamic-NTK base for this forward/generation
    rotary: RotaryEmbedding | None
    tables: RotaryTables | None  # cos/sin at `positions`, None for non-rotary schemes
    mask_mode: MaskMode = "causal"
    last_position: int | None = None  # the last position when the call's structure tells it (no explicit positions)
    document_ids: torch.Tensor | None = None  # (B, T) document of each token (model.attention.document_mask)
    block_mask: Any = None  # FlexAttention BlockMask (backend flex), shared by all layers
    # backend sdpa, where the kernel needs a mask tensor (ALiBi; several queries after cached keys): the (T, S) bool
    # mask or ALiBi's (1, H, T, S) bias (masks.sdpa_mask), built once per forward for all layers, not by each
    sdpa_mask: torch.Tensor | None = None
    # Sequence parallelism: the group, this rank's slice of the call's tokens, and the whole sequence's (T,)
    # positions, which the kernel sees after the all-to-all (``positions`` and ``tables`` are the slice's;
    # ``document_ids`` the whole sequence's)
    sequence_parallel: SequenceParallel | None = None
    shard: SequenceShard | None = None
    kernel_positions: torch.Tensor | None = None

    def tables_at(self, positions: torch.Tensor) -> RotaryTables | None:
        if self.rotary is None or self.tables is None:
            return None
        return self.rotary.tables(positions, self.rope_length, self.tables.cos.dtype)


def mask_mode(cached: int, length: int) -> MaskMode:
    """The mask of ``length`` new queries after ``cached`` keys (see MaskMode)."""
    if cached == 0:
        return "causal"
    return "decode" if length == 1 else "general"


def build_context(scheme: PositionScheme, attention: AttentionConfig, input_ids_BT: torch.Tensor,
                  positions_T: torch.Tensor | None = None, cached_positions: torch.Tensor | None = None,
                  rope_length: int | None = None, cache_max_length: int | None = None,
                  table_dtype: torch.dtype = torch.float32, sequence_parallel: SequenceParallel | None = None
                  ) -> PositionContext:
    """The per-forward state of one call: positions, rotary tables, mask mode, document ids and
    (backend flex) the block mask. Everything is decided from the call's structure (cache or not,
    lengths); the only device read is the last of explicit ``positions_T``, and only when the dynamic-NTK
    length needs it and no ``rope_length`` is given.

    cached_positions: (S0,) positions already in the KV cache (None or empty: no cache content).
    rope_length: the length that fixes the dynamic-NTK base; default ``cache_max_length`` (the final
    length of a generation) or the last position + 1.
    sequence_parallel: ``input_ids_BT`` is the whole sequence, of which this rank holds its slice
    (model/sequence_parallel.py); no cache, no explicit positions.
    """
    if sequence_parallel is not None:
        if cached_positions is not None or positions_T is not None or cache_max_length is not None:
            raise ValueError("sequence parallelism: a forward over whole training sequences only (no KV cache, "
                             "no explicit positions); generate with a model without it")
        return _sharded_context(scheme, attention, input_ids_BT, sequence_parallel, rope_length, table_dtype)
    length, device = input_ids_BT.shape[1], input_ids_BT.device
    cached = 0 if cached_positions is None else int(cached_positions.shape[0])
    last_position: int | None = None
    if positions_T is None:
        positions_T = torch.arange(cached, cached + length, device=device)  # (T,) continue after the cache
        last_position = cached + length - 1
    rotary = scheme.rotary
    if rope_length is None:
        if cache_max_length is not None:
            rope_length = cache_max_length
        elif last_position is not None:
            rope_length = last_position + 1
        elif rotary is not None and rotary.scaling.type == "dynamic":
            rope_length = int(positions_T[-1]) + 1  # evaluation with explicit positions: one read per forward
        else:
            rope_length = length  # unused: only dynamic NTK depends on it
    tables = None
    if rotary is not None:
        tables = (rotary.range_tables(cached, length, rope_length, device, table_dtype) if last_position is not None
                  else rotary.tables(positions_T, rope_length, table_dtype))
    mode = mask_mode(cached, length)
    document_ids = None
    if attention.document_mask:
        if cached:
            raise ValueError("model.attention.document_mask: decoding with a KV cache is not supported; "
                             "generate with document_mask=false")
        document_ids = flex.document_ids(input_ids_BT, attention.eod_token_id)  # (B, T)
    slopes_H = scheme.slopes()
    needs_sdpa_mask = attention.backend == "sdpa" and (slopes_H is not None or mode == "general")
    block_mask = mask = None
    if attention.backend == "flex" or needs_sdpa_mask:  # the keys' positions: the cache's, then this call's
        key_positions = positions_T if not cached else torch.cat([cached_positions, positions_T])  # type: ignore[list-item]
        if needs_sdpa_mask:
            mask = sdpa_mask(positions_T, key_positions, slopes_H, table_dtype)
        else:
            block_mask = flex.build_block_mask(positions_T, key_positions, document_ids, document_ids)
    return PositionContext(positions=positions_T, rope_length=rope_length, rotary=rotary, tables=tables,
                           mask_mode=mode, last_position=last_position, document_ids=document_ids,
                           block_mask=block_mask, sdpa_mask=mask)


def _sharded_context(scheme: PositionScheme, attention: AttentionConfig, input_ids_BT: torch.Tensor,
                     sequence_parallel: SequenceParallel, rope_length: int | None, table_dtype: torch.dtype
                     ) -> PositionContext:
    """Sequence parallelism: this rank's slice of global positions and their rotary tables; the whole
    sequence's positions, document ids and block mask for the kernel after the all-to-all."""
    shard: SequenceShard = sequence_parallel.shard(input_ids_BT.shape[1])
    device = input_ids_BT.device
    positions_T = shard.positions(device)  # (T/P,) global positions of this rank's tokens
    all_positions = shard.global_positions(device)  # (T,)
    rope_length = shard.global_length if rope_length is None else rope_length  # dynamic NTK: the whole sequence
    rotary = scheme.rotary
    tables = (rotary.range_tables(shard.start, shard.length, rope_length, device, table_dtype) if rotary is not None
              else None)
    # every rank holds the whole sequence's ids, so its document mask needs no gather
    document_ids = flex.document_ids(input_ids_BT, attention.eod_token_id) if attention.document_mask else None
    block_mask = (flex.build_block_mask(all_positions, all_positions, document_ids, document_ids)
                  if attention.backend == "flex" else None)
    return PositionContext(positions=positions_T, rope_length=rope_length, rotary=rotary, tables=tables,
                           mask_mode="causal", last_position=shard.start + shard.length - 1,
                           document_ids=document_ids, block_mask=block_mask, sequence_parallel=sequence_parallel,
                           shard=shard, kernel_positions=all_positions)
