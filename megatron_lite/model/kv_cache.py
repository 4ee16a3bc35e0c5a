"""Preallocated key/value cache for incremental decoding.

The cache holds what the kernel consumes: k' (already position-transformed: R_n k for RoPE, R_n t
for CoCA slack, R_n w for CoCA strict) and v, plus the key positions (for causal masks and ALiBi).
The reference backend stores raw keys instead, because the paper's forms need raw k/t.
"""

from __future__ import annotations

import torch


class LayerCache:
    def __init__(self, max_length: int) -> None:
        self.max_length = max_length
        self.length = 0
        self.keys: torch.Tensor | None = None  # (B, H, max_length, D)
        self.values: torch.Tensor | None = None  # (B, H, max_length, D)
        self.positions: torch.Tensor | None = None  # (max_length,)

    def append(
        self, keys_BHTD: torch.Tensor, values_BHTD: torch.Tensor, positions_T: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store new entries; return views of everything cached so far (keys, values, positions)."""
        new = keys_BHTD.shape[-2]
        if self.length + new > self.max_length:
            raise ValueError(
                f"KV cache overflow: {self.length} cached + {new} new tokens > max_length={self.max_length}"
            )
        if self.keys is None:
            batch, heads, _, _ = keys_BHTD.shape
            self.keys = keys_BHTD.new_empty(batch, heads, self.max_length, keys_BHTD.shape[-1])
            self.values = values_BHTD.new_empty(batch, heads, self.max_length, values_BHTD.shape[-1])
            self.positions = positions_T.new_empty(self.max_length)
        assert self.values is not None and self.positions is not None
        end = self.length + new
        self.keys[:, :, self.length : end] = keys_BHTD
        self.values[:, :, self.length : end] = values_BHTD
        self.positions[self.length : end] = positions_T
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end], self.positions[:end]


class KVCache:
    """One LayerCache per block; ``max_length`` also fixes the dynamic-NTK base for the whole generation
    (``GPT.forward`` uses it as ``rope_length`` when none is given)."""

    def __init__(self, num_layers: int, max_length: int) -> None:
        self.max_length = max_length
        self.layers = [LayerCache(max_length) for _ in range(num_layers)]

    @property
    def length(self) -> int:
        return self.layers[0].length

    def cached_positions(self) -> torch.Tensor | None:
        """(length,) positions of what the cache holds; None while it is empty."""
        layer = self.layers[0]
        return None if layer.positions is None or layer.length == 0 else layer.positions[: layer.length]
