"""The fused, chunked LM head + cross entropy (megatron_lite/model/loss.py) equals the plain
``F.cross_entropy(F.linear(h, w).float(), labels)`` path, compiles as one graph, and peaks at a fraction
of the plain path's memory."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from megatron_lite.bench.loss_memory import LossMemorySettings, format_report
from megatron_lite.bench.loss_memory import run as run_bench
from megatron_lite.bench.memory import track_peak_memory
from megatron_lite.model.loss import LMHead, chunked_cross_entropy

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Results = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # loss, grad hidden, grad weight


def plain(hidden_NC: torch.Tensor, weight_VC: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden_NC, weight_VC).float(), labels_N)


def fused(chunk_tokens: int) -> LossFn:
    return lambda h, w, y: chunked_cross_entropy(h, w, y, chunk_tokens)


def inputs(n: int, v: int, c: int, dtype: torch.dtype = torch.float32,
           ignored: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Leaf hidden (n, c) and weight (v, c) of ``dtype``; labels (n,) with ``ignored`` rows set to -100
    at a stride, so chunks hold both kinds."""
    generator = torch.Generator().manual_seed(1000 * n + v)
    hidden_NC = torch.randn(n, c, generator=generator).to(dtype).requires_grad_()
    weight_VC = (torch.randn(v, c, generator=generator) * 0.3).to(dtype).requires_grad_()
    labels_N = torch.randint(0, v, (n,), generator=generator)
    labels_N[torch.arange(ignored) * (n // max(ignored, 1))] = -100
    return hidden_NC, weight_VC, labels_N


def run(loss_fn: LossFn, hidden_NC: torch.Tensor, weight_VC: torch.Tensor, labels_N: torch.Tensor) -> Results:
    hidden_NC.grad = weight_VC.grad = None
    loss = loss_fn(hidden_NC, weight_VC, labels_N)
    loss.backward()
    return loss.detach(), hidden_NC.grad.clone(), weight_VC.grad.clone()


def assert_results_close(got: Results, want: Results, rtol: float, atol: float) -> None:
    for name, a, b in zip(("loss", "grad_hidden", "grad_weight"), got, want):
        assert a.dtype == b.dtype, (name, a.dtype, b.dtype)
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize(("n", "chunk", "ignored"), [(50, 16, 0), (50, 16, 7), (33, 100, 3), (64, 64, 0), (50, 1, 5)],
                         ids=["remainder", "ignored_rows", "chunk_gt_n", "exact_multiple", "chunk_1"])
def test_fused_equals_plain_loss_and_gradients(dtype: torch.dtype, n: int, chunk: int, ignored: int) -> None:
    hidden, weight, labels = inputs(n, 97, 24, dtype, ignored)
    # fp64: the reference stays fp64 (the plain path's .float() would make it the less exact side)
    reference = plain if dtype == torch.float32 else (lambda h, w, y: F.cross_entropy(F.linear(h, w), y))
    assert_results_close(run(fused(chunk), hidden, weight, labels), run(reference, hidden, weight, labels),
                         rtol=1e-6, atol=1e-7 if dtype == torch.float32 else 1e-12)


def test_all_labels_ignored_matches_cross_entropy() -> None:
    hidden, weight, labels = inputs(20, 30, 8)
    labels.fill_(-100)
    loss, grad_hidden, grad_weight = run(fused(7), hidden, weight, labels)
    expected = run(plain, hidden, weight, labels)
    assert torch.isnan(loss) and torch.isnan(expected[0])  # 0 / 0, as F.cross_entropy's mean
    assert torch.equal(grad_hidden, expected[1]) and torch.equal(grad_weight, expected[2])  # zeros
    assert not grad_hidden.any() and not grad_weight.any()


def test_bf16_matches_an_fp32_reference_of_the_same_values() -> None:
    hidden, weight, labels = inputs(40, 64, 16, torch.bfloat16, ignored=4)
    loss, grad_hidden, grad_weight = run(fused(16), hidden, weight, labels)
    reference = run(plain, hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_(), labels)
    assert loss.dtype == torch.float32 and grad_hidden.dtype == grad_weight.dtype == torch.bfloat16
    # float32 logits from the bf16 values: the loss is exact to float32, the gradients to bf16 rounding
    torch.testing.assert_close(loss, reference[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_hidden.float(), reference[1], rtol=1e-2, atol=1e-4)
    torch.testing.assert_close(grad_weight.float(), reference[2], rtol=1e-2, atol=1e-4)


@pytest.mark.parametrize("fused_loss", [True, False], ids=["fused", "plain"])
def test_lm_head_tied_weight_accumulates_like_the_plain_path(fused_loss: bool) -> None:
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(50, 8)
    head = LMHead(8, 50)
    head.weight = embedding.weight  # tied, as GPT does
    assert head.weight is embedding.weight and list(head.state_dict()) == ["weight"] and head.bias is None
    ids_BT, labels_BT = torch.randint(0, 50, (3, 10)), torch.randint(0, 50, (3, 10))
    labels_BT[0, :4] = -100
    loss = head(embedding(ids_BT), labels_BT, fused=fused_loss, chunk_tokens=7)
    loss.backward()
    reference_weight = embedding.weight.detach().clone().requires_grad_()
    logits_BTV = F.linear(F.embedding(ids_BT, reference_weight), reference_weight)
    expected = F.cross_entropy(logits_BTV.reshape(-1, 50).float(), labels_BT.reshape(-1))
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(embedding.weight.grad, reference_weight.grad, rtol=1e-6, atol=1e-7)


def test_lm_head_without_labels_returns_logits_and_uses_its_defaults() -> None:
    head = LMHead(8, 50)
    x_BTC = torch.randn(2, 3, 8)
    assert torch.equal(head(x_BTC), F.linear(x_BTC, head.weight))
    labels_BT = torch.randint(0, 50, (2, 3))
    head.fused, head.chunk_tokens = False, 0  # plain: chunk_tokens unused
    torch.testing.assert_close(head(x_BTC, labels_BT), plain(x_BTC.reshape(6, 8), head.weight, labels_BT.reshape(6)))
    head.fused = True
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        head(x_BTC, labels_BT)


def test_compiled_fullgraph_equals_eager() -> None:
    torch._dynamo.reset()
    hidden, weight, labels = inputs(50, 97, 24, ignored=6)
    expected = run(fused(16), hidden, weight, labels)
    compiled = torch.compile(fused(16), fullgraph=True, backend="aot_eager")
    assert_results_close(run(compiled, hidden, weight, labels), expected, rtol=1e-6, atol=1e-7)


def test_compiled_head_is_written_for_inductor() -> None:
    """Traced by torch.compile the head scatters nothing into the logits (the eager chunk's in-place passes,
    functionalised, became a second (n, V) buffer and a scatter fallback) and makes one GEMM per gradient per
    chunk (eager bf16 rounds half a chunk at a time: five), and takes each label's logit without a gather (inductor
    put the chunks' gathers after the last chunk, keeping every chunk's logits alive to the end); bf16 results as
    the eager head's."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    forward_graphs: list[torch.fx.GraphModule] = []

    def record(graph: torch.fx.GraphModule, _: object) -> Callable[..., object]:
        forward_graphs.append(graph)
        return make_boxed_func(graph.forward)

    torch._dynamo.reset()
    hidden, weight, labels = inputs(50, 97, 24, torch.bfloat16, ignored=6)  # 4 chunks of 16
    expected = run(fused(16), hidden, weight, labels)
    backend = aot_autograd(fw_compiler=record, bw_compiler=lambda graph, _: make_boxed_func(graph.forward))
    got = run(torch.compile(fused(16), fullgraph=True, backend=backend), hidden, weight, labels)
    ops = [str(node.target) for node in forward_graphs[0].graph.nodes if node.op == "call_function"]
    assert sum(op.startswith(("aten.mm", "aten.addmm")) for op in ops) == 3 * 4, ops
    assert not [op for op in ops if "scatter" in op and "slice_scatter" not in op], ops  # slices: grad_hidden rows
    assert not [op for op in ops if "gather" in op], ops
    assert_results_close(got, expected, rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("chunk_tokens", [0, -4, 2.5, True])
def test_invalid_chunk_tokens_is_a_value_error(chunk_tokens: object) -> None:
    hidden, weight, labels = inputs(4, 8, 4)
    with pytest.raises(ValueError, match=f"chunk_tokens={chunk_tokens!r}"):
        chunked_cross_entropy(hidden, weight, labels, chunk_tokens)  # type: ignore[arg-type]


def test_mismatched_shapes_are_value_errors() -> None:
    hidden, weight, labels = inputs(4, 8, 4)
    with pytest.raises(ValueError, match=r"weight \(8, 3\)"):
        chunked_cross_entropy(hidden, weight[:, :3], labels)
    with pytest.raises(ValueError, match=r"labels \(3,\)"):
        chunked_cross_entropy(hidden, weight, labels[:3])


def test_peak_memory_is_a_fraction_of_the_plain_path() -> None:
    hidden, weight, labels = inputs(2048, 8192, 64)
    peaks = []
    for loss_fn in (plain, fused(256)):
        hidden.grad = weight.grad = None
        with track_peak_memory() as tracker:
            loss_fn(hidden, weight, labels).backward()
        peaks.append(tracker.peak_bytes)
    assert peaks[1] <= 0.25 * peaks[0], peaks


def test_loss_memory_bench_reports_both_peaks_and_the_ratio() -> None:
    result = run_bench(LossMemorySettings(hidden=16, vocab=2048, tokens=512, chunk_tokens=64))
    assert 0 < result.fused_peak_mib < result.plain_peak_mib and result.ratio <= 0.25
    report = format_report(result)
    assert "plain  peak" in report and "fused  peak" in report and "fused / plain peak" in report
    assert result.to_json()["ratio"] == result.ratio
    with pytest.raises(ValueError, match="--chunk-tokens 0"):
        run_bench(LossMemorySettings(chunk_tokens=0))


def test_gemm_modes_against_float64() -> None:
    """bf16 inputs: the mixed head's loss is as exact as the float32-operand head's (same products, float32
    sums), the bf16-logit head's is not; every gradient stays near bf16's own rounding."""
    from megatron_lite.bench.loss_precision import HeadSettings, precision_rows

    rows = {row.head: row for row in precision_rows(HeadSettings(tokens=256, hidden=64, vocab=1024, chunk_tokens=100))}
    mixed, fp32, bf16_logits = rows["fused mixed"], rows["fused fp32"], rows["fused input_dtype"]
    assert mixed.loss_abs_error <= 2 * fp32.loss_abs_error + 1e-7
    assert bf16_logits.loss_abs_error > 5 * mixed.loss_abs_error
    for row in rows.values():
        assert row.grad_hidden_rel_error < 5e-3 and row.grad_weight_rel_error < 5e-3, row


@pytest.mark.parametrize("gemm", ["mixed", "input_dtype"])
def test_gemm_modes_equal_fp32_for_float32_inputs(gemm: str) -> None:
    hidden, weight, labels = inputs(50, 97, 24, ignored=3)
    assert_results_close(run(lambda h, w, y: chunked_cross_entropy(h, w, y, 16, gemm=gemm), hidden, weight, labels),
                         run(fused(16), hidden, weight, labels), rtol=0, atol=0)


@pytest.mark.parametrize("factor", [-2.5, 0.0], ids=["negative", "zero"])
def test_gradient_of_a_scaled_loss(factor: float) -> None:
    """The backward puts |grad| into the exponent and the sign on the outputs: a loss times -2.5 (or 0) still
    gets the plain path's gradients."""
    hidden, weight, labels = inputs(50, 97, 24, torch.float64, ignored=5)
    scaled = (lambda loss_fn: lambda h, w, y: loss_fn(h, w, y) * factor)
    reference = scaled(lambda h, w, y: F.cross_entropy(F.linear(h, w), y))
    assert_results_close(run(scaled(fused(16)), hidden, weight, labels), run(reference, hidden, weight, labels),
                         rtol=1e-6, atol=1e-12)


class _GemmCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts matrix products (mm / addmm / their dtype overloads) as they are dispatched."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.overloadpacket.__name__ in ("mm", "addmm", "addmm_"):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _gemms_in(work: Callable[[], object]) -> int:
    with _GemmCounter() as counter:
        work()
    return counter.count


def test_each_chunks_logits_are_made_once_and_no_gradient_is_computed_without_grad() -> None:
    """Three GEMMs per chunk with gradients (logits, grad_hidden, grad_weight), all in forward, none in backward
    (the recomputing head took four); one per chunk under no_grad; a frozen weight skips its gradient's."""
    hidden, weight, labels = inputs(50, 97, 24, ignored=3)  # 50 tokens in chunks of 16: 4 chunks
    loss = None

    def forward() -> None:
        nonlocal loss
        loss = chunked_cross_entropy(hidden, weight, labels, 16)

    assert _gemms_in(forward) == 3 * 4
    assert _gemms_in(lambda: loss.backward()) == 0
    assert_results_close((loss.detach(), hidden.grad, weight.grad), run(plain, hidden, weight, labels),
                         rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        assert _gemms_in(lambda: chunked_cross_entropy(hidden, weight, labels, 16)) == 4
    frozen = weight.detach()
    hidden.grad = None
    assert _gemms_in(lambda: chunked_cross_entropy(hidden, frozen, labels, 16).backward()) == 2 * 4
    torch.testing.assert_close(hidden.grad, run(plain, hidden, weight, labels)[1], rtol=1e-5, atol=1e-6)


class _OutputShapes(torch.utils._python_dispatch.TorchDispatchMode):
    """Records (operator name, output shape) of every dispatched operator that returns one tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.ops.append((func.overloadpacket.__name__, tuple(out.shape)))
        return out


def test_weight_gradient_sum_starts_from_the_first_product() -> None:
    """No zeroed (V, C) buffer for grad_weight: the first chunk's product is the running sum and each later
    chunk's is added to it in place (4 chunks: one mm, three addmm_), with the plain path's result."""
    hidden, weight, labels = inputs(50, 97, 24, ignored=3)  # 50 tokens in chunks of 16: 4 chunks
    with _OutputShapes() as recorder:
        loss = chunked_cross_entropy(hidden, weight, labels, 16)
    weight_shaped = [name for name, shape in recorder.ops if shape == (97, 24)]
    assert not {"zeros", "zero_", "fill_", "new_zeros"} & set(weight_shaped), weight_shaped
    assert weight_shaped.count("addmm_") == 3, weight_shaped
    loss.backward()
    torch.testing.assert_close(weight.grad, run(plain, hidden, weight, labels)[2], rtol=1e-5, atol=1e-6)
