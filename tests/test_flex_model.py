"""The flex backend inside the model equals sdpa for every scheme (several lengths, with and without a KV
cache), and document masking equals the reference backend given the same block-diagonal causal mask."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_config
from megatron_lite.model import GPT
from megatron_lite.model.flex import flex_available

pytestmark = pytest.mark.skipif(not flex_available(), reason="needs FlexAttention (torch >= 2.5)")
SCHEMES = [("none", "slack"), ("learned", "slack"), ("sinusoidal", "slack"), ("alibi", "slack"), ("rope", "slack"),
           ("coca", "slack"), ("coca", "strict")]


def pair(scheme: str, constraint: str, other: str = "sdpa", **overrides) -> tuple[GPT, GPT]:
    flex = GPT(tiny_config(scheme, constraint, "flex", **overrides).model).eval()
    plain = GPT(tiny_config(scheme, constraint, other, **overrides).model).eval()
    plain.load_state_dict(flex.state_dict())
    return flex, plain


@pytest.mark.parametrize("length", [1, 13, 16, 40])
@pytest.mark.parametrize(("scheme", "constraint"), SCHEMES, ids=[f"{s}_{c}" if s == "coca" else s for s, c in SCHEMES])
def test_flex_equals_sdpa(scheme: str, constraint: str, length: int) -> None:
    flex, sdpa = pair(scheme, constraint)
    ids = torch.randint(0, 250, (2, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        torch.testing.assert_close(flex(ids), sdpa(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("scheme", "constraint"), SCHEMES, ids=[f"{s}_{c}" if s == "coca" else s for s, c in SCHEMES])
def test_flex_with_a_kv_cache_equals_sdpa(scheme: str, constraint: str) -> None:
    """A prefill of 9 tokens, then 3 tokens at once (general mask), then single tokens (decode)."""
    flex, sdpa = pair(scheme, constraint)
    ids = torch.randint(0, 250, (2, 14), generator=torch.Generator().manual_seed(1))
    outputs = []
    for model in (flex, sdpa):
        cache, pieces = model.new_cache(14), []
        with torch.no_grad():
            for start, end in ((0, 9), (9, 12), (12, 13), (13, 14)):
                pieces.append(model(ids[:, start:end], cache=cache))
        outputs.append(torch.cat(pieces, dim=1))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("scheme", "constraint"), [("alibi", "slack"), ("rope", "slack"), ("coca", "strict")])
def test_document_mask_equals_the_reference_backend(scheme: str, constraint: str) -> None:
    flex, reference = pair(scheme, constraint, "reference", **{"attention.document_mask": True})
    ids = torch.randint(1, 250, (2, 30), generator=torch.Generator().manual_seed(2))
    ids[0, [4, 17]] = 0  # EOD ends documents: row 0 has three, row 1 one
    with torch.no_grad():
        masked = flex(ids)
        torch.testing.assert_close(masked, reference(ids), rtol=1e-5, atol=1e-5)
        unmasked = GPT(tiny_config(scheme, constraint, "flex").model).eval()
        unmasked.load_state_dict(flex.state_dict())
        plain = unmasked(ids)
    torch.testing.assert_close(masked[1], plain[1], rtol=1e-5, atol=1e-5)  # one document: nothing masked
    torch.testing.assert_close(masked[0, :5], plain[0, :5], rtol=1e-5, atol=1e-5)  # the first document sees only itself
    assert not torch.allclose(masked[0, 5:], plain[0, 5:], atol=1e-3)  # later documents lose the earlier ones


def test_document_mask_needs_flex_or_reference() -> None:
    with pytest.raises(ValueError, match="document_mask=true needs model.attention.backend flex or reference"):
        tiny_config("rope", "slack", "sdpa", **{"attention.document_mask": True})
