"""The llama block family (RMSNorm, SwiGLU, grouped-query attention): every scheme on every fused backend
equals the materialised reference (CoCA slack/strict with GQA in float64 to 1e-10), a KV cache holds only
the key/value heads and decodes like a full forward, CoCA adds no parameters to RoPE, and the fused loss
equals the plain one."""

from __future__ import annotations

import re

import pytest
import torch

from conftest import tiny_config
from megatron_lite.model import GPT
from megatron_lite.model.flex import flex_available
from megatron_lite.model.params import analytic_parameter_count, counted_parameter_count

SCHEMES = [("none", "slack"), ("learned", "slack"), ("sinusoidal", "slack"), ("alibi", "slack"), ("rope", "slack"),
           ("coca", "slack"), ("coca", "strict")]
SCHEME_IDS = [f"{s}_{c}" if s == "coca" else s for s, c in SCHEMES]
FLEX = pytest.param("flex", marks=pytest.mark.skipif(not flex_available(), reason="needs FlexAttention"))
FUSED_BACKENDS = ["sdpa", "chunked", FLEX]
LLAMA = {"architecture": "llama", "num_key_value_heads": 2, "intermediate_size": 96}  # 4 query heads, 2 KV heads


def llama_pair(scheme: str, constraint: str, backend: str, dtype: torch.dtype = torch.float32,
               **overrides) -> tuple[GPT, GPT]:
    """The same weights on ``backend`` and on the reference backend."""
    settings = {**LLAMA, **overrides}
    fused = GPT(tiny_config(scheme, constraint, backend, **settings).model).to(dtype).eval()
    reference = GPT(tiny_config(scheme, constraint, "reference", **settings).model).to(dtype).eval()
    reference.load_state_dict(fused.state_dict())
    return fused, reference


def decode_in_pieces(model: GPT, ids: torch.Tensor, cuts: tuple[int, ...]) -> torch.Tensor:
    cache, pieces = model.new_cache(ids.shape[1]), []
    with torch.no_grad():
        for start, end in zip((0,) + cuts, cuts + (ids.shape[1],)):
            pieces.append(model(ids[:, start:end], cache=cache))
    return torch.cat(pieces, dim=1)


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
@pytest.mark.parametrize("constraint", ["slack", "strict"])
def test_coca_with_gqa_float64_equals_the_materialised_reference(constraint: str, backend: str) -> None:
    """Slack's opt_einsum contraction and strict's explicit Eq. 10 key tensor, with T from 2 KV heads shared
    by 4 query heads; partial rotary dims included."""
    for rotary_pct in (1.0, 0.5):
        fused, reference = llama_pair("coca", constraint, backend, torch.float64, **{"position.rotary_pct": rotary_pct})
        ids = torch.randint(0, 250, (2, 24), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            got, want = fused(ids), reference(ids)
        assert (got - want).abs().max().item() <= 1e-10


@pytest.mark.parametrize(("scheme", "constraint"), SCHEMES, ids=SCHEME_IDS)
def test_every_scheme_on_llama_equals_the_reference(scheme: str, constraint: str) -> None:
    fused, reference = llama_pair(scheme, constraint, "sdpa")
    ids = torch.randint(0, 250, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids), reference(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", FUSED_BACKENDS + ["reference"])
@pytest.mark.parametrize(("scheme", "constraint"), [("alibi", "slack"), ("rope", "slack"), ("coca", "slack"),
                                                     ("coca", "strict")], ids=["alibi", "rope", "coca_slack", "coca_strict"])
def test_gqa_kv_cache_decodes_like_a_full_forward(scheme: str, constraint: str, backend: str) -> None:
    model = GPT(tiny_config(scheme, constraint, backend, **LLAMA).model).double().eval()
    ids = torch.randint(0, 250, (2, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
    torch.testing.assert_close(decode_in_pieces(model, ids, (9, 12, 13)), full, rtol=1e-9, atol=1e-9)
    cache = model.new_cache(14)
    with torch.no_grad():
        model(ids[:, :5], cache=cache)
    assert cache.layers[0].keys.shape[1] == 2  # only the key/value heads are cached


def test_coca_adds_no_parameters_and_counts_match_the_closed_form() -> None:
    counts = {}
    for scheme in ("rope", "coca"):
        for overrides in ({}, {"qkv_bias": True, "kv_channels": 24, "num_key_value_heads": 1}):
            model = tiny_config(scheme, **{**LLAMA, **overrides}).model
            counts[scheme, len(overrides)] = counted_parameter_count(model)
            assert counts[scheme, len(overrides)] == analytic_parameter_count(model)
    assert counts["rope", 0] == counts["coca", 0] and counts["rope", 3] == counts["coca", 3]


def test_explicit_head_dim_and_qkv_bias_shape_the_projections() -> None:
    model = GPT(tiny_config("coca", **LLAMA, kv_channels=24, qkv_bias=True).model)
    attention = model.layers[0].self_attn
    assert tuple(attention.q_proj.weight.shape) == (96, 64) and tuple(attention.k_proj.weight.shape) == (48, 64)
    assert attention.q_proj.bias is not None and attention.o_proj.bias is None
    ids = torch.randint(0, 250, (1, 8))
    assert model(ids).shape == (1, 8, 256)


@pytest.mark.parametrize("constraint", ["slack", "strict"])
def test_fused_loss_equals_the_plain_loss_on_llama(constraint: str) -> None:
    model = GPT(tiny_config("coca", constraint, **LLAMA).model).train()
    generator = torch.Generator().manual_seed(4)
    ids, labels = torch.randint(0, 250, (2, 16), generator=generator), torch.randint(0, 250, (2, 16), generator=generator)
    results = []
    for fused in (True, False):
        model.lm_head.fused = fused
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=labels)
        loss.backward()
        results.append((loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-6, atol=1e-6)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(grad, results[1][1][name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("num_key_value_heads", 3, "model.num_key_value_heads=3: must divide model.num_attention_heads=4"),
    ("kv_channels", 0, "model.kv_channels=0: must be positive"),
])
def test_bad_head_layouts_are_one_line_errors(key: str, value: int, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny_config("rope", **{**LLAMA, key: value})


@pytest.mark.parametrize(("key", "value"), [("num_key_value_heads", 2), ("qkv_bias", True), ("kv_channels", 8)])
def test_llama_only_keys_are_refused_on_gpt_neox(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"model.{key}=.*needs model.architecture=llama"):
        tiny_config("rope", **{key: value})
