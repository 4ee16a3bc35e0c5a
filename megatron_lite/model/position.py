"""Every position scheme behind one interface (docs/design.md).

A scheme turns per-head projections into what an ordinary attention kernel consumes:

    q' = scheme.transform_query(q, tables)       k' = scheme.transform_key(k_or_t, tables)
    attention(q', k', v, causal, alibi_slopes)    -- the same kernel for every scheme

| scheme        | q'          | k'        | bias                      |
|---------------|-------------|-----------|---------------------------|
| none          | q           | k         | -                         |
| learned/sin.  | q           | k         | - (added to embeddings)   |
| alibi         | q           | k         | -slope_h * (m - n)        |
| rope          | R_m q       | R_n k     | -                         |
| coca slack    | q * R_m q   | R_n t     | -                         |
| coca strict   | R_m u       | R_n w     | -                         |

CoCA (paper Eq. 6-11): the K slot of the fused QKV projection produces t_raw; the collinear
coefficient of each rotary pair (i, i + r/2) is c_i = relu((t_i + t_{i+r/2}) / 2), and t = [c, c].
Slack's score sum_d q_d (R_n t)_d (R_m q)_d factors as (q * R_m q) . (R_n t) because two operands
share the query index. Strict's score sum_j c_{n,j} |q_{m,j}|^2 cos((m - n) theta_j) (Eq. 18) is
(R_m u) . (R_n w) with u_j = |q_{m,j}|^2, w_j = c_{n,j} and zeros in the second half of each pair.
Both are plain QK^T: O(N d) memory, fused kernels, KV cache = (k', v).

``reference_scores`` computes the paper's own materialised forms (slack: the opt_einsum
3-operand contraction; strict: the explicit Eq. 10 key tensor of shape (T, S, d)); they are the
test oracles and the benchmark baseline, never the training path.
"""

from __future__ import annotations

import math
from typing import Any

import opt_einsum
import torch
from torch import nn

from megatron_lite.config import ModelConfig
from megatron_lite.model.rope import (RotaryEmbedding, RotaryTables, apply_rotary, eager_kernels, empty_like_layout,
                                      rotate)

def alibi_slopes(num_heads: int) -> list[float]:
    """Press et al. head slopes, including non-power-of-2 head counts (official get_slopes)."""

    def power_of_two_slopes(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (h + 1) for h in range(n)]

    if math.log2(num_heads).is_integer():
        return power_of_two_slopes(num_heads)
    closest = 2 ** math.floor(math.log2(num_heads))
    return power_of_two_slopes(closest) + alibi_slopes(2 * closest)[0::2][: num_heads - closest]


def pair_coefficients(t_raw: torch.Tensor, rotary_dims: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """CoCA's coefficients, one per pair: c_i = relu((t_i + t_{i+r/2}) / 2) over the rotary dims,
    and the same over the pass-through dims (>= r), paired among themselves. (..., D) -> (..., r/2), (..., (D-r)/2)."""
    half = rotary_dims // 2
    c_rot = torch.relu((t_raw[..., :half] + t_raw[..., half:rotary_dims]) * 0.5)
    if t_raw.shape[-1] == rotary_dims:
        return c_rot, None
    rest = t_raw[..., rotary_dims:]
    rest_half = rest.shape[-1] // 2
    return c_rot, torch.relu((rest[..., :rest_half] + rest[..., rest_half:]) * 0.5)


def collinear_coefficients(t_raw: torch.Tensor, rotary_dims: int) -> torch.Tensor:
    """CoCA's T: non-negative, equal within each rotary pair (i, i + r/2). (..., D) -> (..., D).

    With rotary_pct = 1 this is exactly the official layout (halves of the head dim). Pass-through
    dims (>= r) are paired among themselves the same way.
    """
    c_rot, c_pass = pair_coefficients(t_raw, rotary_dims)
    parts = [c_rot, c_rot] if c_pass is None else [c_rot, c_rot, c_pass, c_pass]
    return torch.cat(parts, dim=-1)


def cat_heads_last(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate (B, H, T, k) pieces along k with a (B, T, H, D) memory layout — the layout of the
    QKV projection's views — so the kernel output reshapes to (B, T, C) without a copy."""
    return torch.cat([part.transpose(1, 2) for part in parts], dim=-1).transpose(1, 2)


class _SlackQuery(torch.autograd.Function):
    """q' = q * R q. Autograd would save R q (a new (B, H, T, D) tensor); this saves only q, a view of
    the QKV output that the kernel keeps alive anyway. Backward, d/dq (q * R q)^T g = g * R q + R^T (g * q),
    written out per rotary pair (cos c and sin s shared by its two members) so that R q is never rebuilt:
    (2 c g1 q1 + s q2 (g2 - g1), 2 c g2 q2 + s q1 (g2 - g1)), and 2 g q on the pass-through dims."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(q, cos, sin)
        return q * rotate(q, cos, sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        q, cos, sin = ctx.saved_tensors
        rotary_dims = cos.shape[-1]
        half = rotary_dims // 2
        c, s = _half_tables(cos, sin, rotary_dims, q.dtype)  # (T, r/2)
        q1, q2, g1, g2 = q[..., :half], q[..., half:rotary_dims], grad[..., :half], grad[..., half:rotary_dims]
        s_dg = (g2 - g1).mul_(s)  # (B, H, T, r/2)
        two_c = c * 2
        if torch.compiler.is_compiling():  # traced: expressions inductor fuses (dynamo takes no out= into a slice)
            parts = [g1 * q1 * two_c + q2 * s_dg, g2 * q2 * two_c + q1 * s_dg]
            if rotary_dims < q.shape[-1]:
                parts.append(grad[..., rotary_dims:] * q[..., rotary_dims:] * 2)
            return torch.cat(parts, dim=-1), None, None
        grad_q = empty_like_layout(grad)
        torch.mul(g1, q1, out=grad_q[..., :half]).mul_(two_c).addcmul_(q2, s_dg)
        torch.mul(g2, q2, out=grad_q[..., half:rotary_dims]).mul_(two_c).addcmul_(q1, s_dg)
        if rotary_dims < q.shape[-1]:
            torch.mul(grad[..., rotary_dims:], q[..., rotary_dims:], out=grad_q[..., rotary_dims:]).mul_(2)
        return grad_q, None, None


class _CollinearKey(torch.autograd.Function):
    """Both CoCA keys, k' = [c a, c b] with c = relu((t_i + t_{i+r/2}) / 2) per rotary pair and (T, r/2) tables
    a, b in t's dtype (slack: cos - sin, cos + sin, i.e. R_n [c, c]; strict: cos, sin, i.e. R_n [c, 0]), then [c', c']
    from the pass-through dims' pairs: the expressions of ``transform_key`` with the same roundings, each half
    written once into the output. Backward, t's gradient straight from the incoming one:
    d/dt_i = d/dt_{i+r/2} = [c > 0] (g_i a + g_{i+r/2} b) / 2, where autograd would allocate and sum a zero-padded
    buffer per half and a gradient per product (about half the bytes moved)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, first: torch.Tensor, second: torch.Tensor,  # type: ignore[override]
                rotary_dims: int) -> torch.Tensor:
        half = rotary_dims // 2
        out = empty_like_layout(t)
        c_rot = _pair_mean_relu(t[..., :rotary_dims])  # (B, H, T, r/2)
        torch.mul(c_rot, first, out=out[..., :half])
        torch.mul(c_rot, second, out=out[..., half:rotary_dims])
        c_pass = None
        if t.shape[-1] > rotary_dims:
            c_pass = _pair_mean_relu(t[..., rotary_dims:])  # (B, H, T, (D - r)/2)
            width = c_pass.shape[-1]
            out[..., rotary_dims:rotary_dims + width] = c_pass
            out[..., rotary_dims + width:] = c_pass
        ctx.save_for_backward(c_rot, c_pass, first, second)
        ctx.rotary_dims = rotary_dims
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        c_rot, c_pass, first, second = ctx.saved_tensors
        rotary_dims = ctx.rotary_dims
        half = rotary_dims // 2
        grad_t = empty_like_layout(grad)
        # d/dc / 2 (the pair mean's 1/2 folded into the tables, exactly): (B, H, T, r/2)
        d_half = torch.mul(grad[..., :half], first * 0.5).addcmul_(grad[..., half:rotary_dims], second * 0.5)
        _pair_mean_relu_backward(d_half, c_rot, grad_t[..., :rotary_dims])
        if c_pass is not None:
            width = c_pass.shape[-1]
            d_half = torch.add(grad[..., rotary_dims:rotary_dims + width], grad[..., rotary_dims + width:]).mul_(0.5)
            _pair_mean_relu_backward(d_half, c_pass, grad_t[..., rotary_dims:])
        return grad_t, None, None, None


class _StrictQuery(torch.autograd.Function):
    """Strict CoCA's query, R_m [u, 0] = [u cos, u sin] with u = q_i^2 + q_{i+r/2}^2 per rotary pair, then q^2 on the
    pass-through dims: ``CoCAStrict.transform_query``'s expression with the same roundings, each part written once.
    Saves q (a view of the QKV output, alive anyway) and the tables; backward d/dq_i = 2 q_i (g_i cos + g_{i+r/2}
    sin) on both members of a pair, 2 q g on the pass-through dims."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,  # type: ignore[override]
                rotary_dims: int) -> torch.Tensor:
        half = rotary_dims // 2
        out = empty_like_layout(q)
        pair_norm2 = torch.mul(q[..., :half], q[..., :half]).add_(q[..., half:rotary_dims] * q[..., half:rotary_dims])
        torch.mul(pair_norm2, cos, out=out[..., :half])
        torch.mul(pair_norm2, sin, out=out[..., half:rotary_dims])
        if q.shape[-1] > rotary_dims:
            torch.mul(q[..., rotary_dims:], q[..., rotary_dims:], out=out[..., rotary_dims:])
        ctx.save_for_backward(q, cos, sin)
        ctx.rotary_dims = rotary_dims
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        q, cos, sin = ctx.saved_tensors
        rotary_dims = ctx.rotary_dims
        half = rotary_dims // 2
        grad_q = empty_like_layout(grad)
        d_pair = torch.mul(grad[..., :half], cos * 2).addcmul_(grad[..., half:rotary_dims], sin * 2)  # 2 d/du
        torch.mul(q[..., :half], d_pair, out=grad_q[..., :half])
        torch.mul(q[..., half:rotary_dims], d_pair, out=grad_q[..., half:rotary_dims])
        if q.shape[-1] > rotary_dims:
            torch.mul(q[..., rotary_dims:], grad[..., rotary_dims:] * 2, out=grad_q[..., rotary_dims:])
        return grad_q, None, None, None


def _half_tables(cos: torch.Tensor, sin: torch.Tensor, rotary_dims: int, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the first half of the rotary dims (one per pair: both halves are equal), (T, r/2) in ``dtype``."""
    half = rotary_dims // 2
    return cos[:, :half].to(dtype), sin[:, :half].to(dtype)


def _pair_mean_relu(x: torch.Tensor) -> torch.Tensor:
    """relu((x_i + x_{i+w/2}) * 0.5) over the pairs of the last dim (w even), as ``pair_coefficients`` rounds it."""
    width = x.shape[-1] // 2
    return torch.add(x[..., :width], x[..., width:]).mul_(0.5).relu_()


def _pair_mean_relu_backward(d_half: torch.Tensor, c: torch.Tensor, out: torch.Tensor) -> None:
    """Both halves of ``out`` (the pair's two inputs) = [c > 0] * d_half (d/dc already halved), written in place."""
    width = c.shape[-1]
    # where, not a multiply by the mask: a non-finite gradient at a clipped pair stays 0, as relu's own backward
    torch.where(c > 0, d_half, d_half.new_zeros(()), out=out[..., :width])
    out[..., width:] = out[..., :width]


def collinear_key_eq8(q_BHTD: torch.Tensor, t_BHTD: torch.Tensor) -> torch.Tensor:
    """Paper Eq. 8: the strict key at the query's own position, k = t * q (before rotation)."""
    return t_BHTD * q_BHTD


class PositionScheme(nn.Module):
    """Base: identity transforms, no embedding, no bias. Rotary schemes own their ``rotary``."""

    rotary: RotaryEmbedding | None = None

    def embed(self, positions: torch.Tensor, last_position: int | None = None) -> torch.Tensor | None:
        """Additive (T, hidden) embedding for absolute schemes; None otherwise. ``last_position`` is the
        largest position when the caller knows it without reading ``positions``."""
        return None

    def transform_query(self, q_BHTD: torch.Tensor, tables: RotaryTables | None) -> torch.Tensor:
        return q_BHTD

    def transform_key(self, k_BHTD: torch.Tensor, tables: RotaryTables | None) -> torch.Tensor:
        return k_BHTD

    def slopes(self) -> torch.Tensor | None:
        """ALiBi slopes (H,) float32 or None."""
        return None

    def reference_scores(
        self,
        q_BHTD: torch.Tensor,
        k_BHSD: torch.Tensor,
        q_tables: RotaryTables | None,
        k_tables: RotaryTables | None,
    ) -> torch.Tensor:
        """Unscaled, unmasked scores (B, H, T, S) from raw projections, materialised."""
        return self.transform_query(q_BHTD, q_tables) @ self.transform_key(k_BHSD, k_tables).transpose(-1, -2)


class NoPosition(PositionScheme):
    pass


class LearnedPosition(PositionScheme):
    def __init__(self, max_positions: int, hidden_size: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(max_positions, hidden_size)

    def embed(self, positions: torch.Tensor, last_position: int | None = None) -> torch.Tensor:
        limit = self.embedding.num_embeddings
        if last_position is None and positions.numel():  # explicit positions (evaluation): one read
            last_position = int(positions.max())
        if last_position is not None and last_position >= limit:
            raise ValueError(
                f"position {last_position} is beyond model.max_position_embeddings={limit} "
                "of the learned scheme; learned positions cannot extrapolate"
            )
        return self.embedding(positions)


class SinusoidalPosition(PositionScheme):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size

    def embed(self, positions: torch.Tensor, last_position: int | None = None) -> torch.Tensor:
        """Vaswani et al.: sin on even, cos on odd dims; (T, hidden) float32."""
        dims = torch.arange(0, self.hidden_size, 2, dtype=torch.float64, device=positions.device)
        angles = positions.to(torch.float64)[:, None] / (10000.0 ** (dims / self.hidden_size))[None, :]
        table = torch.zeros(positions.shape[0], self.hidden_size, dtype=torch.float64, device=positions.device)
        table[:, 0::2] = angles.sin()
        table[:, 1::2] = angles.cos()[:, : self.hidden_size // 2]
        return table.to(torch.float32)


class ALiBi(PositionScheme):
    def __init__(self, num_heads: int) -> None:
        super().__init__()
        self.slope_values = alibi_slopes(num_heads)
        self.register_buffer("alibi_slopes", torch.tensor(self.slope_values, dtype=torch.float32), persistent=False)

    def _apply(self, fn: Any, recurse: bool = True) -> "ALiBi":
        """Module casts (``model.bfloat16()``, DeepSpeed's bf16) move the slopes but keep them float32: in bf16,
        2**-0.5 would become 0.70703125 and the bias -slope (m - n) would differ from the exported model's."""
        super()._apply(fn, recurse)
        moved = self.alibi_slopes
        if moved.dtype != torch.float32:
            self.alibi_slopes = torch.tensor(self.slope_values, dtype=torch.float32, device=moved.device)
        return self

    def slopes(self) -> torch.Tensor:
        """(H,) float32 on the module's device."""
        return self.alibi_slopes


class RoPE(PositionScheme):
    def __init__(self, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.rotary = rotary

    def transform_query(self, q_BHTD: torch.Tensor, tables: RotaryTables | None) -> torch.Tensor:
        assert tables is not None
        return apply_rotary(q_BHTD, tables)

    def transform_key(self, k_BHTD: torch.Tensor, tables: RotaryTables | None) -> torch.Tensor:
        assert tables is not None
        return apply_rotary(k_BHTD, tables)


class _CoCA(PositionScheme):
    """Both CoCA variants: queries and keys are rewritten over the first ``rotary_dims`` of a head."""

    def __init__(self, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.rotary = rotary
        self.rotary_dims = rotary.rotary_dims


class CoCASlack(_CoCA):
    """Paper Eq. 11, score(m, n) = (q_m * R_m q_m) . (R_n t_n)."""

    def transform_query(self, q_BHTD: torch.Tensor, tables: RotaryTables | None) -> torch.Tensor:
        assert tables is not None
        return _SlackQuery.apply(q_BHTD, tables.cos, tables.sin)

    def transform_key(self, k_BHTD: torch.Tensor, tables: RotaryTables | None) -> torch.Tensor:
        """R_n [c, c] = [c (cos - sin), c (cos + sin)] without materialising [c, c]; eager in bf16/fp16 as one
        autograd function (``_CollinearKey``: the same values, half the bytes moved in backward)."""
        assert tables is not None
        cos, sin = _half_tables(tables.cos, tables.sin, self.rotary_dims, k_BHTD.dtype)
        if eager_kernels(k_BHTD):
            return _CollinearKey.apply(k_BHTD, cos - sin, cos + sin, self.rotary_dims)
        c_rot, c_pass = pair_coefficients(k_BHTD, self.rotary_dims)  # (B, H, T, r/2)
        parts = [c_rot * (cos - sin), c_rot * (cos + sin)]
        if c_pass is not None:
            parts += [c_pass, c_pass]
        return cat_heads_last(parts)

    def reference_scores(self, q_BHTD, k_BHSD, q_tables, k_tables):  # type: ignore[override]
        """The official code's contraction: einsum('bhmd,bhnd,bhmd->bhmn', q, R t, R q)."""
        assert q_tables is not None and k_tables is not None
        t_rotated = apply_rotary(collinear_coefficients(k_BHSD, self.rotary_dims), k_tables)
        q_rotated = apply_rotary(q_BHTD, q_tables)
        return opt_einsum.contract("bhmd,bhnd,bhmd->bhmn", q_BHTD, t_rotated, q_rotated, backend="torch")


class CoCAStrict(_CoCA):
    """Paper Eq. 10 via Eq. 18: score(m, n) = sum_j c_{n,j} |q_{m,j}|^2 cos((m - n) theta_j)."""

    def transform_query(self, q_BHTD: torch.Tensor, tables: RotaryTables | None) -> torch.Tensor:
        """R_m [u, 0] = [u cos, u sin]; eager in bf16/fp16 as one autograd function (``_StrictQuery``)."""
        assert tables is not None
        half = self.rotary_dims // 2
        cos, sin = _half_tables(tables.cos, tables.sin, self.rotary_dims, q_BHTD.dtype)
        if eager_kernels(q_BHTD):
            return _StrictQuery.apply(q_BHTD, cos, sin, self.rotary_dims)
        q_first, q_second = q_BHTD[..., :half], q_BHTD[..., half : self.rotary_dims]
        pair_norm2 = q_first * q_first + q_second * q_second  # (B, H, T, r/2): u_j = |q_pair_j|^2
        # R_m [u, 0] = [u cos, u sin]; pass-through dims contribute q_i^2 t_i.
        parts = [pair_norm2 * cos, pair_norm2 * sin]
        if q_BHTD.shape[-1] > self.rotary_dims:
            q_pass = q_BHTD[..., self.rotary_dims :]
            parts.append(q_pass * q_pass)
        return cat_heads_last(parts)

    def transform_key(self, k_BHTD: torch.Tensor, tables: RotaryTables | None) -> torch.Tensor:
        """R_n [c, 0] = [c cos, c sin]; eager in bf16/fp16 as one autograd function (``_CollinearKey``)."""
        assert tables is not None
        cos, sin = _half_tables(tables.cos, tables.sin, self.rotary_dims, k_BHTD.dtype)
        if eager_kernels(k_BHTD):
            return _CollinearKey.apply(k_BHTD, cos, sin, self.rotary_dims)
        c_rot, c_pass = pair_coefficients(k_BHTD, self.rotary_dims)  # (B, H, T, r/2) one per rotary pair
        parts = [c_rot * cos, c_rot * sin]  # R_n [c, 0]
        if c_pass is not None:
            parts += [c_pass, c_pass]
        return cat_heads_last(parts)

    def reference_scores(self, q_BHTD, k_BHSD, q_tables, k_tables):  # type: ignore[override]
        """Explicit Eq. 10: key tensor R_n (t_n * q_m) for every (m, n), shape (B, H, T, S, D)."""
        assert q_tables is not None and k_tables is not None
        t = collinear_coefficients(k_BHSD, self.rotary_dims)
        keys_BHTSD = collinear_key_eq8(q_BHTD[:, :, :, None, :], t[:, :, None, :, :])
        keys_BHTSD = apply_rotary(keys_BHTSD, k_tables)  # rotation at the key position n (dim S)
        return torch.einsum("bhmd,bhmnd->bhmn", apply_rotary(q_BHTD, q_tables), keys_BHTSD)


def build_position_scheme(config: ModelConfig) -> PositionScheme:
    scheme = config.position.scheme
    if scheme == "none":
        return NoPosition()
    if scheme == "learned":
        return LearnedPosition(config.max_positions, config.hidden_size)
    if scheme == "sinusoidal":
        return SinusoidalPosition(config.hidden_size)
    if scheme == "alibi":
        return ALiBi(config.num_attention_heads)
    rotary = build_rotary(config)
    if scheme == "rope":
        assert rotary is not None
        return RoPE(rotary)
    if scheme == "coca":
        assert rotary is not None
        return CoCASlack(rotary) if config.position.constraint == "slack" else CoCAStrict(rotary)
    raise ValueError(f"model.position.scheme={scheme!r}: unknown scheme")


def build_rotary(config: ModelConfig) -> RotaryEmbedding | None:
    if not config.uses_rotary:
        return None
    position = config.position
    return RotaryEmbedding(config.rotary_dims, position.rotary_emb_base, position.scaling, config.rotary_train_length)
