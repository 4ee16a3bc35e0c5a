"""The fused, chunked LM head + cross entropy (megatron_lite/model/loss.py) equals the plain path, and its
peak memory is a fraction of it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.bench.memory import track_peak_memory
from megatron_lite.model.loss import LMHead, chunked_cross_entropy


def plain(hidden_NC: torch.Tensor, weight_VC: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden_NC, weight_VC).float(), labels_N)


def inputs(n: int, v: int, c: int, dtype: torch.dtype = torch.float32, ignored: int = 0):
    generator = torch.Generator().manual_seed(n + v)
    hidden = torch.randn(n, c, generator=generator).to(dtype).requires_grad_()
    weight = (torch.randn(v, c, generator=generator) * 0.2).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=generator)
    labels[:ignored] = -100
    return hidden, weight, labels


def grads(loss_fn, hidden, weight, labels):
    hidden.grad = weight.grad = None
    loss = loss_fn(hidden, weight, labels)
    loss.backward()
    return loss.detach(), hidden.grad.clone(), weight.grad.clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("n", "chunk", "ignored"), [(50, 16, 0), (50, 16, 7), (33, 100, 3), (64, 64, 0)])
def test_fused_equals_plain_loss_and_gradients(dtype: torch.dtype, n: int, chunk: int, ignored: int) -> None:
    hidden, weight, labels = inputs(n, 97, 24, dtype, ignored)
    expected = grads(plain, hidden, weight, labels)
    fused = grads(lambda h, w, y: chunked_cross_entropy(h, w, y, chunk), hidden, weight, labels)
    for got, want in zip(fused, expected):
        torch.testing.assert_close(got.to(want.dtype), want, rtol=1e-6, atol=1e-7)


def test_bf16_is_close_to_the_fp32_reference() -> None:
    hidden, weight, labels = inputs(40, 64, 16, torch.bfloat16)
    loss, grad_hidden, grad_weight = grads(lambda h, w, y: chunked_cross_entropy(h, w, y, 16), hidden, weight, labels)
    reference = grads(plain, hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_(), labels)
    assert grad_hidden.dtype == grad_weight.dtype == torch.bfloat16
    torch.testing.assert_close(loss, reference[0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grad_weight.float(), reference[2], rtol=5e-2, atol=5e-3)


def test_lm_head_with_a_tied_weight_accumulates_like_the_plain_path() -> None:
    embedding = torch.nn.Embedding(50, 8)
    results = []
    for fused in (True, False):
        torch.manual_seed(0)
        head = LMHead(8, 50)
        head.weight = embedding.weight
        head.fused, head.chunk_tokens = fused, 7
        embedding.weight.grad = None
        ids = torch.randint(0, 50, (3, 10))
        loss = head(embedding(ids), torch.randint(0, 50, (3, 10)))
        loss.backward()
        results.append((loss.detach(), embedding.weight.grad.clone()))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-6, atol=1e-7)
    assert LMHead(8, 50)(torch.randn(2, 3, 8)).shape == (2, 3, 50)  # no labels: logits


def test_compiles_as_one_graph() -> None:
    hidden, weight, labels = inputs(50, 97, 24)
    expected = grads(lambda h, w, y: chunked_cross_entropy(h, w, y, 16), hidden, weight, labels)
    compiled = torch.compile(lambda h, w, y: chunked_cross_entropy(h, w, y, 16), fullgraph=True, backend="aot_eager")
    for got, want in zip(grads(compiled, hidden, weight, labels), expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_bad_chunk_size_is_a_value_error() -> None:
    hidden, weight, labels = inputs(4, 8, 4)
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        chunked_cross_entropy(hidden, weight, labels, 0)


def test_peak_memory_is_a_fraction_of_the_plain_path() -> None:
    hidden, weight, labels = inputs(2048, 8192, 64)
    peaks = []
    for loss_fn in (plain, lambda h, w, y: chunked_cross_entropy(h, w, y, 256)):
        hidden.grad = weight.grad = None
        with track_peak_memory() as tracker:
            loss_fn(hidden, weight, labels).backward()
        peaks.append(tracker.peak_bytes)
    assert peaks[1] <= 0.25 * peaks[0], peaks
