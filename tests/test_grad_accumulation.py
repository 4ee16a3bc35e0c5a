"""Where a bf16 run sums its gradients (``train.grad_accum_dtype``).

DeepSpeed's default sums the micro batches' bf16 gradients in bf16; ``fp32`` (the default here, as Megatron-LM)
makes it sum them in float32 at ZeRO 1-3. Fast: the DeepSpeed keys per stage and the ZeRO-0 notice. Slow: one
subprocess drives real DeepSpeed engines (one CPU rank, bf16, 4 micro batches, SGD with lr 1 so that the update
is the summed gradient itself), saves a checkpoint, reads its float32 master weights back through
``megatron_lite.weights`` (BF16_Optimizer's own format at ZeRO 1) and compares the update with the float64 sum of
the same micro batches' bf16 gradients, computed here on a copy of the model (at ZeRO 1 with the flat sum of
``training/fp32_grad_sums.py`` and, bit for bit the same, with DeepSpeed's hook per tensor); the same process then
runs ``python -m dev.cpu_figures --grad-sums``'s counts for the tiny model (8 bytes per parameter per micro batch, 12
with the hooks). Fast: the flat sum itself on a stand-in of BF16_Optimizer's buffers, and that the engine gets it.
"""

from __future__ import annotations

import gc
import json
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from conftest import run_single_rank_worker
from megatron_lite import config as config_lib
from megatron_lite.training.deepspeed_config import (BatchSizes, bf16_accumulation_notice, bf16_zero0_sync_notice,
                                                     deepspeed_config, resolve_batch_sizes)

TINY_MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 16, "vocab_size": 250,
              "position": {"scheme": "rope"}}
MICRO_BATCHES = 4
# (ZeRO stage, train.grad_accum_dtype) for the engine test; ("model") shows the comparison can fail; "fp32-hooks":
# fp32 through DeepSpeed's hook per tensor (bf16.immediate_grad_update), which the flat sum must equal bit for bit
ENGINE_CASES = [(1, "fp32"), (1, "fp32-hooks"), (2, "fp32"), (3, "fp32"), (1, "model")]


def bf16_config(stage: int, grad_accum_dtype: str = "fp32", **train: object) -> config_lib.Config:
    return config_lib.from_dict({"model": TINY_MODEL, "precision": "bf16", "train": {
        "zero_stage": stage, "grad_accum_dtype": grad_accum_dtype, "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": MICRO_BATCHES, "gradient_clipping": 0.0, **train}})


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp32_sums_map_to_deepspeeds_keys_per_stage(stage: int) -> None:
    config = bf16_config(stage)
    generated = deepspeed_config(config, resolve_batch_sizes(config, 1))
    assert generated["communication_data_type"] == "fp32"
    # DeepSpeed raises NotImplementedError for a float32 accumulator without ZeRO
    assert generated.get("data_types") == (None if stage == 0 else {"grad_accum_dtype": "fp32"})
    # ZeRO 1's BF16_Optimizer sums after backward, where training/fp32_grad_sums.py makes it one add_ per group
    assert generated["bf16"] == {"enabled": True, **({"immediate_grad_update": False} if stage == 1 else {})}
    model_sums = deepspeed_config(bf16_config(stage, "model"), resolve_batch_sizes(config, 1))
    assert "communication_data_type" not in model_sums and "data_types" not in model_sums
    for precision in ("fp32", "fp16"):  # only bf16 runs are touched
        other = config_lib.from_dict({"precision": precision, "train": {"zero_stage": stage}})
        assert "data_types" not in deepspeed_config(other, resolve_batch_sizes(other, 1))


def test_train_deepspeed_keys_win_over_the_generated_ones() -> None:
    config = bf16_config(1, deepspeed={"data_types": {"grad_accum_dtype": "bf16"}})
    assert deepspeed_config(config, resolve_batch_sizes(config, 1))["data_types"] == {"grad_accum_dtype": "bf16"}
    assert bf16_accumulation_notice(bf16_config(0, deepspeed={"data_types": {}}), BatchSizes(2, 4, 1)) is None


def test_zero0_with_accumulation_says_where_the_sums_stay_bf16() -> None:
    notice = bf16_accumulation_notice(bf16_config(0), BatchSizes(2, 4, 1))
    assert notice is not None and "sums the 4 micro batches' gradients in bf16" in notice and "zero_stage=1" in notice
    assert bf16_accumulation_notice(bf16_config(0), BatchSizes(2, 1, 8)) is None  # nothing accumulates
    assert bf16_accumulation_notice(bf16_config(1), BatchSizes(2, 4, 1)) is None
    assert bf16_accumulation_notice(bf16_config(0, "model"), BatchSizes(2, 4, 1)) is None


def test_bf16_at_zero_0_on_a_gpu_names_its_per_tensor_waits() -> None:
    notice = bf16_zero0_sync_notice(bf16_config(0), "cuda")
    assert notice is not None and "train.zero_stage=1" in notice and "\n" not in notice
    assert bf16_zero0_sync_notice(bf16_config(0), "cpu") is None  # nothing waits on a CPU
    assert bf16_zero0_sync_notice(bf16_config(1), "cuda") is None


def test_bad_value_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"train\.grad_accum_dtype="):
        bf16_config(1, "bf16")


def flat_buffers(shapes: list[tuple[int, ...]], padding: int) -> SimpleNamespace:
    """A stand-in of BF16_Optimizer's gradient buffers for one group laid out as DeepSpeed lays them out: bf16
    parameters, a flat float32 buffer with alignment padding after them, per-parameter slices of it."""
    params = [torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16)) for shape in shapes]
    numels = [param.numel() for param in params]
    flat = torch.zeros(sum(numels) + padding)  # (N + padding,)
    offsets = [sum(numels[:index]) for index in range(len(numels))]
    slices = [flat.narrow(0, offset, numel) for offset, numel in zip(offsets, numels)]
    return SimpleNamespace(bf16_groups=[params], fp32_groups_actual_gradients_flat=[flat.narrow(0, 0, sum(numels))],
                           fp32_groups_gradients=[slices], fp32_groups_has_gradients=[[False] * len(params)],
                           autoep_folding_tp_group=None, flat=flat)


@pytest.mark.parametrize("limit", [None, 20], ids=["one_run", "runs"])
def test_the_flat_sum_adds_each_micro_batchs_bf16_gradients_bit_for_bit(limit: int | None) -> None:
    """The flat sum against DeepSpeed's per-tensor cast and add, on CUDA's one run per group and CPU's runs of
    consecutive parameters (here at most 20 elements: the 15-element matrix, then the other two)."""
    from megatron_lite.training import fp32_grad_sums

    optimizer = flat_buffers([(3, 5), (7,), (2, 2, 3)], padding=2)
    params, hp_grads = optimizer.bf16_groups[0], optimizer.fp32_groups_gradients[0]
    fp32_grad_sums.check_layout(optimizer.bf16_groups, optimizer.fp32_groups_gradients,
                                optimizer.fp32_groups_actual_gradients_flat)
    runs = fp32_grad_sums.parameter_runs(params, optimizer.fp32_groups_actual_gradients_flat[0], limit)
    assert [(first, last, run.numel()) for first, last, run in runs] == (
        [(0, 3, 34)] if limit is None else [(0, 1, 15), (1, 3, 19)])
    reference = [torch.zeros(param.numel()) for param in params]
    generator = torch.Generator().manual_seed(0)
    not_deepspeeds = lambda **kwargs: pytest.fail("DeepSpeed's per-tensor update ran")  # noqa: E731
    for micro in range(3):  # wide exponents, so that a sum in another order or precision would differ
        for index, param in enumerate(params):
            param.grad = (torch.randn(param.shape, generator=generator) * 10.0 ** (3 * index - micro)).bfloat16()
            if micro == 1 and index == 1:
                param.grad = None  # unused this micro batch: the per-tensor path for the others
            if param.grad is not None:
                reference[index].add_(param.grad.float().view(-1))  # DeepSpeed's _update_hp_grad: cast, then add
        present = [param.grad is not None for param in params]
        fp32_grad_sums.update_hp_grads(optimizer, [runs], not_deepspeeds)
        assert all(torch.equal(hp_grad, expected) for hp_grad, expected in zip(hp_grads, reference))
        assert all(param.grad is None for param in params)  # released, as the immediate update does
        assert [param._hp_grad is hp_grad for param, hp_grad in zip(params, hp_grads)] == [
            present[index] or micro > 0 for index in range(len(params))]
        assert optimizer.fp32_groups_has_gradients == [[True] * 3 if micro != 1 else present]
        optimizer.fp32_groups_has_gradients = [[False] * 3]  # as DeepSpeed's clear_hp_grads after a step
    assert optimizer.flat[-2:].eq(0).all()  # the alignment padding stays zero
    swapped = [list(reversed(hp_grads))]
    with pytest.raises(RuntimeError, match="consecutive slices"):
        fp32_grad_sums.check_layout(optimizer.bf16_groups, swapped, optimizer.fp32_groups_actual_gradients_flat)


def test_the_engine_gets_the_flat_sum(monkeypatch: pytest.MonkeyPatch) -> None:
    """training/engine.py hands DeepSpeed's optimizer to ``fp32_grad_sums.install`` right after initialize (the
    engines themselves: the slow test, through python -m dev.cpu_figures --grad-sums)."""
    import deepspeed

    from megatron_lite.training import checkpoint_engine, fp32_grad_sums
    from megatron_lite.training import engine as engine_lib
    from megatron_lite.training.distributed import DistributedInfo

    engine = SimpleNamespace(optimizer=object())
    installed: list[object] = []
    monkeypatch.setattr(deepspeed, "initialize", lambda **kwargs: (engine, None, None, None))
    monkeypatch.setattr(checkpoint_engine, "install", lambda *args: None)
    monkeypatch.setattr(fp32_grad_sums, "install", installed.append)
    config = bf16_config(1)
    cpu = DistributedInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    engine_lib.StagedEngine(config, resolve_batch_sizes(config, 1), cpu, [], engine_lib.new_model(config, cpu), None)
    assert installed == [engine.optimizer]


@pytest.mark.slow
def test_the_update_is_the_float32_sum_of_the_micro_batches_at_zero_1_to_3() -> None:
    errors = run_single_rank_worker(__file__, "engines")
    # python -m dev.cpu_figures --grad-sums on the tiny model, in the same process
    sums = {row["mode"]: row for row in errors.pop("grad_sums")}
    assert [sums[mode]["optimizer"] for mode in ("model", "fp32-hooks", "fp32")] == [
        "DeepSpeedZeroOptimizer", "BF16_Optimizer", "BF16_Optimizer"]
    # the bench builds its engines as training does (StagedEngine): the flat sum, unless train.deepspeed asks for hooks
    assert (sums["fp32"]["flat_sums"], sums["fp32-hooks"]["flat_sums"]) == (True, False)
    added = {mode: (sums[mode]["micro_bytes"] - sums["model"]["micro_bytes"]) / sums[mode]["parameters"]
             for mode in ("fp32-hooks", "fp32")}
    # less autograd's bf16 accumulation (2 + 2 read, 2 written), as each micro batch's gradients are fresh: the hooks
    # cast each gradient (2 read, 4 written) and add it into its buffer (4 + 4 read, 4 written): 12; the flat sum
    # concatenates the group's gradients (2 read, 2 written) and adds them into the buffer (4 + 2 read, 4 written): 8
    assert 11 < added["fp32-hooks"] < 13 and 7 < added["fp32"] < 9, added
    # a cast and an add_ per tensor against a concatenation and an add_ per group (2: weight decay or not)
    tensors = sums["fp32"]["tensors"]
    assert sums["fp32-hooks"]["micro_ops"] - sums["fp32"]["micro_ops"] == 2 * tensors - 2 * 2, (sums, tensors)
    assert sums["fp32"]["micro_ops"] < sums["model"]["micro_ops"]  # autograd writes fresh gradients, adds nothing
    assert sums["fp32"]["step_ops"] < sums["model"]["step_ops"]  # no per-tensor overflow checks at the boundary
    # the flat sum at ZeRO 1 with float32 sums only (ZeRO 2-3 keep DeepSpeed's own hooks), without DeepSpeed's hooks
    assert errors.pop("flat_sums") == ["zero1_fp32"] and errors.pop("zero1_fp32_hooks") == 0
    assert errors.pop("zero1_flat_equals_hooks")
    for stage, accumulation in ENGINE_CASES:
        error = errors[f"zero{stage}_{accumulation}"]
        if accumulation != "model":
            # float32 sums of bf16 gradients; what is left is float32 rounding of w0 - w1 (~1e-7 of the weights)
            assert error < 1e-5, (stage, accumulation, error)
        else:
            assert error > 1e-4, (stage, accumulation, error)  # bf16 sums: ~1e-3 here


def engines_worker() -> dict[str, Any]:
    """Per ENGINE_CASES: relative L2 error of DeepSpeed's update (w0 - w1 with SGD at lr 1) against the float64
    sum of the micro batches' bf16 gradients, each of the loss divided by the accumulation steps as DeepSpeed does;
    and under "grad_sums" the rows of ``python -m dev.cpu_figures --grad-sums`` for the tiny model."""
    import deepspeed

    from megatron_lite.training import engine as engine_lib
    from megatron_lite.training import fp32_grad_sums
    from megatron_lite.training.distributed import init_distributed
    from megatron_lite.weights import load_step_state_dict

    dist_info = init_distributed()  # a one-rank world of its own (distributed.single_process_env)
    batches = torch.Generator().manual_seed(1)
    micro = [torch.randint(0, 250, (2, 17), generator=batches) for _ in range(MICRO_BATCHES)]
    errors: dict[str, Any] = {}
    zero1: dict[str, dict[str, torch.Tensor]] = {}
    for stage, accumulation in ENGINE_CASES:
        hooks = {"bf16": {"immediate_grad_update": True}} if accumulation == "fp32-hooks" else {}
        config = bf16_config(stage, accumulation.removesuffix("-hooks"), deepspeed=hooks)
        torch.manual_seed(0)
        model = engine_lib.new_model(config, dist_info)
        reference = engine_lib.new_model(config, dist_info).bfloat16()
        reference.load_state_dict(model.state_dict())
        start = {name: value.detach().bfloat16().double() for name, value in model.state_dict().items()}
        summed = {name: torch.zeros_like(value) for name, value in start.items()}
        for tokens in micro:
            reference.zero_grad(set_to_none=True)
            (reference(tokens[:, :-1], labels=tokens[:, 1:]) / MICRO_BATCHES).backward()
            for name, parameter in reference.named_parameters():
                summed[name] += parameter.grad.double()
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        # BF16_Optimizer's start runs gc.collect() six times (see_memory_usage), each 0.1 s over the objects of the
        # modules DeepSpeed has imported, unless they are frozen out of its reach
        gc.freeze()
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                          config=deepspeed_config(config, resolve_batch_sizes(config, 1)))
        if fp32_grad_sums.install(engine.optimizer):  # as training/engine.py does
            errors.setdefault("flat_sums", []).append(f"zero{stage}_{accumulation}")
            errors["zero1_fp32_hooks"] = len(engine.optimizer._grad_acc_hooks)
        for tokens in micro:  # as training/step.py: DeepSpeed updates at the 4th, the accumulation boundary
            engine.backward(engine(tokens[:, :-1], labels=tokens[:, 1:]))
            engine.step()
        with tempfile.TemporaryDirectory() as saved:
            engine.save_checkpoint(saved, tag="step")
            after = load_step_state_dict(Path(saved) / "step")
        engine.destroy()
        if stage == 1:
            zero1[accumulation] = after
        difference = torch.cat([(start[name] - after[name].double() - summed[name]).flatten() for name in summed])
        errors[f"zero{stage}_{accumulation}"] = (difference.norm() / torch.cat(
            [value.flatten() for value in summed.values()]).norm()).item()
    errors["zero1_flat_equals_hooks"] = all(torch.equal(zero1["fp32"][name], zero1["fp32-hooks"][name])
                                            for name in zero1["fp32"])
    from dev.grad_sums import GradSumsSettings, run_grad_sums

    gc.freeze()
    errors["grad_sums"] = run_grad_sums(GradSumsSettings(config_path="configs/tiny/rope.yml", timed_steps=1),
                                        progress=lambda line: print(line, file=sys.stderr))
    torch.distributed.destroy_process_group()
    return errors


if __name__ == "__main__" and sys.argv[1:] == ["engines"]:
    print(json.dumps(engines_worker()))
