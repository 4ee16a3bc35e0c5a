"""The CUDA defaults of a training run, checked on CPU: TF32, regional compile, fused AdamW,
a bound NCCL device, DataLoader workers that are not forked, and the config keys that choose them.

The CUDA side of each (the warnings a GPU run no longer prints, fused AdamW under DeepSpeed's bf16 and ZeRO
wrappers on CUDA tensors) needs a GPU: ``python tests/test_cuda_defaults.py fused-step`` is the worker the
slow test below runs on CPU, and runs as it is on a GPU node.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import sys
import typing
import warnings

import pytest
import torch

from conftest import run_single_rank_worker, tiny_config
from megatron_lite import config as config_lib
from megatron_lite.config import schema
from megatron_lite.model import GPT
from megatron_lite.model.compile import COMPILE_MODES
from megatron_lite.training import engine as engine_lib
from megatron_lite.training.data import WORKER_START_METHOD
from megatron_lite.training.distributed import DistributedInfo
from megatron_lite.training.optim import build_optimizer, set_fused, use_fused_adamw

CPU = DistributedInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
CUDA = torch.device("cuda", 0)


TINY_MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 16, "vocab_size": 250,
              "position": {"scheme": "rope"}}


def with_train(precision: str = "fp32", **train: object) -> config_lib.Config:
    return config_lib.from_dict({"model": TINY_MODEL, "train": train, "precision": precision})


@pytest.mark.parametrize(("key", "value"), [("compile_mode", "layers"), ("loss_gemm", "bf16"), ("tf32", "yes"),
                                            ("fused_optimizer", 1)])
def test_bad_values_name_the_key(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"train\.{key}="):
        with_train(**{key: value})


def test_defaults_and_the_model_modules_agree_on_the_choices() -> None:
    train = config_lib.from_dict({}).train
    assert (train.compile_mode, train.loss_gemm, train.tf32, train.fused_optimizer, train.cuda_graphs) == (
        "regional", "mixed", None, None, None)
    assert typing.get_args(schema.CompileMode) == COMPILE_MODES
    loss_gemms = getattr(__import__("megatron_lite.model.loss", fromlist=["x"]), "LOSS_GEMMS", None)
    if loss_gemms is not None:  # model/loss.py's modes (added beside this change)
        assert typing.get_args(schema.LossGemm) == loss_gemms


@pytest.mark.parametrize(("setting", "on_cuda", "on_cpu"), [(None, True, False), (True, True, True),
                                                           (False, False, False)])
def test_tf32_on_with_cuda_unless_set(setting: bool | None, on_cuda: bool, on_cpu: bool) -> None:
    config = with_train(tf32=setting)
    assert engine_lib.use_tf32(config, CUDA) is on_cuda
    assert engine_lib.use_tf32(config, torch.device("cpu")) is on_cpu


def test_enable_tf32_satisfies_inductor_and_warns_nothing() -> None:
    """Inductor warns unless ``torch.backends.cuda.matmul.fp32_precision == "tf32"`` (compile_fx's
    _warn_tf32_disabled); and the legacy flags keep ``get_float32_matmul_precision`` readable (inductor calls it)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    precision = torch.get_float32_matmul_precision()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            engine_lib.enable_tf32()
            assert torch.backends.cuda.matmul.fp32_precision == "tf32"
            assert torch.get_float32_matmul_precision() == "high"
            assert torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    assert torch.get_float32_matmul_precision() == precision


@pytest.mark.parametrize("mode", COMPILE_MODES)
def test_compile_mode_compiles_each_block_or_the_whole_model(mode: str) -> None:
    """Wrapped in place, compiled lazily: nothing runs inductor here."""
    model = GPT(tiny_config().model)
    assert engine_lib._compile_in_place(model, with_train(compile=True, compile_mode=mode), CPU) == (True, False)
    blocks = [layer._compiled_call_impl is not None for layer in model.layers]
    assert blocks == [mode == "regional"] * len(model.layers)
    assert ("decode" in vars(model)) is (mode == "whole")  # whole: model.decode replaced by its compiled self
    assert (model.lm_head._compiled_call_impl is not None) is (mode == "regional")
    announced = engine_lib.compile_announcement(mode)
    assert announced.startswith(f"compiling the model ({mode}: ") and "\n" not in announced
    assert f"about {engine_lib.COMPILE_FIRST_STEP_SECONDS[mode]} s" in announced
    graphed = engine_lib.compile_announcement(mode, cuda_graphs=True)
    assert "CUDA graphs recorded in the second micro batch" in graphed and "\n" not in graphed
    wrapped = engine_lib.compile_announcement(mode, cpp_wrapper=True)
    assert wrapped.endswith("on a GPU, and more for the C++ wrappers)") and "\n" not in wrapped
    if mode == "regional":  # train.compile_blocks_per_region: what compiles once is a group
        grouped = engine_lib.compile_announcement(mode, blocks_per_region=4)
        assert grouped.startswith("compiling the model (regional: the repeated group of 4 blocks once; ")
        assert grouped.endswith("on a GPU for single blocks, more for groups of 4)")


def test_compile_off_on_cpu_and_at_zero_3() -> None:
    model = GPT(tiny_config().model)
    assert engine_lib._compile_in_place(model, with_train(), CPU) == (False, False)  # null: off on CPU
    with pytest.warns(UserWarning, match="zero_stage=3"):
        assert engine_lib._compile_in_place(model, with_train(compile=True, zero_stage=3, cuda_graphs=True),
                                            CPU) == (False, False)
    assert all(layer._compiled_call_impl is None for layer in model.layers)


def test_cuda_graphs_on_a_cuda_device_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """train.cuda_graphs asks compile_model for CUDA graphs on CUDA; on CPU, or with train.compile=false, it says
    in one line that it cannot and trains without them; so do train.compile_cpp_wrapper and train.compile_options
    without train.compile, which otherwise reach compile_model."""
    asked: list[tuple[bool, bool]] = []
    settings: list[dict] = []
    groups: list[int] = []

    def compile_model(model, mode, cuda_graphs, cpp_wrapper, inductor, blocks_per_region) -> None:
        asked.append((cuda_graphs, cpp_wrapper))
        settings.append(inductor)
        groups.append(blocks_per_region)
    monkeypatch.setattr(engine_lib, "compile_model", compile_model)
    config = with_train(compile=True, cuda_graphs=True)
    cuda_rank = dataclasses.replace(CPU, device=CUDA)
    assert engine_lib._compile_in_place(GPT(tiny_config().model), config, cuda_rank) == (True, True)
    with pytest.warns(UserWarning, match="train.cuda_graphs: CUDA graphs need a CUDA device, this run's is cpu"):
        assert engine_lib._compile_in_place(GPT(tiny_config().model), config, CPU) == (True, False)
    assert engine_lib._compile_in_place(GPT(tiny_config().model), with_train(compile=True),
                                        cuda_rank) == (True, False)  # null: float32 here, so no graphs
    wrapped = with_train(compile=True, compile_cpp_wrapper=True)
    assert engine_lib._compile_in_place(GPT(tiny_config().model), wrapped, CPU) == (True, False)  # any device
    assert asked == [(True, False), (False, False), (False, False), (False, True)]
    tuned = with_train(compile=True, compile_options={"triton": {"mix_order_reduction": False}})
    assert engine_lib._compile_in_place(GPT(tiny_config().model), tuned, cuda_rank) == (True, False)
    assert settings == [{}] * 4 + [{"triton": {"mix_order_reduction": False}}]
    with pytest.warns(UserWarning, match=r"train.compile_options: inductor's settings shape compiled graphs, and this "
                                         r"run trains eagerly \(train.compile=false on cuda\); the setting is ignored"):
        assert engine_lib._compile_in_place(GPT(tiny_config().model), with_train(
            compile=False, compile_options={"max_autotune": True}), cuda_rank) == (False, False)
    with pytest.warns(UserWarning, match=r"train.cuda_graphs: .* trains eagerly \(train.compile=false on cuda\)"):
        assert engine_lib._compile_in_place(GPT(tiny_config().model), with_train(compile=False, cuda_graphs=True),
                                            cuda_rank) == (False, False)
    with pytest.warns(UserWarning, match=r"train.compile_cpp_wrapper: .* trains eagerly \(train.compile=null on cpu\); "
                                         "the setting is ignored"):
        assert engine_lib._compile_in_place(GPT(tiny_config().model), with_train(compile_cpp_wrapper=True),
                                            CPU) == (False, False)
    with pytest.raises(ValueError, match=r"^train.cuda_graphs=true: not with train.sequence_parallel_size=2 "):
        with_train(cuda_graphs=True, sequence_parallel_size=2)
    grouped = with_train(compile=True, compile_blocks_per_region=2)
    assert engine_lib._compile_in_place(GPT(tiny_config().model), grouped, CPU) == (True, False)
    assert groups == [1] * 5 + [2]
    with pytest.warns(UserWarning, match=r"train.compile_blocks_per_region: block groups are the regions of compiled "
                                         r"graphs, and this run trains eagerly \(train.compile=null on cpu\)"):
        assert engine_lib._compile_in_place(GPT(tiny_config().model), with_train(compile_blocks_per_region=2),
                                            CPU) == (False, False)


@pytest.mark.parametrize(("train", "message"), [
    ({"compile_blocks_per_region": 3},
     "train.compile_blocks_per_region=3: must be a positive divisor of model.num_layers=2"),
    ({"compile_blocks_per_region": 0},
     "train.compile_blocks_per_region=0: must be a positive divisor of model.num_layers=2"),
    ({"compile_blocks_per_region": 2, "compile_mode": "whole"},
     "train.compile_blocks_per_region=2: groups regionally compiled blocks, not with train.compile_mode=whole"),
])
def test_block_groups_that_cannot_be_are_refused_in_one_line(train: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        with_train(**train)


def test_cuda_graphs_by_default_where_the_measured_setup_holds() -> None:
    """train.cuda_graphs=null: graphs for a regional compile on CUDA in bf16 with ZeRO 1's flat float32 sums (the
    paper config, Run 4's 43.5% MFU); off on CPU and wherever one of those does not hold; an explicit true or false is
    kept (true on CPU is off, with its notice elsewhere)."""
    paper = {"zero_stage": 1, "grad_accum_dtype": "fp32"}

    def graphs(device: torch.device = CUDA, precision: str = "bf16", model: dict | None = None,
               **train: object) -> bool:
        config = config_lib.from_dict({"model": {**TINY_MODEL, **(model or {})}, "train": {**paper, **train},
                                       "precision": precision})
        return engine_lib.use_cuda_graphs(config, device)

    assert graphs() and engine_lib.flat_sums_expected(config_lib.from_dict({"train": paper, "precision": "bf16"}))
    assert not graphs(device=torch.device("cpu"))
    for off in [{"precision": "fp16"}, {"zero_stage": 2}, {"zero_stage": 0}, {"grad_accum_dtype": "model"},
                {"compile_mode": "whole"}, {"compile_cpp_wrapper": True}, {"sequence_parallel_size": 2},
                {"model": {"checkpoint_activations": True}}, {"deepspeed": {"bf16": {"immediate_grad_update": True}}}]:
        assert not graphs(**off), off
    assert not graphs(cuda_graphs=False) and graphs(cuda_graphs=True, zero_stage=2)  # kept; the engine checks it
    assert not graphs(device=torch.device("cpu"), cuda_graphs=True)


def test_cuda_graphs_with_accumulation_only_where_each_micro_batchs_gradients_leave_the_graphs() -> None:
    assert engine_lib.cuda_graphs_problem(True, 16, flat_sums=True) is None  # the paper config: bf16, ZeRO 1, fp32 sums
    assert engine_lib.cuda_graphs_problem(True, 1, flat_sums=False) is None
    assert engine_lib.cuda_graphs_problem(False, 16, flat_sums=False) is None
    problem = engine_lib.cuda_graphs_problem(True, 16, flat_sums=False)
    assert problem is not None and problem.startswith("train.cuda_graphs=true with 16 micro batches per step: ")
    assert "train.grad_accum_dtype=fp32" in problem and "\n" not in problem


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_evaluations_run_eagerly_beside_cuda_graphs(cuda_graphs: bool) -> None:
    """An evaluation's forwards (other lengths, no grad) neither recompile nor record graphs beside the training
    ones when those are CUDA graphs: under ``StagedEngine.evaluating`` compiled code runs as its eager self."""
    graphs: list[torch.fx.GraphModule] = []

    def recording_backend(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> typing.Callable:
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()
    double = torch.compile(lambda x: x * 2, backend=recording_backend)
    staged = typing.cast(engine_lib.StagedEngine, type("Staged", (), {"cuda_graphs": cuda_graphs})())
    with engine_lib.StagedEngine.evaluating(staged):
        assert torch.equal(double(torch.ones(3)), torch.full((3,), 2.0))
    assert len(graphs) == (0 if cuda_graphs else 1)


def test_fused_adamw_by_default_on_cuda_only() -> None:
    model = GPT(tiny_config().model)
    parameters = list(model.parameters())
    assert not use_fused_adamw(parameters, None)  # CPU: unfused
    assert not use_fused_adamw(parameters, False)
    assert use_fused_adamw(parameters, True)  # torch fuses on CPU too, when asked
    with pytest.raises(ValueError, match=r"train\.fused_optimizer=true: .* torch\.int64"):
        use_fused_adamw([torch.zeros(2, dtype=torch.int64)], True)
    default = build_optimizer(model, with_train().train)
    assert not default.fused_wanted and default.param_groups[0]["fused"] is None
    assert "fused" not in default.groups_summary
    fused = build_optimizer(model, with_train(fused_optimizer=True).train)
    assert fused.fused_wanted and fused.param_groups[0]["fused"] and fused.groups_summary.endswith("; fused AdamW")


def test_fused_flag_survives_a_state_load_from_an_unfused_run() -> None:
    """A load takes the checkpoint's ``fused``; ``set_fused`` puts the run's back, with the Adam step counters
    where that path keeps them, and the next update matches an unfused one."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8)
    reference = build_optimizer(layer, with_train(lr=0.1).train)
    layer(torch.randn(4, 8)).square().sum().backward()
    reference.step()
    state = copy.deepcopy(reference.state_dict())  # its tensors would be shared with the reference's otherwise
    resumed = build_optimizer(layer, with_train(lr=0.1, fused_optimizer=True).train)
    resumed.load_state_dict(state)
    assert resumed.param_groups[0]["fused"] is None  # the checkpoint's flag
    set_fused(resumed, resumed.fused_wanted)
    assert resumed.param_groups[0]["fused"] is True
    assert all(s["step"].dtype == torch.float32 and s["step"].device == p.device
               for p, s in resumed.state.items())
    before = [p.detach().clone() for p in layer.parameters()]
    resumed.step()
    after_fused = [p.detach().clone() for p in layer.parameters()]
    with torch.no_grad():
        for parameter, value in zip(layer.parameters(), before):
            parameter.copy_(value)
    reference.step()
    for parameter, expected in zip(layer.parameters(), after_fused):
        torch.testing.assert_close(parameter.detach(), expected)


def test_dataloader_workers_are_spawned_not_forked_and_pin_for_cuda(training_corpus) -> None:
    """The run's training loader starts its workers fresh (no fork of a threaded process) and keeps a step's
    micro batches prepared; the validation loader has no workers; a CUDA run's loaders pin their batches."""
    from megatron_lite.training.data import prepare_training_data
    from megatron_lite.training.deepspeed_config import resolve_batch_sizes
    from training_helpers import tiny_train_config

    mix, cache = training_corpus
    config = config_lib.from_dict(tiny_train_config(mix, cache, num_workers=1, gradient_accumulation_steps=5,
                                                    train_iters=2))
    batch = resolve_batch_sizes(config, 1)
    data = prepare_training_data(config, batch, CPU, train_iters=None)
    train_loader, valid_loader = data.loaders(config, batch, CPU, consumed_samples=0)
    assert train_loader.num_workers == 1
    assert train_loader.prefetch_factor == 5  # a step's micro batches ahead (the DataLoader's default: 2)
    assert train_loader.multiprocessing_context.get_start_method() == WORKER_START_METHOD == "spawn"
    assert valid_loader is not None and valid_loader.num_workers == 0
    assert not train_loader.pin_memory and not valid_loader.pin_memory  # no page-locked memory without a GPU
    # for a CUDA rank (the loaders are only built, not iterated: no GPU needed) batches come page-locked, so
    # train_step's non_blocking copies do not wait for the GPU
    cuda_rank = dataclasses.replace(CPU, device=torch.device("cuda", 0))
    train_loader, valid_loader = data.loaders(config, batch, cuda_rank, consumed_samples=0)
    assert train_loader.pin_memory and valid_loader is not None and valid_loader.pin_memory


# ----------------------------------------------------------------------------------------------
# fused AdamW under DeepSpeed's wrappers: a one-rank worker (CPU here; the same script on a GPU node)


FUSED_CASES = [("bf16", 0), ("bf16", 1), ("bf16", 2), ("fp32", 0)]


def fused_step_worker() -> dict[str, object]:
    """Three steps of a tiny model through ``deepspeed.initialize`` with the run's optimizer, unfused and fused
    (null on CUDA, true on CPU), per (precision, ZeRO stage): the fused run's weights against the unfused run's."""
    from megatron_lite.training.distributed import barrier, free_port, init_distributed

    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist_info = init_distributed()
    barrier()
    import deepspeed

    from megatron_lite.model import language_model_loss
    from megatron_lite.training.deepspeed_config import deepspeed_config, resolve_batch_sizes

    from deepspeed.accelerator import get_accelerator

    cuda = dist_info.device.type == "cuda"
    results: dict[str, object] = {"device": str(dist_info.device)}
    accelerator, syncs_in_steps = get_accelerator(), {"counting": False, "calls": 0}
    synchronize = accelerator.synchronize

    def counted_synchronize(*args: object, **kwargs: object) -> object:
        syncs_in_steps["calls"] += syncs_in_steps["counting"]  # the training steps', not start-up's or destroy's
        return synchronize(*args, **kwargs)

    accelerator.synchronize = counted_synchronize  # type: ignore[method-assign]
    moved = 0
    for precision, stage in FUSED_CASES:
        weights = {}
        for fused in (False, True):
            settings = {"zero_stage": stage, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                        "lr": 1e-2, "fused_optimizer": (None if cuda else True) if fused else False}
            config = with_train(precision, **settings)
            torch.manual_seed(0)
            model = engine_lib.new_model(config, dist_info)
            optimizer = build_optimizer(model, config.train)
            assert optimizer.fused_wanted is fused
            engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                              config=deepspeed_config(config, resolve_batch_sizes(config, 1)))
            batches = torch.Generator().manual_seed(1)
            storage = {name: value.data_ptr() for name, value in engine.module.named_parameters()}
            syncs_in_steps["counting"] = True
            for _ in range(3):
                tokens = torch.randint(0, 250, (2, 17), generator=batches).to(dist_info.device)
                engine.backward(language_model_loss(engine(tokens[:, :-1]), tokens[:, 1:]))
                engine.step()
            syncs_in_steps["counting"] = False
            moved += sum(value.data_ptr() != storage[name] for name, value in engine.module.named_parameters())
            assert all(bool(group["fused"]) is fused for group in optimizer.param_groups)
            weights[fused] = {name: value.detach().float().cpu() for name, value in engine.module.state_dict().items()}
            engine.destroy()
        error = max((weights[True][name] - weights[False][name]).abs().max().item() for name in weights[False])
        results[f"{precision}_zero{stage}"] = error
    results["device_syncs"], results["moved_parameters"] = syncs_in_steps["calls"], moved
    barrier()
    torch.distributed.destroy_process_group()
    return results


@pytest.mark.slow
def test_fused_adamw_runs_under_deepspeeds_bf16_and_zero_wrappers() -> None:
    """One rank, every wrapper the project uses at ZeRO 0-2 (bf16: BF16_Optimizer, ZeRO 1/2: the ZeRO optimizer;
    fp32 ZeRO 0: the client optimizer as is): the fused update equals the unfused one. And no step synchronises
    the device: DeepSpeed's throughput timer, on by default, did twice per micro batch from the third step on
    (two ``cudaDeviceSynchronize`` per micro batch in the users' command on the H200, 2026-11-27). Nor does any
    wrapper move a parameter's storage (train.cuda_graphs replays graphs that read the parameters where they were)."""
    results = run_single_rank_worker(__file__, "fused-step", PYTHONWARNINGS="default")
    assert results.pop("device_syncs") == 0
    # CUDA graph trees take the parameters as static inputs: one that moved would re-record every graph each step
    assert results.pop("moved_parameters") == 0
    for case, error in results.items():
        if case != "device":
            # fp32: the fused kernel's rounding, grown over 3 steps (1.5e-5 on CPU, 8e-6 on an H200); bf16: the
            # module's bf16 weights, an ulp or two apart (0.013 on an H200)
            assert error < (1e-4 if case.startswith("fp32") else 2e-2), (case, error)


if __name__ == "__main__" and sys.argv[1:] == ["fused-step"]:
    print(json.dumps(fused_step_worker()))


class _ReusedOutputEngine:
    """A stand-in for a DeepSpeed engine whose model replays CUDA graphs: every forward writes its loss into one
    output buffer, as a graph replay does, so a loss kept without a copy reads the last micro batch's value."""

    def __init__(self, values: list[float]) -> None:
        self.buffer, self.values, self.calls = torch.zeros(()), iter(values), 0

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.buffer.fill_(next(self.values))
        return self.buffer

    def backward(self, loss: torch.Tensor) -> None:
        self.calls += 1

    def step(self) -> None:
        pass


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_each_micro_batch_starts_a_graph_step_and_its_loss_outlives_the_next_replay(
        cuda_graphs: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """training/step.py's contract with CUDA graph trees: a new graph step before each micro batch's forward, and
    the kept loss copied out of the graphs' output buffer (without graphs neither: the losses are fresh tensors)."""
    from megatron_lite.training.step import train_step

    marks: list[int] = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    engine = _ReusedOutputEngine([1.0, 2.0, 3.0])
    batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "labels": torch.zeros(1, 4, dtype=torch.long)}
    summed = train_step(engine, [batch] * 3, torch.device("cpu"), cuda_graphs=cuda_graphs)
    assert engine.calls == 3 and len(marks) == (3 if cuda_graphs else 0)
    # the stand-in reuses its buffer either way: uncopied, every kept loss reads the last value (3 + 3 + 3); a model
    # without graphs returns a new tensor each micro batch, so there the copy is not needed
    assert float(summed) == (6.0 if cuda_graphs else 9.0)
