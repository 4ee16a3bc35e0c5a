"""Fused QKV projection + kernel dispatch. The kernel never knows which position scheme ran.

The mask mode (causal, decode against a cache, general) comes from the PositionContext, decided once
per forward from the call's structure: no kernel path reads a device tensor to choose its mask.

Backends (model.attention.backend):
  sdpa       torch scaled_dot_product_attention (FlashAttention / memory-efficient on GPU).
  flash      flash-attn 2 package (CUDA, fp16/bf16); ALiBi through its ``alibi_slopes``.
  flex       torch FlexAttention (torch >= 2.5): ALiBi as a score_mod, causal and document masks as
             one block mask per forward (megatron_lite/model/flex.py).
  chunked    query blocks of ``chunk_size`` over the visible keys: O(chunk * N) memory for any
             scheme, ALiBi included; the long-context path on CPU and GPU.
  reference  materialised scores exactly as the paper computes them (scheme.reference_scores).
"""

from __future__ import annotations

import importlib.util
import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.config import BACKENDS, ModelConfig
from megatron_lite.model import flex
from megatron_lite.model.context import MaskMode, PositionContext, mask_mode
from megatron_lite.model.gqa import is_grouped, repeat_kv
from megatron_lite.model.kv_cache import LayerCache
from megatron_lite.model.masks import attention_mask, bias_dtype, sdpa_mask
from megatron_lite.model.position import PositionScheme
from megatron_lite.model.rope import RotaryTables


def sdpa_attention(
    q_BHTD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    mode: MaskMode,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    slopes_H: torch.Tensor | None,
    scale: float,
    dropout_p: float = 0.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """k/v may have fewer (grouped-query) heads than q: SDPA's ``enable_gqa`` pairs them without a copy.
    ``mask``: ``sdpa_mask`` of these positions and slopes, built once per forward for every layer
    (``PositionContext.sdpa_mask``); None: built here where the mode needs one."""
    gqa = is_grouped(q_BHTD, k_BHSD)
    if slopes_H is None and mode == "causal":  # the kernel's own causal path (no mask tensor)
        return F.scaled_dot_product_attention(q_BHTD, k_BHSD, v_BHSD, is_causal=True, scale=scale, dropout_p=dropout_p,
                                              enable_gqa=gqa)
    if slopes_H is None and mode == "decode":  # every cached key precedes the one query
        return F.scaled_dot_product_attention(q_BHTD, k_BHSD, v_BHSD, scale=scale, dropout_p=dropout_p, enable_gqa=gqa)
    if mask is None:
        mask = sdpa_mask(q_positions, k_positions, slopes_H, q_BHTD.dtype)
    if mask.is_floating_point():
        return sdpa_with_bias(q_BHTD, k_BHSD, v_BHSD, mask, scale, dropout_p, gqa)
    return F.scaled_dot_product_attention(q_BHTD, k_BHSD, v_BHSD, attn_mask=mask, scale=scale, dropout_p=dropout_p,
                                          enable_gqa=gqa)


def sdpa_with_bias(q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, bias_1HTS: torch.Tensor,
                   scale: float, dropout_p: float, gqa: bool) -> torch.Tensor:
    """SDPA with ALiBi's bias, never rounded below float32 (``masks.bias_dtype``): in bf16 distances above 256 would
    share biases. The CPU kernels take a float32 bias with bf16/fp16 queries; CUDA's memory-efficient kernel takes a
    bias only in the queries' dtype, so half-precision q/k/v run in float32 there (exact, slower: the flex and
    flash backends add ALiBi inside the kernel instead)."""
    bias_1HTS = bias_1HTS.to(bias_dtype(q_BHTD.dtype))
    dtype = q_BHTD.dtype
    if q_BHTD.device.type == "cuda" and dtype != bias_1HTS.dtype:
        q_BHTD, k_BHSD, v_BHSD = (t.to(bias_1HTS.dtype) for t in (q_BHTD, k_BHSD, v_BHSD))
    out_BHTD = F.scaled_dot_product_attention(q_BHTD, k_BHSD, v_BHSD, attn_mask=bias_1HTS, scale=scale,
                                              dropout_p=dropout_p, enable_gqa=gqa)
    return out_BHTD.to(dtype)


def chunked_attention(q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, q_positions: torch.Tensor,
                      k_positions: torch.Tensor, slopes_H: torch.Tensor | None, scale: float, chunk_size: int,
                      dropout_p: float = 0.0) -> torch.Tensor:
    """Query blocks; each attends only to the keys up to its last query. The S - T keys before the first
    query are cached ones, so a block's visible keys follow from the shapes alone."""
    length, cached = q_BHTD.shape[-2], k_BHSD.shape[-2] - q_BHTD.shape[-2]
    outputs = []
    for start in range(0, length, chunk_size):
        end = min(start + chunk_size, length)
        visible = slice(0, cached + end)
        outputs.append(sdpa_attention(q_BHTD[:, :, start:end], k_BHSD[:, :, visible], v_BHSD[:, :, visible],
                                      mask_mode(cached + start, end - start), q_positions[start:end],
                                      k_positions[visible], slopes_H, scale, dropout_p))
    return torch.cat(outputs, dim=-2)


def flash_attention(q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, slopes_H: torch.Tensor | None,
                    scale: float, dropout_p: float = 0.0) -> torch.Tensor:
    """flash-attn 2: causal is bottom-right aligned, which matches contiguous cache positions."""
    from flash_attn import flash_attn_func

    out_BTHD = flash_attn_func(
        q_BHTD.transpose(1, 2),
        k_BHSD.transpose(1, 2),
        v_BHSD.transpose(1, 2),
        dropout_p=dropout_p,
        softmax_scale=scale,
        causal=True,
        alibi_slopes=None if slopes_H is None else slopes_H.to(torch.float32),
    )
    return out_BTHD.transpose(1, 2)


def reference_attention(
    scores_BHTS: torch.Tensor,
    v_BHSD: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    slopes_H: torch.Tensor | None,
    scale: float,
    document_ids_BT: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax over materialised scores (computed in at least float32); with ``document_ids_BT`` (self-attention
    only) a query also sees only keys of its own document."""
    compute_dtype = torch.promote_types(scores_BHTS.dtype, torch.float32)
    scores = scores_BHTS.to(compute_dtype) * scale
    mask = attention_mask(q_positions, k_positions, slopes_H, compute_dtype)
    scores = scores + mask if slopes_H is not None else scores.masked_fill(~mask, float("-inf"))
    if document_ids_BT is not None:
        same_document_BTS = document_ids_BT[:, :, None] == document_ids_BT[:, None, :]
        scores = scores.masked_fill(~same_document_BTS[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v_BHSD.dtype)
    return probs @ v_BHSD


def flash_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None and torch.cuda.is_available()


def check_backend_available(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"model.attention.backend={backend!r}: must be one of {', '.join(BACKENDS)}")
    if backend == "flex":
        flex.check_flex_available()
    if backend == "flash" and not flash_available():
        raise ValueError(
            "model.attention.backend='flash' needs the flash-attn package and a CUDA device; "
            "use 'sdpa' (FlashAttention through PyTorch) or 'chunked'"
        )


class AttentionKernel(nn.Module):
    """What every attention block shares: position transform, KV cache and kernel dispatch. Subclasses own
    the projections; the kernel takes q (B, H, T, D) and k/v with H or fewer (grouped-query) heads."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.kv_heads
        self.head_dim = config.head_dim
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.backend = config.attention.backend
        self.chunk_size = config.attention.chunk_size
        self.dropout_p = config.attention_dropout
        check_backend_available(self.backend)

    def attend(self, q_BHTD: torch.Tensor, k_BKTD: torch.Tensor, v_BKTD: torch.Tensor, scheme: PositionScheme,
               ctx: PositionContext, cache: LayerCache | None) -> torch.Tensor:
        """(B, H, T, D) attention output from raw projections (k_BKTD: the K or CoCA T slot)."""
        if ctx.sequence_parallel is not None:
            return self._attend_sequence_parallel(q_BHTD, k_BKTD, v_BKTD, scheme, ctx)
        slopes_H = scheme.slopes()
        if self.backend == "reference":
            # The paper path needs raw q and raw k/t; the cache holds raw keys here.
            keys_BKSD, v_BKSD, k_positions = k_BKTD, v_BKTD, ctx.positions
            if cache is not None:
                keys_BKSD, v_BKSD, k_positions = cache.append(k_BKTD, v_BKTD, ctx.positions)
            return self._reference(q_BHTD, keys_BKSD, v_BKSD, scheme, ctx, ctx.tables, ctx.tables_at(k_positions),
                                   ctx.positions, k_positions, slopes_H)
        q_BHTD = scheme.transform_query(q_BHTD, ctx.tables)
        keys_BKSD = scheme.transform_key(k_BKTD, ctx.tables)
        v_BKSD, k_positions = v_BKTD, ctx.positions
        if cache is not None:
            keys_BKSD, v_BKSD, k_positions = cache.append(keys_BKSD, v_BKTD, ctx.positions)
        return self._kernel(q_BHTD, keys_BKSD, v_BKSD, ctx.mask_mode, ctx.positions, k_positions, slopes_H,
                            ctx.block_mask, ctx.sdpa_mask)

    def _kernel(self, q_BHTD: torch.Tensor, keys_BKSD: torch.Tensor, v_BKSD: torch.Tensor, mode: MaskMode,
                q_positions: torch.Tensor, k_positions: torch.Tensor, slopes_H: torch.Tensor | None,
                block_mask: object, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The configured fused kernel on transformed q', k' and v (``mask``: the forward's ``sdpa_mask``)."""
        dropout_p = self.dropout_p if self.training else 0.0
        if self.backend == "sdpa":
            return sdpa_attention(q_BHTD, keys_BKSD, v_BKSD, mode, q_positions, k_positions, slopes_H, self.scale,
                                  dropout_p, mask)
        if self.backend == "flex":
            return flex.flex_attention_forward(q_BHTD, keys_BKSD, v_BKSD, block_mask, q_positions, k_positions,
                                               slopes_H, self.scale)
        if self.backend == "chunked":
            return chunked_attention(q_BHTD, keys_BKSD, v_BKSD, q_positions, k_positions, slopes_H, self.scale,
                                     self.chunk_size, dropout_p)
        return flash_attention(q_BHTD, keys_BKSD, v_BKSD, slopes_H, self.scale, dropout_p)

    def _reference(self, q_BHTD: torch.Tensor, keys_BKSD: torch.Tensor, v_BKSD: torch.Tensor, scheme: PositionScheme,
                   ctx: PositionContext, q_tables: RotaryTables | None, k_tables: RotaryTables | None,
                   q_positions: torch.Tensor, k_positions: torch.Tensor, slopes_H: torch.Tensor | None
                   ) -> torch.Tensor:
        """The paper's materialised scores from raw q and raw k/t."""
        heads = q_BHTD.shape[1]
        keys_BHSD, v_BHSD = repeat_kv(keys_BKSD, heads), repeat_kv(v_BKSD, heads)
        scores = scheme.reference_scores(q_BHTD, keys_BHSD, q_tables, k_tables)
        return reference_attention(scores, v_BHSD, q_positions, k_positions, slopes_H, self.scale, ctx.document_ids)

    def _attend_sequence_parallel(self, q_BHtD: torch.Tensor, k_BKtD: torch.Tensor, v_BKtD: torch.Tensor,
                                  scheme: PositionScheme, ctx: PositionContext) -> torch.Tensor:
        """This rank's T/P tokens, all heads: the position transform at the slice's global positions, then
        DeepSpeed's all-to-all around the kernel, which runs on H/P heads over the whole sequence
        (model/sequence_parallel.py)."""
        parallel, positions = ctx.sequence_parallel, ctx.kernel_positions
        assert parallel is not None and positions is not None
        slopes_H = scheme.slopes()
        slopes_h = None if slopes_H is None else slopes_H[parallel.heads]  # ALiBi slopes of this rank's heads

        if self.backend == "reference":  # raw q and k/t travel; the whole sequence's tables after the exchange
            tables = ctx.tables_at(positions)
            return parallel.attend(q_BHtD, k_BKtD, v_BKtD, lambda q, k, v: self._reference(
                q, k, v, scheme, ctx, tables, tables, positions, positions, slopes_h))
        q_BHtD = scheme.transform_query(q_BHtD, ctx.tables)
        keys_BKtD = scheme.transform_key(k_BKtD, ctx.tables)
        return parallel.attend(q_BHtD, keys_BKtD, v_BKtD, lambda q, k, v: self._kernel(
            q, k, v, "causal", positions, positions, slopes_h, ctx.block_mask))


class SelfAttention(AttentionKernel):
    """GPT-NeoX attention: fused per-head [q | k-or-t | v] projection with biases, output ``dense``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(
        self, x_BTC: torch.Tensor, scheme: PositionScheme, ctx: PositionContext, cache: LayerCache | None = None
    ) -> torch.Tensor:
        batch, length, _ = x_BTC.shape
        qkv_BTH3D = self.query_key_value(x_BTC).view(batch, length, self.num_heads, 3, self.head_dim)
        # unbind, not split along D: its backward stacks dq, dk, dv straight into the projection's contiguous
        # (B, T, H, 3, D) gradient; a split's cat came out (B, H, T, 3D) and took a second copy to (B, T, 3C)
        q_BHTD, k_BHTD, v_BHTD = (slot_BTHD.transpose(1, 2) for slot_BTHD in qkv_BTH3D.unbind(dim=3))
        out_BHTD = self.attend(q_BHTD, k_BHTD, v_BHTD, scheme, ctx, cache)
        return self.dense(out_BHTD.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim))


class LlamaAttention(AttentionKernel):
    """LLaMA-family attention (HF names): q_proj, k_proj (CoCA's T, one per key/value head, as the official
    LLaMA file), v_proj with H_kv <= H heads, o_proj; biases on q/k/v only with ``qkv_bias`` (Qwen2)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        hidden, query_width, kv_width = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, query_width, bias=config.qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_width, bias=config.qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_width, bias=config.qkv_bias)
        self.o_proj = nn.Linear(query_width, hidden, bias=False)

    def forward(
        self, x_BTC: torch.Tensor, scheme: PositionScheme, ctx: PositionContext, cache: LayerCache | None = None
    ) -> torch.Tensor:
        batch, length, _ = x_BTC.shape
        q_BHTD = self.q_proj(x_BTC).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        k_BKTD = self.k_proj(x_BTC).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v_BKTD = self.v_proj(x_BTC).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        out_BHTD = self.attend(q_BHTD, k_BKTD, v_BKTD, scheme, ctx, cache)
        return self.o_proj(out_BHTD.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim))
