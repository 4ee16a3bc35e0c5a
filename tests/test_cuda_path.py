"""The CUDA code path of a bf16 training step, checked on CPU: the model and its inputs live on the ``meta``
device (no data, every operator still dispatched) and ``dev.step_census`` (dev/step_census.py) makes CUDA's operator
choices there (the loss head's ``torch.mm(..., out_dtype=float32)``, fused SDPA) while it counts every GEMM's
operand dtypes and every operation that would make a GPU wait for the host or the host for the GPU: a copy from
a host tensor into the model's device, ``item``, ``nonzero``, ``equal``."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
import torch

from dev.step_census import StepCensus, census_step
from megatron_lite import config as config_lib
from megatron_lite.model import GPT
from megatron_lite.model.variants import variant_named

SCHEMES = ("rope", "coca_slack", "coca_strict", "alibi")
TOKENS, HIDDEN, PADDED_VOCAB = 2 * 32, 64, 256  # the tiny model's batch of 2 x 32 and its LM head


def tiny_config(label: str) -> Any:
    return config_lib.from_dict({
        "model": {"num_layers": 2, "hidden_size": HIDDEN, "num_attention_heads": 4, "seq_length": 32,
                  "max_position_embeddings": 32, "vocab_size": 250, "make_vocab_size_divisible_by": 128,
                  "position": {"scheme": variant_named(label).scheme, "constraint": variant_named(label).constraint},
                  "attention": {"backend": "sdpa"}},
        "precision": "bf16"})


def meta_steps(label: str, gemm: str = "mixed") -> list[StepCensus]:
    """Two bf16 training steps (fused loss, backward) of a tiny model of ``label`` on the meta device, counted;
    the second too, so that nothing cached after the first is copied again."""
    with torch.device("meta"):
        model = GPT(tiny_config(label).model).to(torch.bfloat16).train()
        batch = torch.randint(0, 250, (2, 33))
    model.lm_head.gemm = gemm
    return [census_step(model, batch) for _ in range(2)]


@pytest.mark.parametrize("label", SCHEMES)
def test_bf16_step_issues_no_float32_operand_gemm(label: str) -> None:
    for census in meta_steps(label):
        assert census.gemm_flops, "no GEMM counted"
        float32 = {key: flops for key, flops in census.total().gemm_flops.items() if "float32" in key}
        assert not float32, f"{label}: GEMMs with float32 operands on the CUDA path: {float32}"
        assert any(op.endswith(".dtype") for op in census.total().gemm_calls), "the head's float32-output GEMMs"


def test_fp32_option_keeps_float32_operands() -> None:
    census = meta_steps("rope", gemm="fp32")[0]
    # logits, grad_hidden and grad_weight of the one chunk, at least
    assert census.fp32_gemm_flops >= 3 * 2 * TOKENS * HIDDEN * PADDED_VOCAB


@pytest.mark.parametrize("label", SCHEMES)
def test_training_step_makes_no_host_sync(label: str) -> None:
    for census in meta_steps(label):
        assert not census.sync_count, f"{label}: host syncs in forward + backward: {dict(census.sync_ops)}"


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
def test_cuda_compiled_head_matches_the_eager_head() -> None:
    """The head as torch.compile traces it (functional chunks, aten::mm.dtype under inductor, one GEMM per gradient
    per chunk) against the eager head on the same GPU: the loss to float32 rounding, the gradients to bf16's."""
    from megatron_lite.bench.loss_precision import HeadSettings, head_inputs
    from megatron_lite.model.loss import chunked_cross_entropy

    hidden, weight, labels = head_inputs(HeadSettings(tokens=1024, hidden=256, vocab=4096, chunk_tokens=300), "cuda")
    torch._dynamo.reset()
    results = []
    for head in (chunked_cross_entropy, torch.compile(chunked_cross_entropy, fullgraph=True)):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = head(h, w, labels, 300)
        loss.backward()
        results.append((loss.detach(), h.grad.float(), w.grad.float()))
    (eager_loss, *eager_grads), (compiled_loss, *compiled_grads) = results
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-5)
    for got, want in zip(compiled_grads, eager_grads):
        assert float((got - want).norm() / want.norm()) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("label", SCHEMES)
def test_cuda_training_step_makes_no_host_sync(label: str) -> None:
    """The meta-device check's claim on a real GPU: torch's sync debug mode raises on any synchronising call."""
    with torch.device("cuda"):
        model = GPT(tiny_config(label).model).to(torch.bfloat16).train()
        batch = torch.randint(0, 250, (2, 33))
    model(batch[:, :-1], labels=batch[:, 1:]).backward()  # warm-up: first-use allocations and cuBLAS handles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(batch[:, :-1], labels=batch[:, 1:]).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_regions_train_as_the_plain_compiled_ones() -> None:
    """gpu_check's ``regional-cudagraphs`` rows: the blocks and the head compiled with inductor's CUDA graphs train
    as the plain regional compile does, step after step (the graphs' output buffers are reused between steps)."""
    from megatron_lite.model.compile import compile_model

    batch = torch.randint(0, 250, (2, 33), generator=torch.Generator().manual_seed(1)).cuda()
    losses: dict[bool, list[float]] = {}
    for cuda_graphs in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = GPT(tiny_config("coca_slack").model).cuda().to(torch.bfloat16).train()
        compile_model(model, "regional", cuda_graphs=cuda_graphs)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses[cuda_graphs] = []
        for _ in range(4):
            torch.compiler.cudagraph_mark_step_begin()
            loss = model(batch[:, :-1], labels=batch[:, 1:])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses[cuda_graphs].append(loss.item())
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_rotation_and_block_mask_match_the_cpu() -> None:
    """The two CUDA-only-in-practice paths written with out= and banded reductions: the bf16 rotation (forward and
    gradient) equals the same code on the CPU to bf16 rounding, and the banded block mask equals torch's own."""
    from torch.nn.attention.flex_attention import create_block_mask

    from megatron_lite.model import flex
    from megatron_lite.model.rope import rotate

    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 40, 4, 3 * 32, generator=generator).to(torch.bfloat16)
    angles = torch.rand(40, 16, generator=generator, dtype=torch.float64) * 6
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    results = []
    for device in ("cpu", "cuda"):
        x = qkv.to(device)[..., :32].transpose(1, 2).detach().requires_grad_()
        y = rotate(x, cos.to(device, torch.bfloat16), sin.to(device, torch.bfloat16))
        y.backward(torch.ones_like(y))
        results.append((y.detach().float().cpu(), x.grad.float().cpu()))
    for cpu_value, cuda_value in zip(*results):
        torch.testing.assert_close(cuda_value, cpu_value, rtol=2**-7, atol=2**-7)
    positions = torch.arange(300, device="cuda")
    ours = flex.build_block_mask(positions, positions)
    theirs = create_block_mask(flex.causal_mask_mod(positions, positions), None, None, 300, 300, device="cuda")
    for mine, torchs in zip(ours.as_tuple(), theirs.as_tuple()):
        if isinstance(mine, torch.Tensor):
            assert torch.equal(mine, torchs)


@pytest.mark.parametrize("mode", ["regional", "whole"])
def test_compiled_graphs_take_the_rotary_tables_as_inputs(mode: str) -> None:
    """No compiled region computes cos/sin: traced inside a whole-model graph, inductor recomputed the float64
    tables in every layer's kernels, per activation element (about 40% of a 350M step on an H200)."""
    from megatron_lite.model.compile import compile_model

    graphs: list[torch.fx.GraphModule] = []

    def recording_backend(graph: torch.fx.GraphModule, example_inputs: list) -> Any:
        graphs.append(graph)
        return graph.forward

    model = GPT(tiny_config("coca_slack").model)
    compile_model(model, mode, backend=recording_backend)  # type: ignore[arg-type]
    torch._dynamo.reset()
    batch = torch.randint(0, 250, (2, 33))
    model(batch[:, :-1], labels=batch[:, 1:]).backward()
    assert graphs
    called = {str(node.target) for graph in graphs for node in graph.graph.nodes if node.op in ("call_function",
                                                                                                "call_method")}
    assert not {name for name in called if "cos" in name or "sin" in name}, sorted(called)


@pytest.mark.parametrize("label", SCHEMES)
def test_qkv_gradient_is_written_once(label: str) -> None:
    """dq, dk and dv reach the fused projection's gradient in one pass (unbind's stack, in its layout): a split's
    backward wrote them (B, H, T, 3D) with ``cat`` and copied that again to (B, T, 3C) with ``clone``."""
    backward = meta_steps(label)[0].phases["backward"].traffic
    assert "stack" in backward and not {"cat", "clone"} & set(backward), dict(backward)


def cuda_graphs_training_worker() -> dict[str, Any]:
    """Three optimizer steps of two micro batches each as training takes them (``StagedEngine``, ``take_step``: bf16
    on CUDA, ZeRO 1, the flat float32 sums, regional compile) with train.cuda_graphs off and on, then a validation
    pass under ``StagedEngine.evaluating`` at another length; per mode the losses, the validation sums, whether
    the engine holds CUDA graphs, and how many graphs inductor skipped (``cudagraph_skips``: launched kernel by
    kernel after all). On CPU (fp32, no CUDA graphs) it checks only that the code runs."""
    from torch._dynamo.utils import counters

    from megatron_lite.training import engine as engine_lib
    from megatron_lite.training.deepspeed_config import resolve_batch_sizes
    from megatron_lite.training.distributed import init_distributed
    from megatron_lite.training.step import local_validation_sums, take_step

    dist_info = init_distributed()
    cuda = dist_info.device.type == "cuda"
    batches = torch.Generator().manual_seed(1)
    steps = [[torch.randint(0, 250, (2, 33), generator=batches).to(dist_info.device) for _ in range(2)]
             for _ in range(3)]
    held_out = [torch.randint(0, 250, (2, 65), generator=batches).to(dist_info.device)]  # twice the length
    results: dict[str, Any] = {}
    for cuda_graphs in (False, True):
        torch._dynamo.reset()
        counters.clear()
        config = config_lib.from_dict({
            "model": config_lib.to_dict(tiny_config("coca_slack"))["model"], "precision": "bf16" if cuda else "fp32",
            "train": {"zero_stage": 1, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                      "compile": True, "cuda_graphs": cuda_graphs, "gradient_clipping": 1.0}})
        torch.manual_seed(0)
        model = engine_lib.new_model(config, dist_info)
        staged = engine_lib.StagedEngine(config, resolve_batch_sizes(config, 1), dist_info, [], model, None)
        losses = []
        for micro in steps:
            outcome = take_step(staged, [{"input_ids": ids[:, :-1], "labels": ids[:, 1:]} for ids in micro],
                                lr=1e-3, inject_nonfinite=False, signalled_here=False, logged=True)
            losses.append(outcome.loss)
        with staged.evaluating():
            validation = local_validation_sums(staged.engine, [{"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
                                                               for ids in held_out], dist_info.device)
        results["on" if cuda_graphs else "off"] = {
            "losses": losses, "validation": list(validation), "cuda_graphs": staged.cuda_graphs,
            "skipped": counters["inductor"]["cudagraph_skips"]}
        staged.engine.destroy()
    torch.distributed.destroy_process_group()
    return results


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_train_as_the_plain_compiled_regions() -> None:
    """train.cuda_graphs in the training loop on a GPU: the same losses step after step as without (the kept loss
    survives the next replay), no region skipped by inductor, and an evaluation at another length beside them."""
    from conftest import run_single_rank_worker

    results = run_single_rank_worker(__file__, "cuda-graphs-training")
    off, on = results["off"], results["on"]
    assert (off["cuda_graphs"], on["cuda_graphs"]) == (False, True)
    assert on["skipped"] == 0, results
    torch.testing.assert_close(on["losses"], off["losses"], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(on["validation"], off["validation"], rtol=1e-2, atol=1e-2)


if __name__ == "__main__" and sys.argv[1:] == ["cuda-graphs-training"]:
    print(json.dumps(cuda_graphs_training_worker()))


def default_graphs_runs(root: Any) -> dict[str, Any]:
    """train.py as a user runs it, bf16 at ZeRO 1 with float32 sums and every compile setting at its default: stopped
    at step 4 by train.exit_interval and resumed to step 8, and an uninterrupted run with train.cuda_graphs=false.
    Returns each run's stdout (both attempts of the first) and per-step losses."""
    from training_helpers import make_corpus, run_train, tiny_train_config, train_losses, write_config

    base = tiny_train_config(make_corpus(root / "corpus"), root / "cache", zero_stage=1, grad_accum_dtype="fp32",
                             save_interval=4, eval_interval=4)
    base["precision"] = "bf16"
    stopped = write_config(root / "stopped.yml", {**base, "train": {**base["train"], "exit_interval": 4}})
    plain = write_config(root / "plain.yml", {**base, "train": {**base["train"], "cuda_graphs": False}})
    first, resumed = run_train(stopped, root / "graphs"), run_train(stopped, root / "graphs")
    reference = run_train(plain, root / "plain")
    return {"stdout": [first.stdout, resumed.stdout, reference.stdout],
            "losses": [train_losses(root / "graphs"), train_losses(root / "plain")]}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_by_default_train_save_and_resume_as_without(tmp_path: Any) -> None:
    """The default train.cuda_graphs (null) on a GPU: a bf16 ZeRO-1 run with float32 sums trains with CUDA graphs,
    saves, resumes with them (graphs recorded anew over the loaded parameters) and ends where a run without them
    does, to bf16 noise."""
    runs = default_graphs_runs(tmp_path)
    first, resumed, reference = runs["stdout"]
    assert "(compiled, CUDA graphs)" in first and "(compiled, CUDA graphs)" in resumed, first
    assert "resumed from" in resumed and "(compiled)," in reference
    graphs, plain = runs["losses"]
    assert sorted(graphs) == sorted(plain) == list(range(1, 9))
    torch.testing.assert_close([graphs[step] for step in range(1, 9)], [plain[step] for step in range(1, 9)],
                               rtol=2e-2, atol=2e-2)
