"""The training hot path under torch.compile: every scheme acting in attention on sdpa and flex, with and without
activation checkpointing (the embedding-only schemes on sdpa), compiles as one graph (fullgraph=True: no graph
break, so no host sync decides anything) and gives eager's loss and gradients; a train.compile=true run resumes
eagerly and converts to HF."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from megatron_lite import checkpoint_dirs
from megatron_lite.model import GPT
from megatron_lite.model.flex import flex_available
from training_helpers import run_train, tiny_train_config, train_losses, write_config

SCHEMES = [("none", "slack"), ("learned", "slack"), ("sinusoidal", "slack"), ("alibi", "slack"), ("rope", "slack"),
           ("coca", "slack"), ("coca", "strict")]
BACKENDS = ["sdpa", pytest.param("flex", marks=pytest.mark.skipif(not flex_available(), reason="needs FlexAttention"))]


def loss_and_gradients(model: GPT, forward, ids: torch.Tensor, labels: torch.Tensor):
    model.zero_grad(set_to_none=True)
    loss = forward(ids, labels)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def sample_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 250, (2, 16), generator=generator)  # (B, T)
    return ids, torch.randint(0, 250, (2, 16), generator=generator)


def assert_same_step(model: GPT, compiled, tolerance: float) -> None:
    ids, labels = sample_batch()

    def eager(ids_BT: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
        return model(ids_BT, labels=labels_BT)

    expected = loss_and_gradients(model, eager, ids, labels)
    assert_same_loss_and_gradients(loss_and_gradients(model, compiled(eager), ids, labels), expected, tolerance)


def assert_same_loss_and_gradients(got, expected, tolerance: float) -> None:
    (loss, gradients), (expected_loss, expected_gradients) = got, expected
    torch.testing.assert_close(loss, expected_loss, rtol=tolerance, atol=tolerance)
    assert gradients.keys() == expected_gradients.keys()
    for name in expected_gradients:
        torch.testing.assert_close(gradients[name], expected_gradients[name], rtol=tolerance, atol=tolerance, msg=name)


# The schemes that act inside attention, on every backend with and without checkpointing; the additive ones
# (none, learned, sinusoidal: an embedding before the blocks) on sdpa, plain, once each.
ATTENTION_SCHEMES = [scheme for scheme in SCHEMES if scheme[0] in ("alibi", "rope", "coca")]
EMBEDDING_CASES = [(scheme, constraint, "sdpa", False) for scheme, constraint in SCHEMES
                   if (scheme, constraint) not in ATTENTION_SCHEMES]
ATTENTION_CASES = [(scheme, constraint, backend, checkpointing) for scheme, constraint in ATTENTION_SCHEMES
                   for backend in BACKENDS for checkpointing in (False, True)]


def _with_marks(case: tuple[str, str, object, bool]) -> object:
    """A case whose backend is a pytest.param (flex: skipped without FlexAttention) keeps that mark."""
    scheme, constraint, backend, checkpointing = case
    name, marks = (backend, ()) if isinstance(backend, str) else (backend.values[0], backend.marks)
    label = f"{scheme}_{constraint}" if scheme == "coca" else scheme
    return pytest.param(scheme, constraint, name, checkpointing, marks=marks,
                        id=f"{label}-{name}-{'checkpointed' if checkpointing else 'plain'}")


@pytest.mark.parametrize(("scheme", "constraint", "backend", "checkpointing"),
                         [_with_marks(case) for case in EMBEDDING_CASES + ATTENTION_CASES])
def test_training_forward_compiles_as_one_graph_and_equals_eager(scheme: str, constraint: str, backend: str,
                                                                  checkpointing: bool) -> None:
    torch._dynamo.reset()
    model = GPT(tiny_config(scheme, constraint, backend, checkpoint_activations=checkpointing).model).train()
    assert_same_step(model, lambda fn: torch.compile(fn, fullgraph=True, backend="aot_eager"), 1e-5)


LLAMA_SCHEMES = [("alibi", "slack"), ("rope", "slack"), ("coca", "slack"), ("coca", "strict")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("scheme", "constraint"), LLAMA_SCHEMES, ids=[f"{s}_{c}" if s == "coca" else s for s, c in LLAMA_SCHEMES])
def test_llama_gqa_compiles_as_one_graph_and_equals_eager(scheme: str, constraint: str, backend: str) -> None:
    """The llama family (RMSNorm, SwiGLU, 4 query heads on 2 key/value heads), checkpointed."""
    torch._dynamo.reset()
    model = GPT(tiny_config(scheme, constraint, backend, checkpoint_activations=True, architecture="llama",
                            num_key_value_heads=2, intermediate_size=96).model).train()
    assert_same_step(model, lambda fn: torch.compile(fn, fullgraph=True, backend="aot_eager"), 1e-5)


@pytest.mark.slow
def test_inductor_compiles_coca_slack() -> None:
    """One real (inductor) compile: generated kernels, not only the traced graph."""
    torch._dynamo.reset()
    model = GPT(tiny_config("coca", "slack").model).train()
    assert_same_step(model, lambda fn: torch.compile(fn, fullgraph=True), 1e-5)


@pytest.mark.slow
def test_regional_compile_with_the_cpp_wrapper_launches_from_cpp_and_equals_eager() -> None:
    """train.compile_cpp_wrapper: every region's forward and backward (the block's, the head's) is generated as a
    C++ wrapper (an ``inductor_entry`` function, no Python ``call``), and the step gives eager's loss and
    gradients."""
    from torch._inductor.utils import run_and_get_code

    from megatron_lite.model.compile import compile_model

    torch._dynamo.reset()
    model = GPT(tiny_config("rope").model).train()
    ids, labels = sample_batch()

    def forward(ids_BT: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
        return model(ids_BT, labels=labels_BT)

    expected = loss_and_gradients(model, forward, ids, labels)
    compile_model(model, "regional", cpp_wrapper=True)
    got, codes = run_and_get_code(loss_and_gradients, model, forward, ids, labels)
    assert len(codes) == 4 and all("inductor_entry" in code and "def call(" not in code for code in codes)
    assert_same_loss_and_gradients(got, expected, 1e-5)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_blocks_grouped_into_regions_compile_once_and_equal_eager(checkpointing: bool) -> None:
    """train.compile_blocks_per_region: 4 blocks in groups of 2 are two calls of one compiled graph (plus the
    head's), the step gives eager's loss and gradients, the state-dict keys stay, and a KV-cache forward
    (generation) runs the blocks one by one as before."""
    from megatron_lite.model.compile import compile_model

    torch._dynamo.reset()
    model = GPT(tiny_config("coca", "slack", num_layers=4, checkpoint_activations=checkpointing).model).train()
    keys = list(model.state_dict())
    ids, labels = sample_batch()

    def forward(ids_BT: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
        return model(ids_BT, labels=labels_BT)

    expected = loss_and_gradients(model, forward, ids, labels)
    model.eval()
    cache = model.new_cache(32)
    expected_logits = model(ids[:, :8], cache=cache), model(ids[:, 8:9], cache=cache)
    model.train()
    graphs: list[torch.fx.GraphModule] = []

    def counting_backend(graph: torch.fx.GraphModule, inputs: list[torch.Tensor]):
        graphs.append(graph)
        return torch._dynamo.backends.debugging.aot_eager(graph, inputs)

    compile_model(model, "regional", backend=counting_backend, blocks_per_region=2)
    assert_same_loss_and_gradients(loss_and_gradients(model, forward, ids, labels), expected, 1e-5)
    assert len(graphs) == 2  # the group (called twice) and the head
    assert list(model.state_dict()) == keys
    model.eval()
    cache = model.new_cache(32)
    for got, want in zip((model(ids[:, :8], cache=cache), model(ids[:, 8:9], cache=cache)), expected_logits):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_blocks_grouped_into_regions_are_refused_where_they_cannot_be() -> None:
    from megatron_lite.model.compile import compile_model

    with pytest.raises(ValueError, match="blocks_per_region=3: must divide the 2 layers"):
        compile_model(GPT(tiny_config("rope").model), "regional", backend="eager", blocks_per_region=3)
    with pytest.raises(ValueError, match="blocks_per_region=2: only for compile mode 'regional', not 'whole'"):
        compile_model(GPT(tiny_config("rope").model), "whole", backend="eager", blocks_per_region=2)


def test_compile_in_place_keeps_state_dict_keys() -> None:
    model = GPT(tiny_config("rope").model)
    keys = list(model.state_dict())
    model.compile()
    assert list(model.state_dict()) == keys and not any("_orig_mod" in key for key in keys)


@pytest.mark.slow
def test_compiled_run_resumes_eagerly_and_converts(training_corpus, tmp_path: Path) -> None:
    """train.compile=true for 2 steps (inductor), then the same run resumed with it off to step 4, then the
    checkpoint exported to Hugging Face: the keys never change with compilation."""
    from script_loading import load_script

    mix, cache = training_corpus
    settings = dict(train_iters=4, save_interval=2, eval_interval=0, gradient_accumulation_steps=1)
    config = write_config(tmp_path / "compiled.yml", tiny_train_config(mix, cache, compile=True, **settings))
    first = run_train(config, tmp_path / "run", "--train-iters", "2")
    assert "(compiled)" in first.stdout
    eager = write_config(tmp_path / "eager.yml", tiny_train_config(mix, cache, compile=False, **settings))
    second = run_train(eager, tmp_path / "run")
    assert "resumed from" in second.stdout and "(compiled)" not in second.stdout
    assert sorted(train_losses(tmp_path / "run")) == [1, 2, 3, 4]
    converter = load_script("tools/convert_checkpoint.py")
    assert converter.main([str(tmp_path / "run"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    step = checkpoint_dirs.latest_complete(tmp_path / "run" / checkpoint_dirs.CHECKPOINTS_DIR)
    assert step is not None and step.name == "step_00000004"


@pytest.mark.parametrize(("scheme", "constraint"), ATTENTION_SCHEMES)
def test_regional_graphs_qualify_for_cuda_graphs(scheme: str, constraint: str) -> None:
    """train.cuda_graphs replays each compiled region as a CUDA graph; inductor skips a graph (and the launches stay)
    that mutates an input that is not a parameter or returns an alias of one. Every region of a bf16 training step
    (each block's forward and backward, the fused loss head's) does neither; the device checks (a CUDA device, no
    CPU tensor inside) are the GPU tests' (tests/test_cuda_path.py)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    seen: list[tuple[list[int], int]] = []

    def record(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        metadata = torch._guards.TracingContext.get().fw_metadata
        seen.append((list(metadata.mutated_inp_runtime_indices), metadata.num_outputs_aliased))
        return make_boxed_func(graph.forward)

    torch._dynamo.reset()
    model = GPT(tiny_config(scheme, constraint).model).to(torch.bfloat16).train()
    from megatron_lite.model.compile import compile_model

    compile_model(model, "regional", backend=aot_autograd(fw_compiler=record, bw_compiler=record))
    ids = torch.randint(0, 250, (2, 17), generator=torch.Generator().manual_seed(0))  # (B, T + 1)
    model(ids[:, :-1], labels=ids[:, 1:]).backward()
    assert len(seen) == 4  # the block's forward and backward (compiled once for every block), the head's
    assert seen == [([], 0)] * 4


def test_a_block_group_qualifies_for_cuda_graphs_with_its_parameters_static() -> None:
    """A region of 2 blocks (train.compile_blocks_per_region) neither mutates an input nor returns an alias, and all
    its blocks' parameters are static inputs: CUDA graphs replay them in place (a non-static input is copied into
    the graph's memory at every replay)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from megatron_lite.model.compile import compile_model

    seen: list[tuple[int, list[int], int]] = []

    def record(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]):
        metadata = torch._guards.TracingContext.get().fw_metadata
        seen.append((len(metadata.static_input_indices), list(metadata.mutated_inp_runtime_indices),
                     metadata.num_outputs_aliased))
        return make_boxed_func(graph.forward)

    torch._dynamo.reset()
    model = GPT(tiny_config("coca", "slack", num_layers=4).model).to(torch.bfloat16).train()
    compile_model(model, "regional", backend=aot_autograd(fw_compiler=record, bw_compiler=record), blocks_per_region=2)
    ids = torch.randint(0, 250, (2, 17), generator=torch.Generator().manual_seed(0))  # (B, T + 1)
    model(ids[:, :-1], labels=ids[:, 1:]).backward()
    group_parameters = 2 * sum(1 for _ in model.layers[0].parameters())
    assert seen[0] == (group_parameters, [], 0)  # the group's forward
    assert all(mutated == [] and aliased == 0 for _, mutated, aliased in seen)


def test_inductor_settings_are_flattened_and_checked_against_the_installed_torch() -> None:
    """train.compile_options: nested or dotted names become torch.compile's flat options, added to a mode's own;
    a name the installed inductor does not have, a setting the loop's own keys own, or a non-boolean for a
    boolean stop in one line naming the key."""
    from megatron_lite.model.compile import compile_options, inductor_settings

    nested = {"triton": {"mix_order_reduction": False}, "max_autotune_gemm_backends": "ATEN"}
    assert inductor_settings(nested) == inductor_settings({"triton.mix_order_reduction": False,
                                                           "max_autotune_gemm_backends": "ATEN"}) \
        == {"triton.mix_order_reduction": False, "max_autotune_gemm_backends": "ATEN"}
    assert compile_options(inductor={}) == {} and compile_options(True, inductor={}) == {"mode": "reduce-overhead"}
    graphs = compile_options(True, inductor=nested)["options"]
    assert graphs["triton.cudagraphs"] is True and graphs["triton.mix_order_reduction"] is False
    assert compile_options(cpp_wrapper=True, inductor=nested) == {"options": {
        "triton.mix_order_reduction": False, "max_autotune_gemm_backends": "ATEN", "cpp_wrapper": True}}
    with pytest.raises(ValueError, match=r"^train.compile_options.triton.mix_order_reductio: not an inductor setting "
                                         r"of torch .* \(did you mean triton.mix_order_reduction"):
        inductor_settings({"triton": {"mix_order_reductio": False}})
    with pytest.raises(ValueError, match=r"^train.compile_options.triton.cudagraphs: set train.cuda_graphs instead$"):
        inductor_settings({"triton.cudagraphs": True})
    with pytest.raises(ValueError, match=r"^train.compile_options.cpp_wrapper: set train.compile_cpp_wrapper"):
        inductor_settings({"cpp_wrapper": True})
    with pytest.raises(ValueError, match=r"^train.compile_options.triton.mix_order_reduction='no': must be true or"):
        inductor_settings({"triton": {"mix_order_reduction": "no"}})
