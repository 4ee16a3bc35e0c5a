"""The explicit attention masks: which keys each query sees, and ALiBi's bias, from the positions alone."""

from __future__ import annotations

import torch


def causal_allowed(q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """(T, S) bool: key n is visible to query m iff n <= m."""
    return k_positions[None, :] <= q_positions[:, None]


def bias_dtype(dtype: torch.dtype) -> torch.dtype:
    """ALiBi's bias dtype for queries of ``dtype``: float32 at least. bf16 holds integers exactly only up to 256
    (fp16 up to 2048), so in the model dtype distances 300 and 301 (or their slope multiples) get one bias."""
    return torch.promote_types(dtype, torch.float32)


def attention_mask(
    q_positions: torch.Tensor, k_positions: torch.Tensor, slopes_H: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """Boolean (T, S) causal mask, or with ALiBi a float (H, T, S) bias -slope_h (m - n), -inf above, in
    ``bias_dtype(dtype)``: distances from the integer positions and the slope multiply both in that dtype
    (float32 is exact for every distance below 2**24)."""
    allowed = causal_allowed(q_positions, k_positions)
    if slopes_H is None:
        return allowed
    compute_dtype = bias_dtype(dtype)
    distance = (k_positions[None, :] - q_positions[:, None]).to(compute_dtype)  # n - m <= 0 where visible
    bias = slopes_H.to(compute_dtype)[:, None, None] * distance[None]
    return bias.masked_fill(~allowed, float("-inf"))


def sdpa_mask(q_positions: torch.Tensor, k_positions: torch.Tensor, slopes_H: torch.Tensor | None,
              dtype: torch.dtype) -> torch.Tensor:
    """``attention_mask`` as torch's SDPA takes it: a (T, S) bool mask, or ALiBi's float32 (float64) bias as
    (1, H, T, S) (the fused CPU kernel takes 2-D or 4-D masks only). SDPA accepts a float32 mask with bf16/fp16
    queries and the CPU kernels add it in their float32 accumulation (``sdpa_attention`` on CUDA: see there)."""
    mask = attention_mask(q_positions, k_positions, slopes_H, dtype)
    return mask[None] if mask.dim() == 3 else mask
