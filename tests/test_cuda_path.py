"""The CUDA code path of a bf16 training step, checked on CPU: the model and its inputs live on the ``meta``
device (no data, every operator still dispatched), the loss head takes the operator CUDA takes
(``torch.mm(..., out_dtype=float32)``), and a dispatch mode records every GEMM's operand dtypes and every
operation that would make a GPU wait for the host or the host for the GPU: a copy from a host tensor into
the model's device, ``item``, ``nonzero``, ``equal``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_lite import config as config_lib
from megatron_lite.model import GPT
from megatron_lite.model import loss as loss_module
from megatron_lite.model.variants import variant_named

aten = torch.ops.aten
GEMMS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.mm.dtype, aten.addmm.dtype}
HOST_READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.is_nonzero.default, aten.equal.default}
COPIES = {aten._to_copy.default, aten.copy_.default}
SCHEMES = ("rope", "coca_slack", "coca_strict", "alibi")


class StepRecorder(TorchDispatchMode):
    """GEMM operand dtypes, host reads, and host-to-device copies (a CPU tensor of more than a scalar copied
    into a tensor on the model's device) seen while it is active."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.gemm_dtypes: list[tuple[str, tuple[torch.dtype, ...]]] = []
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in GEMMS:
            operands = [a for a in args if isinstance(a, torch.Tensor)][-2:]  # addmm's bias is not an operand
            self.gemm_dtypes.append((str(func), tuple(a.dtype for a in operands)))
        elif func in HOST_READS:
            self.syncs.append(str(func))
        elif func in COPIES:
            source = args[1] if func is aten.copy_.default else args[0]
            target = args[0] if func is aten.copy_.default else out
            if (isinstance(source, torch.Tensor) and source.device.type == "cpu" and source.dim() > 0
                    and isinstance(target, torch.Tensor) and target.device == self.device):
                self.syncs.append(f"{func} from a host tensor {tuple(source.shape)}")
        return out


def cuda_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False) -> torch.Tensor:
    """SDPA as CUDA runs it: the flash kernel, or the memory-efficient one with a bias (meta has both), where the
    meta device would pick the math fallback, which upcasts bf16 to float32 and is never the GPU's choice."""
    assert not enable_gqa and dropout_p == 0.0
    if attn_mask is None:
        return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)[0]
    bias = attn_mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, is_causal, scale=scale)[0]


def meta_step(label: str, monkeypatch: pytest.MonkeyPatch, gemm: str = "mixed") -> StepRecorder:
    """One bf16 forward (fused loss) and backward of a tiny model of ``label`` on the meta device, recorded."""
    monkeypatch.setattr(loss_module, "native_float32_output", lambda device: True)  # CUDA's operator choices
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", cuda_sdpa)
    config = config_lib.from_dict({
        "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
                  "max_position_embeddings": 32, "vocab_size": 250, "make_vocab_size_divisible_by": 128,
                  "position": {"scheme": variant_named(label).scheme, "constraint": variant_named(label).constraint},
                  "attention": {"backend": "sdpa"}},
        "precision": "bf16"})
    device = torch.device("meta")
    with device:
        model = GPT(config.model).to(torch.bfloat16).train()
        batch = torch.randint(0, 250, (2, 33))
    model.lm_head.gemm = gemm
    recorder = StepRecorder(device)
    with recorder:
        model(batch[:, :-1], labels=batch[:, 1:]).backward()
        model(batch[:, :-1], labels=batch[:, 1:]).backward()  # the second step too: nothing cached is re-copied
    return recorder


@pytest.mark.parametrize("label", SCHEMES)
def test_bf16_step_issues_no_float32_operand_gemm(label: str, monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = meta_step(label, monkeypatch)
    assert recorder.gemm_dtypes, "no GEMM recorded"
    float32 = [(op, dtypes) for op, dtypes in recorder.gemm_dtypes if torch.float32 in dtypes]
    assert not float32, f"{label}: GEMMs with float32 operands on the CUDA path: {float32[:5]}"
    assert any(op.endswith(".dtype") for op, _ in recorder.gemm_dtypes), "the loss head's float32-output GEMMs"


def test_fp32_option_keeps_float32_operands(monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = meta_step("rope", monkeypatch, gemm="fp32")
    head = [dtypes for _, dtypes in recorder.gemm_dtypes if torch.float32 in dtypes]
    assert len(head) >= 3  # logits, grad_hidden, grad_weight of the one chunk, at least


@pytest.mark.parametrize("label", SCHEMES)
def test_training_step_makes_no_host_sync(label: str, monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = meta_step(label, monkeypatch)
    assert not recorder.syncs, f"{label}: host syncs in forward + backward: {recorder.syncs}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_mixed_head_matches_the_float32_operand_head() -> None:
    """On a GPU the mixed head runs aten::mm.dtype / addmm.dtype and agrees with the float32-operand head: same
    products, both float32 sums (the loss to float32 rounding; the gradients to the bf16 rounding of the softmax
    gradient)."""
    from megatron_lite.bench.loss_precision import HeadSettings, head_inputs
    from megatron_lite.model.loss import chunked_cross_entropy, native_float32_output

    assert native_float32_output(torch.device("cuda"))
    hidden, weight, labels = head_inputs(HeadSettings(tokens=1024, hidden=256, vocab=4096, chunk_tokens=300), "cuda")
    results = {}
    for gemm in ("mixed", "fp32"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = chunked_cross_entropy(h, w, labels, 300, gemm=gemm)
        loss.backward()
        results[gemm] = (loss.detach(), h.grad.float(), w.grad.float())
    torch.testing.assert_close(results["mixed"][0], results["fp32"][0], rtol=1e-5, atol=1e-5)
    for got, want in zip(results["mixed"][1:], results["fp32"][1:]):
        assert float((got - want).norm() / want.norm()) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("label", SCHEMES)
def test_cuda_training_step_makes_no_host_sync(label: str) -> None:
    """The meta-device check's claim on a real GPU: torch's sync debug mode raises on any synchronising call."""
    config = config_lib.from_dict({
        "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
                  "max_position_embeddings": 32, "vocab_size": 250, "make_vocab_size_divisible_by": 128,
                  "position": {"scheme": variant_named(label).scheme, "constraint": variant_named(label).constraint}},
        "precision": "bf16"})
    with torch.device("cuda"):
        model = GPT(config.model).to(torch.bfloat16).train()
        batch = torch.randint(0, 250, (2, 33))
    model(batch[:, :-1], labels=batch[:, 1:]).backward()  # warm-up: first-use allocations and cuBLAS handles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(batch[:, :-1], labels=batch[:, 1:]).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("mode", ["regional", "whole"])
def test_compiled_graphs_take_the_rotary_tables_as_inputs(mode: str) -> None:
    """No compiled region computes cos/sin: traced inside a whole-model graph, inductor recomputed the float64
    tables in every layer's kernels, per activation element (about 40% of a 350M step on an H200)."""
    from megatron_lite.model.compile import compile_model

    graphs: list[torch.fx.GraphModule] = []

    def recording_backend(graph: torch.fx.GraphModule, example_inputs: list) -> Any:
        graphs.append(graph)
        return graph.forward

    config = config_lib.from_dict({"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                             "seq_length": 32, "max_position_embeddings": 32, "vocab_size": 250,
                                             "position": {"scheme": "coca", "constraint": "slack"}}})
    model = GPT(config.model)
    compile_model(model, mode, backend=recording_backend)  # type: ignore[arg-type]
    torch._dynamo.reset()
    batch = torch.randint(0, 250, (2, 33))
    model(batch[:, :-1], labels=batch[:, 1:]).backward()
    assert graphs
    called = {str(node.target) for graph in graphs for node in graph.graph.nodes if node.op in ("call_function",
                                                                                                "call_method")}
    assert not {name for name in called if "cos" in name or "sin" in name}, sorted(called)
