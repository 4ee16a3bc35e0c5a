"""Grouped-query attention: key/value head j serves query heads j * g ... (j + 1) * g - 1 (g = H / H_kv),
the grouping of HF ``repeat_kv``, torch SDPA's and FlexAttention's ``enable_gqa``."""

from __future__ import annotations

import torch


def is_grouped(q_BHTD: torch.Tensor, k_BKSD: torch.Tensor) -> bool:
    """Whether fewer key/value heads than query heads come in (H_kv < H)."""
    return k_BKSD.shape[1] != q_BHTD.shape[1]


def repeat_kv(x_BKSD: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, H_kv, S, D) -> (B, H, S, D): each key/value head repeated for its group of query heads; for the
    paths that take no ``enable_gqa`` (materialised references, the dense flex fallback)."""
    groups = num_heads // x_BKSD.shape[1]
    return x_BKSD if groups == 1 else x_BKSD.repeat_interleave(groups, dim=1)
