"""The explicit attention masks: which keys each query sees, and ALiBi's bias, from the positions alone."""

from __future__ import annotations

import torch


def causal_allowed(q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """(T, S) bool: key n is visible to query m iff n <= m."""
    return k_positions[None, :] <= q_positions[:, None]


def attention_mask(
    q_positions: torch.Tensor, k_positions: torch.Tensor, slopes_H: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """Boolean (T, S) causal mask, or with ALiBi a float (H, T, S) bias -slope_h (m - n), -inf above."""
    allowed = causal_allowed(q_positions, k_positions)
    if slopes_H is None:
        return allowed
    distance = (k_positions[None, :] - q_positions[:, None]).to(dtype)  # n - m <= 0 where visible
    bias = slopes_H.to(dtype)[:, None, None] * distance[None]
    return bias.masked_fill(~allowed, float("-inf"))


def sdpa_mask(q_positions: torch.Tensor, k_positions: torch.Tensor, slopes_H: torch.Tensor | None,
              dtype: torch.dtype) -> torch.Tensor:
    """``attention_mask`` as torch's SDPA takes it: a (T, S) bool mask, or ALiBi's bias as (1, H, T, S) (the
    fused CPU kernel takes 2-D or 4-D masks only)."""
    mask = attention_mask(q_positions, k_positions, slopes_H, dtype)
    return mask[None] if mask.dim() == 3 else mask
