"""Every kernel backend gives the same model output for every scheme; KV-cache decoding equals
the full forward (with and without dynamic NTK); flash is checked when CUDA + flash-attn exist."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from conftest import ROTARY_IDS, ROTARY_SCHEMES, SCHEME_IDS, SCHEMES, tiny_config
from megatron_lite.config import RopeScalingConfig
from megatron_lite.model import build_model
from megatron_lite.model import flex
from megatron_lite.model.attention import (check_backend_available, chunked_attention, reference_attention,
                                           sdpa_attention)
from megatron_lite.model.masks import sdpa_mask
from megatron_lite.model.position import alibi_slopes

LENGTHS = [1, 16, 23, 50]  # chunk_size is 16: exact multiples, remainders, a single token


def logits_for(scheme: str, constraint: str, backend: str, input_ids: torch.Tensor, **overrides) -> torch.Tensor:
    model = build_model(tiny_config(scheme, constraint, backend, **overrides)).eval()
    with torch.no_grad():
        return model(input_ids)


@pytest.mark.parametrize("scheme, constraint", SCHEMES, ids=SCHEME_IDS)
@pytest.mark.parametrize("length", LENGTHS)
def test_backends_agree_fp32(scheme: str, constraint: str, length: int) -> None:
    input_ids = torch.randint(0, 250, (2, length))
    reference = logits_for(scheme, constraint, "reference", input_ids)
    for backend in ("sdpa", "chunked"):
        out = logits_for(scheme, constraint, backend, input_ids)
        assert (out - reference).abs().max() <= 1e-5, backend


@pytest.mark.parametrize("scheme, constraint", ROTARY_SCHEMES, ids=ROTARY_IDS)
def test_backends_agree_with_scalings(scheme: str, constraint: str) -> None:
    input_ids = torch.randint(0, 250, (1, 45))
    for kind in ("linear", "ntk", "dynamic", "yarn"):
        overrides = {"position.scaling": {"type": kind, "factor": 4.0}}
        reference = logits_for(scheme, constraint, "reference", input_ids, **overrides)
        for backend in ("sdpa", "chunked"):
            out = logits_for(scheme, constraint, backend, input_ids, **overrides)
            assert (out - reference).abs().max() <= 1e-5, (kind, backend)


def decode_token_by_token(model, input_ids: torch.Tensor, prefill: int) -> torch.Tensor:
    cache = model.new_cache(input_ids.shape[1])
    pieces = [model(input_ids[:, :prefill], cache=cache)]
    for index in range(prefill, input_ids.shape[1]):
        pieces.append(model(input_ids[:, index : index + 1], cache=cache))
    return torch.cat(pieces, dim=1)


@pytest.mark.parametrize("backend", ["sdpa", "chunked", "reference"])
@pytest.mark.parametrize("scheme, constraint", SCHEMES, ids=SCHEME_IDS)
def test_kv_cache_decoding_equals_full_forward(scheme: str, constraint: str, backend: str) -> None:
    model = build_model(tiny_config(scheme, constraint, backend)).double().eval()
    input_ids = torch.randint(0, 250, (2, 40))
    with torch.no_grad():
        full = model(input_ids)
        incremental = decode_token_by_token(model, input_ids, prefill=7)
    assert (incremental - full).abs().max() <= 1e-10


@pytest.mark.parametrize("backend", ["sdpa", "chunked"])
@pytest.mark.parametrize("scheme, constraint", ROTARY_SCHEMES, ids=ROTARY_IDS)
def test_kv_cache_with_dynamic_ntk_uses_one_base_for_the_whole_generation(scheme: str, constraint: str, backend: str) -> None:
    # 40 tokens > training length 16, so the dynamic base differs from the plain one.
    overrides = {"position.scaling": {"type": "dynamic", "factor": 2.0}}
    model = build_model(tiny_config(scheme, constraint, backend, **overrides)).double().eval()
    input_ids = torch.randint(0, 250, (2, 40))
    with torch.no_grad():
        full = model(input_ids)
        incremental = decode_token_by_token(model, input_ids, prefill=5)
        model.set_rope_scaling(RopeScalingConfig())
        unscaled = model(input_ids)
    assert (incremental - full).abs().max() <= 1e-10
    assert (unscaled - full).abs().max() > 1e-4  # the scaling is really in effect


def test_chunked_prefill_after_cache_equals_full_forward() -> None:
    model = build_model(tiny_config("alibi", backend="sdpa")).double().eval()
    input_ids = torch.randint(0, 250, (1, 30))
    with torch.no_grad():
        full = model(input_ids)
        cache = model.new_cache(30)
        pieces = [model(input_ids[:, :10], cache=cache), model(input_ids[:, 10:25], cache=cache), model(input_ids[:, 25:], cache=cache)]
    assert (torch.cat(pieces, dim=1) - full).abs().max() <= 1e-10


@pytest.mark.parametrize("scheme, cached", [("alibi", False), ("alibi", True), ("rope", True)],
                         ids=["alibi", "alibi_after_cache", "rope_general"])
def test_the_sdpa_mask_is_built_once_per_forward_not_per_layer(scheme: str, cached: bool,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """ALiBi's (1, H, T, S) bias (or the bool mask of several queries after cached keys) is the same in every layer:
    built once per forward and shared (at 16x a 512 window, 2 GB per build at 350M), equal to the per-layer one."""
    from megatron_lite.model import masks

    builds = []
    build = masks.attention_mask
    monkeypatch.setattr(masks, "attention_mask", lambda *args: builds.append(1) or build(*args))
    model = build_model(tiny_config(scheme, backend="sdpa")).eval()
    input_ids = torch.randint(0, 250, (2, 20))
    cache = model.new_cache(20)
    with torch.no_grad():
        if cached:
            model(input_ids[:, :12], cache=cache)
        builds.clear()
        out = model(input_ids[:, 12:] if cached else input_ids, cache=cache if cached else None)
        assert len(model.layers) > 1 and len(builds) == 1
        # under autocast the queries are bf16 and the forward's bias float32: the kernel takes it in their dtype
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids)
    reference = build_model(tiny_config(scheme, backend="reference")).eval()
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        expected = reference(input_ids)[:, 12:] if cached else reference(input_ids)
    assert (out - expected).abs().max() <= 1e-5


def test_cache_overflow_is_a_clear_error() -> None:
    model = build_model(tiny_config("rope")).eval()
    cache = model.new_cache(4)
    with pytest.raises(ValueError, match="KV cache overflow"):
        model(torch.zeros(1, 5, dtype=torch.long), cache=cache)


def test_flash_backend_without_cuda_is_a_clear_error() -> None:
    if torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is usable here")
    with pytest.raises(ValueError, match="model.attention.backend='flash'"):
        check_backend_available("flash")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None,
                    reason="needs CUDA and flash-attn")
@pytest.mark.parametrize("scheme, constraint", SCHEMES, ids=SCHEME_IDS)
def test_flash_matches_sdpa_on_gpu(scheme: str, constraint: str) -> None:
    input_ids = torch.randint(0, 250, (2, 50), device="cuda")
    outputs = {}
    for backend in ("sdpa", "flash"):
        model = build_model(tiny_config(scheme, constraint, backend, precision="bf16"), device="cuda").eval()
        with torch.no_grad():
            outputs[backend] = model(input_ids).float()
    assert (outputs["flash"] - outputs["sdpa"]).abs().max() <= 5e-2


# ALiBi exactness. A query at position `far` and two keys at distances far and far - 1, with q = k = 0: the
# weights are ALiBi's alone, softmax(-s (far, far - 1)), so the key at distance `far` weighs 1 / (1 + e^s). In
# bf16, distances above 256 are not all representable: 301 and 300 (8,001 and 8,000) round to one value and a
# bias built in the model dtype gives both keys 1/2 (head 0: s = 2^-0.5, exact weight 0.330).
ALIBI_HEADS = 16


def alibi_probe(far: int, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """(q, k, v, q_positions, k_positions, slopes, expected (H,) float64) for two keys at distances far, far - 1;
    v is 1 on the farther key, 0 on the other, so output[..., 0] is the farther key's weight."""
    q_BHTD = torch.zeros(1, ALIBI_HEADS, 1, 8, dtype=torch.bfloat16, device=device)
    k_BHSD = torch.zeros(1, ALIBI_HEADS, 2, 8, dtype=torch.bfloat16, device=device)
    v_BHSD = torch.zeros_like(k_BHSD)
    v_BHSD[:, :, 0] = 1.0
    slopes_H = torch.tensor(alibi_slopes(ALIBI_HEADS), dtype=torch.float32, device=device)
    expected_H = 1.0 / (1.0 + torch.exp(slopes_H.double().cpu()))
    return (q_BHTD, k_BHSD, v_BHSD, torch.tensor([far], device=device), torch.tensor([0, 1], device=device), slopes_H,
            expected_H)


def alibi_kernel_output(kernel: str, q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor,
                        q_positions: torch.Tensor, k_positions: torch.Tensor, slopes_H: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """One kernel path of model/attention.py and model/flex.py on the same inputs: (B, H, T, D)."""
    if kernel == "sdpa":
        return sdpa_attention(q_BHTD, k_BHSD, v_BHSD, "general", q_positions, k_positions, slopes_H, scale)
    if kernel == "sdpa_forward_mask":  # the bias PositionContext builds once per forward (in float32)
        mask = sdpa_mask(q_positions, k_positions, slopes_H, torch.float32)
        return sdpa_attention(q_BHTD, k_BHSD, v_BHSD, "general", q_positions, k_positions, slopes_H, scale, mask=mask)
    if kernel == "chunked":
        return chunked_attention(q_BHTD, k_BHSD, v_BHSD, q_positions, k_positions, slopes_H, scale, chunk_size=16)
    block_mask = flex.build_block_mask(q_positions, k_positions)
    if kernel == "flex_training":  # inputs that require grad: flex's training path
        q_BHTD = q_BHTD.clone().requires_grad_()
    out = flex.flex_attention_forward(q_BHTD, k_BHSD, v_BHSD, block_mask, q_positions, k_positions, slopes_H, scale)
    return out.detach()


ALIBI_KERNELS = ["sdpa", "sdpa_forward_mask", "chunked", "flex", "flex_training"]


@pytest.mark.parametrize("far", [301, 8001])
def test_alibi_bias_tells_adjacent_distances_apart_in_bf16(far: int) -> None:
    _, _, _, q_positions, k_positions, slopes_H, _ = alibi_probe(far)
    bias = sdpa_mask(q_positions, k_positions, slopes_H, torch.bfloat16)  # (1, H, 1, 2)
    assert bias.dtype == torch.float32
    expected = -slopes_H.double()[:, None] * torch.tensor([far, far - 1], dtype=torch.float64)
    assert torch.allclose(bias[0, :, 0].double(), expected, rtol=1e-6, atol=0)
    assert (bias[0, :, 0, 1] - bias[0, :, 0, 0] > 0).all()


@pytest.mark.parametrize("kernel", ALIBI_KERNELS)
@pytest.mark.parametrize("far", [301, 8001])
def test_alibi_kernels_tell_adjacent_distances_apart_in_bf16(kernel: str, far: int) -> None:
    q_BHTD, k_BHSD, v_BHSD, q_positions, k_positions, slopes_H, expected_H = alibi_probe(far)
    out = alibi_kernel_output(kernel, q_BHTD, k_BHSD, v_BHSD, q_positions, k_positions, slopes_H, scale=1.0)
    farther_weight_H = out[0, :, 0, 0].double()
    assert (farther_weight_H - expected_H).abs().max() <= 2e-3  # bf16 output; equal biases would give 0.5


@pytest.mark.parametrize("kernel", ALIBI_KERNELS)
def test_alibi_kernels_equal_the_float64_reference_at_4k(kernel: str) -> None:
    """The last 64 queries of a 4,096-token window against every key, bf16 inputs, 2 heads of 8 dims."""
    generator = torch.Generator().manual_seed(0)
    length, queries, heads, head_dim = 4096, 64, 2, 8
    q_BHTD = torch.randn(1, heads, queries, head_dim, generator=generator).to(torch.bfloat16)
    k_BHSD, v_BHSD = (torch.randn(1, heads, length, head_dim, generator=generator).to(torch.bfloat16) for _ in range(2))
    k_positions = torch.arange(length)
    q_positions = k_positions[-queries:]
    slopes_H = torch.tensor(alibi_slopes(heads), dtype=torch.float32)
    scale = head_dim ** -0.5
    expected = reference_attention(q_BHTD.double() @ k_BHSD.double().transpose(-2, -1), v_BHSD.double(), q_positions,
                                   k_positions, slopes_H, scale)
    out = alibi_kernel_output(kernel, q_BHTD, k_BHSD, v_BHSD, q_positions, k_positions, slopes_H, scale)
    assert out.dtype == torch.bfloat16
    assert (out.double() - expected).abs().max() <= 2e-2  # bf16 output and probabilities (max |expected| ~ 2)



@pytest.mark.parametrize("far", [301, 8001])
def test_exported_alibi_model_tells_adjacent_distances_apart_in_bf16(far: int) -> None:
    """The remote code that ships with an exported ALiBi model (tools/convert_checkpoint.py --to hf): its bias for
    a bf16 model (query at `far` after a cache of `far` keys) and its kernel call on the two-key probe."""
    from megatron_lite.convert.hf_remote import modeling_megatron_lite as remote

    config = SimpleNamespace(position_scheme="alibi", num_attention_heads=ALIBI_HEADS)
    bias = remote.attention_mask_for(config, 1, far, None, torch.bfloat16, torch.device("cpu"))  # (1, H, 1, far + 1)
    assert bias.dtype == torch.float32 and (bias[0, :, 0, 1] - bias[0, :, 0, 0] > 0).all()
    q_BHTD, k_BHSD, v_BHSD, q_positions, k_positions, slopes_H, expected_H = alibi_probe(far)
    out = remote.attend(config, q_BHTD, k_BHSD, v_BHSD, None, bias[..., :2], None, 0, 1.0, 0.0)
    assert out.dtype == torch.bfloat16
    assert (out[0, :, 0, 0].double() - expected_H).abs().max() <= 2e-3

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernel", ["sdpa", "chunked", "flex", "flex_training"])
def test_alibi_kernels_tell_adjacent_distances_apart_on_gpu(kernel: str) -> None:
    """CUDA: sdpa and chunked run half-precision q/k/v in float32 against the float32 bias, flex compiles its
    float32 score_mod into the fused kernel (flash-attn's alibi_slopes, float32 too, take no positions)."""
    q_BHTD, k_BHSD, v_BHSD, q_positions, k_positions, slopes_H, expected_H = alibi_probe(8001, device="cuda")
    out = alibi_kernel_output(kernel, q_BHTD, k_BHSD, v_BHSD, q_positions, k_positions, slopes_H, scale=1.0)
    assert (out[0, :, 0, 0].double().cpu() - expected_H).abs().max() <= 2e-3
