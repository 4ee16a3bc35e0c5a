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
