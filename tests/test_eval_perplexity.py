"""Sliding-window perplexity: window layout, every token scored once, agreement with full forwards,
and the dynamic-NTK base each window is evaluated with (acceptance items 1 and 4)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.config import RopeScalingConfig
from megatron_lite.eval.perplexity import sliding_window_perplexity, sliding_windows, token_nlls
from megatron_lite.model import build_model
from test_eval_support import single_thread, tiny_eval_config  # noqa: F401 (fixture)

LAYOUTS = [(n, window, stride) for n in (1, 2, 7, 33, 64) for window, stride in
           [(1, 1), (4, 1), (4, 4), (8, 3), (16, 5), (32, 32), (64, 16), (100, 7)] if stride <= window]


@pytest.mark.parametrize("num_tokens,window,stride", LAYOUTS)
def test_windows_score_every_token_exactly_once(num_tokens: int, window: int, stride: int) -> None:
    scored = []
    for index, span in enumerate(sliding_windows(num_tokens, window, stride)):
        assert span.begin == index * stride and span.end == min(span.begin + window, num_tokens)
        first_position = span.first_target - 1 - span.begin  # where the first scored token is predicted
        assert 0 <= first_position and first_position + span.num_scored <= span.length
        if index == 0:  # the first window scores every prediction it makes
            assert span.num_scored == min(window, num_tokens - 1)
        else:  # later windows: only new tokens, at most S of them
            assert 1 <= span.num_scored <= stride
        scored += range(span.first_target, span.first_target + span.num_scored)
    assert scored == list(range(1, num_tokens))  # token 0 has no prediction


def test_stride_longer_than_window_is_a_user_error() -> None:
    with pytest.raises(ValueError, match="--stride"):
        sliding_windows(100, 8, 9)


@pytest.fixture(scope="module")
def rope_model() -> torch.nn.Module:
    return build_model(tiny_eval_config("rope", seq_length=16, vocab_size=300)).eval()


@pytest.fixture(scope="module")
def document() -> torch.Tensor:
    return torch.randint(0, 300, (70,), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("window,stride", [(8, 8), (16, 5), (32, 16), (70, 3)])
def test_model_scores_each_token_once(rope_model: torch.nn.Module, document: torch.Tensor, window: int,
                                      stride: int) -> None:
    nll, times_scored = token_nlls(rope_model, document, window, stride, batch_size=3)
    assert int(times_scored[0]) == 0 and bool((times_scored[1:] == 1).all())
    assert bool(nll[1:].isfinite().all()) and bool(nll[0].isnan())


@pytest.mark.parametrize("window", [70, 128])
@pytest.mark.parametrize("scheme,constraint", [("rope", "slack"), ("coca", "slack"), ("coca", "strict"),
                                               ("alibi", "slack")])
def test_one_window_over_the_document_is_the_full_forward(document: torch.Tensor, window: int, scheme: str,
                                                          constraint: str) -> None:
    model = build_model(tiny_eval_config(scheme, constraint, seq_length=16, vocab_size=300)).eval()
    with torch.no_grad():
        logits_TV = model(document[None])[0]  # (T, V): one forward over all 70 tokens
    full_nll_T = F.cross_entropy(logits_TV[:-1], document[1:], reduction="none").double()
    nll, _ = token_nlls(model, document, window, stride=4)
    torch.testing.assert_close(nll[1:], full_nll_T, atol=1e-5, rtol=1e-5)
    result = sliding_window_perplexity(model, [document], window, stride=4)
    assert result.num_tokens == 69
    assert math.isclose(result.perplexity, math.exp(float(full_nll_T.mean())), rel_tol=1e-6)


def test_disjoint_windows_match_independent_chunks(rope_model: torch.nn.Module, document: torch.Tensor) -> None:
    """stride = window: each chunk of 16 tokens is its own forward and predicts the 16 tokens after
    its first; the oracle is written out here."""
    total, count = 0.0, 0
    with torch.no_grad():
        for begin in range(0, 70, 16):
            chunk = document[begin : begin + 16]
            targets = document[begin + 1 : begin + 17]
            logits_TV = rope_model(chunk[None])[0, : len(targets)]
            total += float(F.cross_entropy(logits_TV, targets, reduction="sum"))
            count += len(targets)
    result = sliding_window_perplexity(rope_model, [document], 16, 16)
    assert result.num_tokens == count == 69
    assert math.isclose(result.perplexity, math.exp(total / count), rel_tol=1e-5)


def test_documents_are_token_weighted(rope_model: torch.nn.Module, document: torch.Tensor) -> None:
    short, long = document[:20], document
    both = sliding_window_perplexity(rope_model, [short, long], 16, 8)
    first = sliding_window_perplexity(rope_model, [short], 16, 8)
    second = sliding_window_perplexity(rope_model, [long], 16, 8)
    assert both.num_tokens == 19 + 69
    assert math.isclose(both.nll_sum, first.nll_sum + second.nll_sum, rel_tol=1e-9)


def test_batching_windows_does_not_change_the_result(rope_model: torch.nn.Module, document: torch.Tensor) -> None:
    one = sliding_window_perplexity(rope_model, [document], 32, 8, batch_size=1)
    many = sliding_window_perplexity(rope_model, [document], 32, 8, batch_size=4)
    assert math.isclose(one.perplexity, many.perplexity, rel_tol=1e-5)


# ----------------------------------------------------------------------------------------------
# Acceptance 4: dynamic NTK uses the HF-formula base of the window


def hf_dynamic_base(base: float, rotary_dims: int, factor: float, seq_len: int, train_len: int) -> float:
    """transformers' _compute_dynamic_ntk_parameters, written out independently of megatron_lite."""
    if seq_len <= train_len:
        return base
    return base * ((factor * seq_len / train_len) - (factor - 1)) ** (rotary_dims / (rotary_dims - 2))


@pytest.mark.parametrize("scheme,constraint", [("rope", "slack"), ("coca", "slack"), ("coca", "strict")])
@pytest.mark.parametrize("window", [16, 40, 64])
def test_dynamic_ntk_window_uses_the_hf_base(document: torch.Tensor, scheme: str, constraint: str,
                                             window: int) -> None:
    """Evaluating with dynamic:4 equals evaluating an unscaled model whose rotary base is the HF
    dynamic base for a sequence of `window` tokens (training length 16, head dim 8)."""
    factor, train_length = 4.0, 16
    dynamic = build_model(tiny_eval_config(scheme, constraint, seq_length=train_length, vocab_size=300)).eval()
    dynamic.set_rope_scaling(RopeScalingConfig(type="dynamic", factor=factor))
    expected_base = hf_dynamic_base(10000.0, 8, factor, window, train_length)
    fixed = build_model(tiny_eval_config(scheme, constraint, seq_length=train_length, vocab_size=300)).eval()
    fixed.config.position.rotary_emb_base = expected_base
    fixed.set_rope_scaling(RopeScalingConfig(type="none"))  # rebuilds the rotary tables with that base
    fixed.load_state_dict(dynamic.state_dict())

    seen_lengths: list[int] = []
    tables = dynamic.rotary.tables
    dynamic.rotary.tables = lambda positions, seq_len, dtype=torch.float32: (  # type: ignore[method-assign]
        seen_lengths.append(seq_len) or tables(positions, seq_len, dtype))
    doc = document[:64]  # with stride 8 every window of 16, 40 or 64 tokens is full length
    nll_dynamic, _ = token_nlls(dynamic, doc, window, stride=8)
    nll_fixed, _ = token_nlls(fixed, doc, window, stride=8)
    assert set(seen_lengths) == {window}  # each window fixes the base from its own length
    torch.testing.assert_close(nll_dynamic, nll_fixed, atol=1e-6, rtol=1e-6, equal_nan=True)
    if window > train_length:  # and the base really moved: the unscaled model scores differently
        plain = build_model(tiny_eval_config(scheme, constraint, seq_length=train_length, vocab_size=300)).eval()
        plain.load_state_dict(dynamic.state_dict())
        nll_plain, _ = token_nlls(plain, doc, window, stride=8)
        assert not torch.allclose(nll_plain[1:], nll_dynamic[1:], atol=1e-4)
