"""The flex kernel (megatron_lite/model/flex.py) against the sdpa / reference semantics: causal by positions
(self-attention, KV-cache decoding, offset positions), ALiBi as a score_mod, document masking; forward and
gradients, eager and under torch.compile(fullgraph=True). On CPU, training (inputs requiring grad) runs
the dense equivalent of the same mask_mod / score_mod; inference runs the real flex_attention."""

from __future__ import annotations

import warnings

import pytest
import torch

from megatron_lite.model import flex
from megatron_lite.model.attention import reference_attention, sdpa_attention
from megatron_lite.model.context import mask_mode
from megatron_lite.model.position import alibi_slopes

if not flex.flex_available():
    pytest.skip(f"FlexAttention unavailable in torch {torch.__version__}", allow_module_level=True)

B, H, D = 2, 3, 16
SCALE = D**-0.5
TOL = 1e-5


@pytest.fixture(autouse=True)
def _quiet_flex() -> None:
    # Raw flex on CPU warns once that it is unfused; expected here.
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")


def random_qkv(length: int, keys: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    q_BHTD = torch.randn(B, H, length, D, generator=generator)
    k_BHSD = torch.randn(B, H, keys, D, generator=generator)
    v_BHSD = torch.randn(B, H, keys, D, generator=generator)
    return q_BHTD, k_BHSD, v_BHSD


def slopes_or_none(alibi: bool) -> torch.Tensor | None:
    return torch.tensor(alibi_slopes(H), dtype=torch.float32) if alibi else None


def reference(q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, q_positions_T: torch.Tensor,
              k_positions_S: torch.Tensor, slopes_H: torch.Tensor | None) -> torch.Tensor:
    return reference_attention(q_BHTD @ k_BHSD.transpose(-2, -1), v_BHSD, q_positions_T, k_positions_S, slopes_H, SCALE)


def outputs_and_grads(fn, q_BHTD: torch.Tensor, k_BHSD: torch.Tensor,
                      v_BHSD: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """fn's output and d(sum(out * w))/d(q, k, v) for a fixed random w (not all-ones: sum() hides v errors)."""
    leaves = [t.clone().requires_grad_() for t in (q_BHTD, k_BHSD, v_BHSD)]
    out_BHTD = fn(*leaves)
    weight = torch.randn(out_BHTD.shape, generator=torch.Generator().manual_seed(1))
    (out_BHTD * weight).sum().backward()
    return (out_BHTD.detach(), *(leaf.grad for leaf in leaves))


def assert_close_all(actual: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...]) -> None:
    for name, a, e in zip(("out", "dq", "dk", "dv"), actual, expected):
        assert a is not None and e is not None, name
        assert (a - e).abs().max().item() <= TOL, name


def check_against_reference(q_positions_T: torch.Tensor, k_positions_S: torch.Tensor, alibi: bool) -> None:
    """Training path (grads) and inference path (real flex on CPU) against the reference."""
    q_BHTD, k_BHSD, v_BHSD = random_qkv(q_positions_T.shape[0], k_positions_S.shape[0])
    slopes_H = slopes_or_none(alibi)
    block_mask = flex.build_block_mask(q_positions_T, k_positions_S)

    def run_flex(q, k, v):
        return flex.flex_attention_forward(q, k, v, block_mask, q_positions_T, k_positions_S, slopes_H, SCALE)

    def run_reference(q, k, v):
        return reference(q, k, v, q_positions_T, k_positions_S, slopes_H)

    assert_close_all(outputs_and_grads(run_flex, q_BHTD, k_BHSD, v_BHSD),
                     outputs_and_grads(run_reference, q_BHTD, k_BHSD, v_BHSD))
    with torch.no_grad():
        assert (run_flex(q_BHTD, k_BHSD, v_BHSD) - run_reference(q_BHTD, k_BHSD, v_BHSD)).abs().max() <= TOL


@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
@pytest.mark.parametrize("length", [1, 7, 128, 130, 300])
def test_causal_self_attention(length: int, alibi: bool) -> None:
    positions_T = torch.arange(length)
    check_against_reference(positions_T, positions_T, alibi)
    # sdpa's own causal path agrees too (the main backend)
    q_BHTD, k_BHSD, v_BHSD = random_qkv(length, length)
    slopes_H = slopes_or_none(alibi)
    block_mask = flex.build_block_mask(positions_T, positions_T)
    with torch.no_grad():
        expected = sdpa_attention(q_BHTD, k_BHSD, v_BHSD, "causal", positions_T, positions_T, slopes_H, SCALE)
        actual = flex.flex_attention_forward(q_BHTD, k_BHSD, v_BHSD, block_mask, positions_T, positions_T, slopes_H,
                                             SCALE)
    assert (actual - expected).abs().max() <= TOL


@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
@pytest.mark.parametrize("length", [1, 5])
def test_decode_against_cache(length: int, alibi: bool) -> None:
    keys = 140  # crosses a 128 block
    k_positions_S = torch.arange(keys)
    q_positions_T = k_positions_S[-length:]
    check_against_reference(q_positions_T, k_positions_S, alibi)
    q_BHTD, k_BHSD, v_BHSD = random_qkv(length, keys)
    slopes_H = slopes_or_none(alibi)
    block_mask = flex.build_block_mask(q_positions_T, k_positions_S)
    with torch.no_grad():
        expected = sdpa_attention(q_BHTD, k_BHSD, v_BHSD, mask_mode(keys - length, length), q_positions_T,
                                  k_positions_S, slopes_H, SCALE)
        actual = flex.flex_attention_forward(q_BHTD, k_BHSD, v_BHSD, block_mask, q_positions_T, k_positions_S,
                                             slopes_H, SCALE)
    assert (actual - expected).abs().max() <= TOL


@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
def test_offset_positions(alibi: bool) -> None:
    positions_T = torch.arange(130) + 1000
    check_against_reference(positions_T, positions_T, alibi)


def test_document_ids_eod_ends_its_document() -> None:
    tokens_BT = torch.tensor([[5, 6, 0, 7, 8, 0, 9], [0, 0, 3, 4, 5, 6, 0]])
    expected = torch.tensor([[0, 0, 0, 1, 1, 1, 2], [0, 1, 2, 2, 2, 2, 2]])
    assert torch.equal(flex.document_ids(tokens_BT, eod_token_id=0), expected)
    with pytest.raises(ValueError, match=r"\(7,\)"):
        flex.document_ids(tokens_BT[0], eod_token_id=0)


def document_reference(q_BHTD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, documents_BT: torch.Tensor,
                       slopes_H: torch.Tensor | None) -> torch.Tensor:
    """By hand: materialised scores, causal AND same-document (block diagonal), ALiBi bias."""
    length = q_BHTD.shape[-2]
    scores_BHTS = (q_BHTD @ k_BHSD.transpose(-2, -1)) * SCALE
    if slopes_H is not None:
        distance_TS = (torch.arange(length)[None, :] - torch.arange(length)[:, None]).to(torch.float32)
        scores_BHTS = scores_BHTS + slopes_H[:, None, None] * distance_TS
    causal_TS = torch.ones(length, length, dtype=torch.bool).tril()
    same_document_BTS = documents_BT[:, :, None] == documents_BT[:, None, :]
    allowed_B1TS = (causal_TS & same_document_BTS)[:, None]
    return torch.softmax(scores_BHTS.masked_fill(~allowed_B1TS, float("-inf")), dim=-1) @ v_BHSD


@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
def test_document_mask(alibi: bool) -> None:
    length, eod = 150, 0
    tokens_BT = torch.randint(1, 50, (B, length), generator=torch.Generator().manual_seed(3))
    tokens_BT[0, [10, 11, 127, 128, 140]] = eod  # an empty document, ends across the block boundary
    tokens_BT[1, [0, 60]] = eod
    documents_BT = flex.document_ids(tokens_BT, eod)
    positions_T = torch.arange(length)
    slopes_H = slopes_or_none(alibi)
    block_mask = flex.build_block_mask(positions_T, positions_T, documents_BT, documents_BT)
    assert tuple(block_mask.shape) == (B, 1, length, length)

    def run_flex(q, k, v):
        return flex.flex_attention_forward(q, k, v, block_mask, positions_T, positions_T, slopes_H, SCALE)

    def run_reference(q, k, v):
        return document_reference(q, k, v, documents_BT, slopes_H)

    q_BHTD, k_BHSD, v_BHSD = random_qkv(length, length)
    assert_close_all(outputs_and_grads(run_flex, q_BHTD, k_BHSD, v_BHSD),
                     outputs_and_grads(run_reference, q_BHTD, k_BHSD, v_BHSD))
    with torch.no_grad():
        assert (run_flex(q_BHTD, k_BHSD, v_BHSD) - run_reference(q_BHTD, k_BHSD, v_BHSD)).abs().max() <= TOL
    # reference_attention's document path (self-attention) agrees with the hand-built one
    expected = reference_attention(q_BHTD @ k_BHSD.transpose(-2, -1), v_BHSD, positions_T, positions_T, slopes_H,
                                   SCALE, documents_BT)
    assert (run_reference(q_BHTD, k_BHSD, v_BHSD) - expected).abs().max() <= TOL


def test_block_mask_is_head_and_batch_independent_without_documents() -> None:
    positions_T = torch.arange(130)
    block_mask = flex.build_block_mask(positions_T, positions_T)
    assert tuple(block_mask.shape) == (1, 1, 130, 130)
    assert block_mask.kv_num_blocks.device == positions_T.device


def torch_block_mask(q_positions_T: torch.Tensor, k_positions_S: torch.Tensor,
                     documents_BT: torch.Tensor | None = None) -> object:
    """torch's own create_block_mask of the same mask_mod: the whole (B, 1, T, S) mask at once."""
    from torch.nn.attention.flex_attention import create_block_mask

    mask_mod, batch = flex.causal_mask_mod(q_positions_T, k_positions_S), None
    if documents_BT is not None:
        mask_mod, batch = flex.document_mask_mod(mask_mod, documents_BT, documents_BT), documents_BT.shape[0]
    return create_block_mask(mask_mod, batch, None, q_positions_T.shape[0], k_positions_S.shape[0],
                             BLOCK_SIZE=flex.BLOCK_SIZE)


def assert_same_block_mask(actual: object, expected: object) -> None:
    assert actual.shape == expected.shape
    for mine, theirs in zip(actual.as_tuple(), expected.as_tuple()):
        if isinstance(mine, torch.Tensor):
            assert mine.dtype == theirs.dtype and torch.equal(mine, theirs)
        elif not callable(mine):
            assert mine == theirs


@pytest.mark.parametrize("band_pairs", [1 << 27, 128 * 128, 3 * 300 * 128])  # one band, one block row, ragged
def test_block_mask_equals_torchs_without_the_whole_mask(band_pairs: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """build_block_mask gives create_block_mask's BlockMask (every index tensor equal) for self-attention, decoding
    against a cache, lengths off the 128 block and documents, evaluating at most a band of the mask at once
    (torch's eager path holds the whole mask and an int64 copy of it: ~10 bytes per query-key pair)."""
    monkeypatch.setattr(flex, "MASK_ELEMENTS_PER_BAND", band_pairs)
    generator = torch.Generator().manual_seed(0)
    for length, keys in ((7, 7), (300, 300), (1, 257), (130, 389)):
        q_positions_T, k_positions_S = torch.arange(keys - length, keys) + 3, torch.arange(keys) + 3
        assert_same_block_mask(flex.build_block_mask(q_positions_T, k_positions_S),
                               torch_block_mask(q_positions_T, k_positions_S))
        if length == keys:
            documents_BT = flex.document_ids(torch.randint(0, 20, (3, length), generator=generator), 0)
            assert_same_block_mask(flex.build_block_mask(q_positions_T, k_positions_S, documents_BT, documents_BT),
                                   torch_block_mask(q_positions_T, k_positions_S, documents_BT))

    evaluated: list[int] = []
    causal = flex.causal_mask_mod(torch.arange(1000), torch.arange(1000))

    def recording(b, h, q_idx, kv_idx):
        visible = causal(b, h, q_idx, kv_idx)
        evaluated.append(torch.broadcast_shapes(b.shape, q_idx.shape, kv_idx.shape, visible.shape).numel())
        return visible

    flex.banded_block_mask(recording, 1, 1000, 1000, torch.device("cpu"))
    expected_max = max(128, band_pairs // (1024 * 128) * 128) * 1000  # whole query blocks, at least one
    assert sum(evaluated) == 1000 * 1000 and max(evaluated) == min(expected_max, 1000 * 1000)


def test_inference_on_cpu_runs_the_dense_float32_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """No grad on CPU outside a compile: the dense float32 evaluation, not torch's eager flex (its math path keeps
    bf16 scores, so ALiBi's biases blur: tests/test_backends.py)."""

    def refuse(*args, **kwargs):
        raise AssertionError("torch's eager flex used on CPU")

    monkeypatch.setattr(flex, "_flex_kernel", refuse)
    positions_T = torch.arange(7)
    q_BHTD, k_BHSD, v_BHSD = random_qkv(7, 7)
    block_mask = flex.build_block_mask(positions_T, positions_T)
    with torch.no_grad():
        out_BHTD = flex.flex_attention_forward(q_BHTD, k_BHSD, v_BHSD, block_mask, positions_T, positions_T, None,
                                               SCALE)
    assert out_BHTD.shape == (B, H, 7, D)


def test_compiled_forward_backward_matches_eager() -> None:
    """Block mask built and attention run inside one fullgraph compile, as the model's forward will."""
    positions_T = torch.arange(130) + 5
    slopes_H = slopes_or_none(True)

    def attend(q, k, v):
        block_mask = flex.build_block_mask(positions_T, positions_T)
        return flex.flex_attention_forward(q, k, v, block_mask, positions_T, positions_T, slopes_H, SCALE)

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    q_BHTD, k_BHSD, v_BHSD = random_qkv(130, 130)
    assert_close_all(outputs_and_grads(compiled, q_BHTD, k_BHSD, v_BHSD),
                     outputs_and_grads(attend, q_BHTD, k_BHSD, v_BHSD))
    with torch.no_grad():  # the real flex_attention traced in the graph
        assert (compiled(q_BHTD, k_BHSD, v_BHSD) - attend(q_BHTD, k_BHSD, v_BHSD)).abs().max() <= TOL


def test_mismatched_inputs_raise() -> None:
    positions_T = torch.arange(7)
    documents_BT = torch.zeros(B, 7, dtype=torch.int64)
    with pytest.raises(ValueError, match="together"):
        flex.build_block_mask(positions_T, positions_T, documents_BT, None)
    with pytest.raises(ValueError, match=r"\(2, 6\)"):
        flex.build_block_mask(positions_T, positions_T, documents_BT, documents_BT[:, :6])
    q_BHTD, k_BHSD, v_BHSD = random_qkv(7, 7)
    block_mask = flex.build_block_mask(positions_T[:5], positions_T[:5])
    with pytest.raises(ValueError, match="T=7"):
        flex.flex_attention_forward(q_BHTD, k_BHSD, v_BHSD, block_mask, positions_T, positions_T, None, SCALE)


def test_check_flex_available_names_the_version(monkeypatch: pytest.MonkeyPatch) -> None:
    flex.check_flex_available()
    monkeypatch.setattr(torch, "__version__", "2.4.1")
    assert not flex.flex_available()
    with pytest.raises(ValueError, match=r"torch >= 2\.5 .*this is torch 2\.4\.1"):
        flex.check_flex_available()
