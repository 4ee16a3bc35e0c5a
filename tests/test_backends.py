"""Every kernel backend gives the same model output for every scheme; KV-cache decoding equals
the full forward (with and without dynamic NTK); flash is checked when CUDA + flash-attn exist."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from conftest import ROTARY_IDS, ROTARY_SCHEMES, SCHEME_IDS, SCHEMES, tiny_config
from megatron_lite.config import RopeScalingConfig
from megatron_lite.model import build_model
from megatron_lite.model.attention import check_backend_available

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
