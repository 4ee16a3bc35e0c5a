"""RoPE scalings: inverse frequencies equal the HF definitions, written out independently here and
cross-checked against the installed transformers' ROPE_INIT_FUNCTIONS."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_lite.config import RopeScalingConfig
from megatron_lite.model.rope import RotaryEmbedding, apply_rotary, rotate_half

R, BASE, TRAIN_LEN = 32, 10000.0, 128


def plain_inv_freq(base: float) -> torch.Tensor:
    return torch.tensor([base ** (-2 * i / R) for i in range(R // 2)], dtype=torch.float64)


def expected_inv_freq(kind: str, factor: float, seq_len: int) -> tuple[torch.Tensor, float]:
    if kind == "none":
        return plain_inv_freq(BASE), 1.0
    if kind == "linear":
        return plain_inv_freq(BASE) / factor, 1.0
    if kind == "ntk":
        return plain_inv_freq(BASE * factor ** (R / (R - 2))), 1.0
    if kind == "dynamic":
        if seq_len <= TRAIN_LEN:
            return plain_inv_freq(BASE), 1.0
        return plain_inv_freq(BASE * ((factor * seq_len / TRAIN_LEN) - (factor - 1)) ** (R / (R - 2))), 1.0
    # YaRN (beta_fast 32, beta_slow 1), as in the reference sheet.
    def corr_dim(rotations: float) -> float:
        return R * math.log(TRAIN_LEN / (2 * math.pi * rotations)) / (2 * math.log(BASE))

    low = max(math.floor(corr_dim(32)), 0)
    high = min(math.ceil(corr_dim(1)), R - 1)
    values = []
    for i in range(R // 2):
        pos_freq = BASE ** (2 * i / R)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        extrapolation_weight = 1 - ramp
        values.append((1 / (factor * pos_freq)) * (1 - extrapolation_weight) + (1 / pos_freq) * extrapolation_weight)
    return torch.tensor(values, dtype=torch.float64), 0.1 * math.log(factor) + 1


CASES = [("none", 1.0, 512), ("linear", 4.0, 512), ("ntk", 4.0, 512), ("dynamic", 4.0, 100),
         ("dynamic", 4.0, 128), ("dynamic", 2.0, 1000), ("dynamic", 8.0, 4096), ("yarn", 4.0, 512), ("yarn", 16.0, 512)]


@pytest.mark.parametrize("kind, factor, seq_len", CASES)
def test_inverse_frequencies_match_formulas(kind: str, factor: float, seq_len: int) -> None:
    rotary = RotaryEmbedding(R, BASE, RopeScalingConfig(type=kind, factor=factor), TRAIN_LEN)
    inv_freq, attention_factor = rotary.inv_freq(seq_len)
    expected, expected_factor = expected_inv_freq(kind, factor, seq_len)
    torch.testing.assert_close(inv_freq, expected, rtol=1e-12, atol=0)
    assert math.isclose(attention_factor, expected_factor, rel_tol=1e-12)


def test_dynamic_at_factor_times_train_length_has_alpha_factor_squared_minus_factor_plus_one() -> None:
    factor = 4.0
    rotary = RotaryEmbedding(R, BASE, RopeScalingConfig(type="dynamic", factor=factor), TRAIN_LEN)
    inv_freq, _ = rotary.inv_freq(int(factor * TRAIN_LEN))
    alpha = factor**2 - factor + 1
    torch.testing.assert_close(inv_freq, plain_inv_freq(BASE * alpha ** (R / (R - 2))), rtol=1e-12, atol=0)


@pytest.mark.parametrize("kind, factor, seq_len", [c for c in CASES if c[0] in ("linear", "dynamic", "yarn")])
def test_inverse_frequencies_match_installed_transformers(kind: str, factor: float, seq_len: int) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim = 2 * R  # partial rotary: r = head_dim * 0.5
    parameters = {"rope_type": kind, "rope_theta": BASE, "partial_rotary_factor": 0.5, "factor": factor}
    if kind == "yarn":
        parameters["original_max_position_embeddings"] = TRAIN_LEN
    config = transformers.GPTNeoXConfig(
        hidden_size=2 * head_dim, num_attention_heads=2, max_position_embeddings=TRAIN_LEN, rope_parameters=parameters
    )
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=seq_len)
    inv_freq, attention_factor = RotaryEmbedding(R, BASE, RopeScalingConfig(type=kind, factor=factor), TRAIN_LEN).inv_freq(seq_len)
    torch.testing.assert_close(inv_freq.float(), hf_inv_freq.float(), rtol=1e-5, atol=0)
    assert math.isclose(attention_factor, hf_factor, rel_tol=1e-6)


def test_yarn_attention_factor_scales_cos_and_sin() -> None:
    scaling = RopeScalingConfig(type="yarn", factor=8.0)
    tables = RotaryEmbedding(R, BASE, scaling, TRAIN_LEN).tables(torch.arange(5), 5, torch.float64)
    magnitude = (tables.cos**2 + tables.sin**2).sqrt()
    torch.testing.assert_close(magnitude, torch.full_like(magnitude, 0.1 * math.log(8.0) + 1))


def test_apply_rotary_rotates_pairs_and_passes_the_rest() -> None:
    head_dim = 2 * R
    x = torch.randn(1, 2, 7, head_dim, dtype=torch.float64)
    positions = torch.arange(7)
    tables = RotaryEmbedding(R, BASE, RopeScalingConfig(), TRAIN_LEN).tables(positions, 7, torch.float64)
    rotated = apply_rotary(x, tables)
    assert torch.equal(rotated[..., R:], x[..., R:])
    theta = plain_inv_freq(BASE)
    for n in range(7):
        for i in range(R // 2):
            angle = n * theta[i]
            a, b = x[..., n, i], x[..., n, i + R // 2]
            torch.testing.assert_close(rotated[..., n, i], a * math.cos(angle) - b * math.sin(angle))
            torch.testing.assert_close(rotated[..., n, i + R // 2], b * math.cos(angle) + a * math.sin(angle))
    assert torch.equal(rotate_half(torch.tensor([1.0, 2.0, 3.0, 4.0])), torch.tensor([-3.0, -4.0, 1.0, 2.0]))


def rotation_case(dtype: torch.dtype, rotary_dims: int, head_dim: int = 32) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor]:
    """x (B, H, T, D): the q slot of a fused (B, T, H, 3D) projection, as attention hands it over; cos/sin
    (T, r) in the [theta, theta] layout."""
    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 6, 4, 3 * head_dim, generator=generator).to(dtype)
    x = qkv[..., :head_dim].transpose(1, 2).detach().requires_grad_()
    angles = torch.rand(6, rotary_dims // 2, generator=generator, dtype=torch.float64) * 6
    angles = torch.cat((angles, angles), dim=-1)
    return x, angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("rotary_dims", [32, 16])
@pytest.mark.parametrize("transpose", [False, True])
def test_fused_bf16_rotation_is_the_rotation_and_its_gradient_the_inverse(rotary_dims: int, transpose: bool) -> None:
    """bf16 takes the two-pass rotation (multiply, then multiply-add per half): R x (R^T x) within its two bf16
    roundings of the float64 result, in x's memory layout, pass-through dims exact; its gradient is R^T g (R g)."""
    from megatron_lite.model.rope import FUSED_ROTATION_DTYPES, rotate

    assert torch.bfloat16 in FUSED_ROTATION_DTYPES
    x, cos, sin = rotation_case(torch.bfloat16, rotary_dims)
    y = rotate(x, cos, sin, transpose)
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    (grad_x,) = torch.autograd.grad(y, x, grad)
    x64, cos64, sin64 = x.detach().double().requires_grad_(), cos.double(), sin.double()
    y64 = rotate(x64, cos64, sin64, transpose)  # float64: the plain expression
    (grad64,) = torch.autograd.grad(y64, x64, grad.double())
    torch.testing.assert_close(y.double(), y64, rtol=2**-7, atol=2**-7)  # two roundings of 2^-8 at most
    torch.testing.assert_close(grad_x.double(), grad64, rtol=2**-7, atol=2**-7)
    torch.testing.assert_close(grad64, rotate(grad.double(), cos64, sin64, not transpose), rtol=0, atol=1e-12)
    assert torch.equal(y[..., rotary_dims:], x[..., rotary_dims:])
    assert sorted(range(4), key=lambda d: -y.stride(d)) == sorted(range(4), key=lambda d: -x.stride(d))


def test_fused_bf16_rotation_moves_half_the_bytes() -> None:
    """Forward + backward of the bf16 rotation reads and writes at most ~10 times x's bytes (the expression with
    autograd: over 20), counted as the step census counts it."""
    from dev.step_census import CensusMode
    from megatron_lite.model.rope import rotate

    def traffic(dtype_path: torch.dtype) -> float:
        x, cos, sin = rotation_case(dtype_path, 32)
        mode = CensusMode(torch.device("cpu"))
        with mode:
            rotate(x, cos, sin).backward(torch.ones(x.shape, dtype=x.dtype))
        moved = sum(sum(phase.traffic.values()) - phase.traffic["ones"] for phase in mode.phases.values())
        return moved / (x.numel() * x.element_size())

    assert traffic(torch.bfloat16) <= 10.5
    assert traffic(torch.float32) > 20  # the expression, kept for float32
