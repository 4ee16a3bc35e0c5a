"""Position schemes: CoCA fused forms == the paper's materialised forms, collinearity, shift
(in)variance, ALiBi slopes. Float64 so the equalities are exact up to rounding."""

from __future__ import annotations

import math
from typing import Any

import opt_einsum
import pytest
import torch

from megatron_lite.config import RopeScalingConfig
from megatron_lite.model.attention import reference_attention, sdpa_attention
from megatron_lite.model.position import (
    ALiBi,
    CoCASlack,
    CoCAStrict,
    RoPE,
    alibi_slopes,
    collinear_coefficients,
    collinear_key_eq8,
)
from megatron_lite.model.rope import RotaryEmbedding

B, H, T, D = 2, 3, 19, 16


def make_inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, D, dtype=torch.float64, generator=generator) for _ in range(3))
    return q, k, v


def rotary_for(rotary_dims: int = D) -> RotaryEmbedding:
    return RotaryEmbedding(rotary_dims, 10000.0, RopeScalingConfig(), train_length=16)


def tables_for(positions: torch.Tensor, rotary_dims: int = D, seq_len: int = T):
    return rotary_for(rotary_dims).tables(positions, seq_len, torch.float64)


def fused_scores(scheme, q, k, q_tables, k_tables) -> torch.Tensor:
    return scheme.transform_query(q, q_tables) @ scheme.transform_key(k, k_tables).transpose(-1, -2)


@pytest.mark.parametrize("rotary_dims", [D, D // 2])
def test_coca_slack_fused_equals_official_opt_einsum_contraction(rotary_dims: int) -> None:
    q, k, v = make_inputs()
    positions = torch.arange(T)
    tables = tables_for(positions, rotary_dims)
    scheme = CoCASlack(rotary_for(rotary_dims))
    # The official code: contract('bpnd,bpsd,bpnd->bpns', q, R t, R q), written out here.
    t = collinear_coefficients(k, rotary_dims)
    from megatron_lite.model.rope import apply_rotary

    oracle = opt_einsum.contract("bhmd,bhnd,bhmd->bhmn", q, apply_rotary(t, tables), apply_rotary(q, tables), backend="torch")
    assert (fused_scores(scheme, q, k, tables, tables) - oracle).abs().max() <= 1e-10

    scale = 1 / math.sqrt(D)
    via_sdpa = sdpa_attention(scheme.transform_query(q, tables), scheme.transform_key(k, tables), v, "causal", positions, positions, None, scale)
    via_reference = reference_attention(oracle, v, positions, positions, None, scale)
    assert (via_sdpa - via_reference).abs().max() <= 1e-10


@pytest.mark.parametrize("rotary_dims", [D, D // 2])
def test_coca_strict_fused_equals_explicit_eq10(rotary_dims: int) -> None:
    q, k, v = make_inputs(1)
    positions = torch.arange(T)
    tables = tables_for(positions, rotary_dims)
    scheme = CoCAStrict(rotary_for(rotary_dims))
    # Explicit Eq. 10 written independently: for every (m, n) build the key R_n (t_n * q_m)
    # pair by pair and dot it with R_m q_m.
    t = collinear_coefficients(k, rotary_dims)
    half = rotary_dims // 2
    theta = 10000.0 ** (-torch.arange(half, dtype=torch.float64) * 2 / rotary_dims)
    oracle = torch.zeros(B, H, T, T, dtype=torch.float64)
    for m in range(T):
        for n in range(T):
            key = t[:, :, n] * q[:, :, m]  # (B, H, D): Eq. 8 key at position n
            a_m, a_n = m * theta, n * theta
            q_rot_first = q[:, :, m, :half] * torch.cos(a_m) - q[:, :, m, half:rotary_dims] * torch.sin(a_m)
            q_rot_second = q[:, :, m, half:rotary_dims] * torch.cos(a_m) + q[:, :, m, :half] * torch.sin(a_m)
            k_rot_first = key[..., :half] * torch.cos(a_n) - key[..., half:rotary_dims] * torch.sin(a_n)
            k_rot_second = key[..., half:rotary_dims] * torch.cos(a_n) + key[..., :half] * torch.sin(a_n)
            oracle[:, :, m, n] = (
                (q_rot_first * k_rot_first).sum(-1)
                + (q_rot_second * k_rot_second).sum(-1)
                + (q[:, :, m, rotary_dims:] * key[..., rotary_dims:]).sum(-1)
            )
    assert (fused_scores(scheme, q, k, tables, tables) - oracle).abs().max() <= 1e-10
    assert (scheme.reference_scores(q, k, tables, tables) - oracle).abs().max() <= 1e-10

    scale = 1 / math.sqrt(D)
    via_sdpa = sdpa_attention(scheme.transform_query(q, tables), scheme.transform_key(k, tables), v, "causal", positions, positions, None, scale)
    via_reference = reference_attention(oracle, v, positions, positions, None, scale)
    assert (via_sdpa - via_reference).abs().max() <= 1e-10


def test_coca_strict_eq18_closed_form() -> None:
    """score(m, n) = sum_j c_{n,j} |q_{m,j}|^2 cos((m - n) theta_j)  (full rotary)."""
    q, k, _ = make_inputs(2)
    tables = tables_for(torch.arange(T))
    scores = fused_scores(CoCAStrict(rotary_for(D)), q, k, tables, tables)
    c = collinear_coefficients(k, D)[..., : D // 2]
    norm2 = q[..., : D // 2] ** 2 + q[..., D // 2 :] ** 2
    theta = 10000.0 ** (-torch.arange(D // 2, dtype=torch.float64) * 2 / D)
    distance = (torch.arange(T)[:, None] - torch.arange(T)[None, :]).to(torch.float64)
    closed = torch.einsum("bhmj,bhnj,mnj->bhmn", norm2, c, torch.cos(distance[..., None] * theta))
    assert (scores - closed).abs().max() <= 1e-10


def test_strict_key_is_collinear_with_its_query_in_every_pair() -> None:
    q, k, _ = make_inputs(3)
    t = collinear_coefficients(k, D)
    half = D // 2
    assert (t >= 0).all()
    assert torch.equal(t[..., :half], t[..., half:])
    key = collinear_key_eq8(q, t)
    # Angle between (q_j, q_{j+d/2}) and (k_j, k_{j+d/2}) is zero wherever the key is non-zero.
    q_pair = torch.stack((q[..., :half], q[..., half:]), dim=-1)
    k_pair = torch.stack((key[..., :half], key[..., half:]), dim=-1)
    cross = q_pair[..., 0] * k_pair[..., 1] - q_pair[..., 1] * k_pair[..., 0]
    dot = (q_pair * k_pair).sum(-1)
    nonzero = k_pair.norm(dim=-1) > 1e-12
    assert nonzero.any() and (~nonzero).any()  # relu zeroes some coefficients, keeps others
    angles = torch.atan2(cross, dot)[nonzero]
    assert angles.abs().max() <= 1e-12


@pytest.mark.parametrize(
    "scheme, invariant",
    [(RoPE(rotary_for()), True), (CoCAStrict(rotary_for(D)), True), (CoCASlack(rotary_for(D)), False)],
    ids=["rope", "coca_strict", "coca_slack"],
)
def test_shifting_all_positions(scheme, invariant: bool) -> None:
    q, k, _ = make_inputs(4)
    base_positions = torch.arange(T)
    shifted = base_positions + 37
    scores = fused_scores(scheme, q, k, tables_for(base_positions), tables_for(base_positions))
    shifted_scores = fused_scores(scheme, q, k, tables_for(shifted), tables_for(shifted))
    difference = (scores - shifted_scores).abs().max().item()
    if invariant:
        assert difference <= 1e-10
    else:
        assert difference > 1e-3


@pytest.mark.parametrize(
    "num_heads, minus_log2",
    [
        (8, [1, 2, 3, 4, 5, 6, 7, 8]),
        (16, [0.5 * (h + 1) for h in range(16)]),
        (12, [1, 2, 3, 4, 5, 6, 7, 8, 0.5, 1.5, 2.5, 3.5]),
        (6, [2, 4, 6, 8, 1, 3]),
    ],
)
def test_alibi_slopes_match_published_values(num_heads: int, minus_log2: list[float]) -> None:
    slopes = alibi_slopes(num_heads)
    assert len(slopes) == num_heads
    for slope, expected in zip(slopes, minus_log2):
        assert math.isclose(-math.log2(slope), expected, abs_tol=1e-12)
    assert torch.allclose(ALiBi(num_heads).slopes(), torch.tensor(slopes, dtype=torch.float32))


def test_alibi_slopes_stay_float32_through_a_bf16_model_cast() -> None:
    """DeepSpeed's bf16 casts the whole module; the slopes keep their float32 values (2**-0.5, not 0.70703125)."""
    from megatron_lite.model import build_model
    from conftest import tiny_config

    model = build_model(tiny_config("alibi", num_attention_heads=16)).bfloat16()  # 16 heads: slopes 2**-(h/2)
    expected = torch.tensor(alibi_slopes(16), dtype=torch.float32)
    schemes = [module for module in model.modules() if isinstance(module, ALiBi)]
    assert schemes
    for scheme in schemes:
        assert scheme.slopes().dtype == torch.float32 and torch.equal(scheme.slopes(), expected)


@pytest.mark.parametrize("rotary_dims", [D, D // 2])
def test_coca_gradients_match_autograd_of_the_plain_formulas(rotary_dims: int) -> None:
    """The memory-lean slack query (custom backward) has the gradient of q * R q."""
    from megatron_lite.model.rope import apply_rotary

    q, k, _ = make_inputs(5)
    tables = RotaryEmbedding(rotary_dims, 10000.0, RopeScalingConfig(type="yarn", factor=4.0), 16).tables(
        torch.arange(T), T, torch.float64)
    q.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: CoCASlack(rotary_for(rotary_dims)).transform_query(x, tables), (q,))
    upstream = torch.randn(B, H, T, D, dtype=torch.float64)
    (grad_lean,) = torch.autograd.grad(CoCASlack(rotary_for(rotary_dims)).transform_query(q, tables), q, upstream)
    (grad_plain,) = torch.autograd.grad(q * apply_rotary(q, tables), q, upstream)
    assert (grad_lean - grad_plain).abs().max() <= 1e-12


COCA_TRANSFORMS = [(CoCASlack, "transform_query"), (CoCASlack, "transform_key"), (CoCAStrict, "transform_key"),
                   (CoCAStrict, "transform_query")]


def coca_function_call(scheme_class: type, transform: str, rotary_dims: int, tables) -> Any:
    """x -> the eager autograd function a bf16 ``transform`` takes, called directly (any dtype), with the tables
    it is given there."""
    from megatron_lite.model.position import _CollinearKey, _half_tables, _SlackQuery, _StrictQuery

    def call(x: torch.Tensor) -> torch.Tensor:
        cos, sin = _half_tables(tables.cos, tables.sin, rotary_dims, x.dtype)
        if transform == "transform_query":
            if scheme_class is CoCASlack:  # every dtype: its backward never rebuilds R q
                return _SlackQuery.apply(x, tables.cos, tables.sin)
            return _StrictQuery.apply(x, cos, sin, rotary_dims)
        first, second = (cos - sin, cos + sin) if scheme_class is CoCASlack else (cos, sin)
        return _CollinearKey.apply(x, first, second, rotary_dims)

    return call


@pytest.mark.parametrize("rotary_dims", [D, D // 2])
@pytest.mark.parametrize(("scheme_class", "transform"), COCA_TRANSFORMS)
def test_coca_autograd_functions_have_the_expressions_values_and_gradients(
        scheme_class: type, transform: str, rotary_dims: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CoCA transforms' autograd functions (``_CollinearKey`` and ``_StrictQuery`` eager in bf16, ``_SlackQuery``
    always): in float64 the expression's values and gradient (gradcheck too); in bf16, through the scheme, the
    bf16 expression's values bit for bit, in the layout of the QKV slot they came from, and the gradient to bf16
    rounding of the float64 one."""
    from megatron_lite.model import position

    scheme = scheme_class(rotary_for(rotary_dims))
    tables = tables_for(torch.arange(T), rotary_dims)
    function = coca_function_call(scheme_class, transform, rotary_dims, tables)
    _, x, _ = make_inputs(7)
    x.requires_grad_(True)
    upstream = torch.randn(B, H, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    fused, expression = function(x), getattr(scheme, transform)(x, tables)  # float64 takes the expression
    assert (fused - expression).abs().max() <= 1e-15
    (grad_fused,) = torch.autograd.grad(fused, x, upstream)
    (grad_expression,) = torch.autograd.grad(expression, x, upstream)
    assert (grad_fused - grad_expression).abs().max() <= 1e-14
    assert torch.autograd.gradcheck(function, (x,))

    qkv = torch.randn(B, T, H, 3 * D, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    slot = qkv[..., D:2 * D].transpose(1, 2).detach().requires_grad_()  # (B, H, T, D), as attention slices it
    bf16_tables = rotary_for(rotary_dims).tables(torch.arange(T), T, torch.bfloat16)
    out = getattr(scheme, transform)(slot, bf16_tables)
    (grad_bf16,) = torch.autograd.grad(out, slot, upstream.to(torch.bfloat16))
    monkeypatch.setattr(position, "eager_kernels", lambda tensor: False)  # the bf16 expression
    assert torch.equal(out, getattr(scheme, transform)(slot, bf16_tables))
    assert sorted(range(4), key=lambda d: -out.stride(d)) == sorted(range(4), key=lambda d: -slot.stride(d))
    plain = slot.detach().double().requires_grad_()
    (grad_plain,) = torch.autograd.grad(getattr(scheme, transform)(plain, tables), plain, upstream)
    # bf16 rounding of products that may cancel: measured against the gradient's scale
    torch.testing.assert_close(grad_bf16.double(), grad_plain, rtol=0, atol=2**-7 * float(grad_plain.abs().max()))
