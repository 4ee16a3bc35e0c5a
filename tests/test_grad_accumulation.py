"""Where a bf16 run sums its gradients (``train.grad_accum_dtype``).

DeepSpeed's default sums the micro batches' bf16 gradients in bf16; ``fp32`` (the default here, as Megatron-LM)
makes it sum them in float32 at ZeRO 1-3. Fast: the DeepSpeed keys per stage and the ZeRO-0 notice. Slow: one
subprocess drives real DeepSpeed engines (one CPU rank, bf16, 4 micro batches, SGD with lr 1 so that the update
is the summed gradient itself), saves a checkpoint, reads its float32 master weights back through
``megatron_lite.weights`` (BF16_Optimizer's own format at ZeRO 1) and compares the update with the float64 sum of
the same micro batches' bf16 gradients, computed here on a copy of the model; the same process then runs
``tools/bench_train.py --grad-sums``'s counts for the tiny model (12 bytes per parameter per micro batch).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import run_single_rank_worker
from megatron_lite import config as config_lib
from megatron_lite.training.deepspeed_config import (BatchSizes, bf16_accumulation_notice, deepspeed_config,
                                                     resolve_batch_sizes)

TINY_MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 16, "vocab_size": 250,
              "position": {"scheme": "rope"}}
MICRO_BATCHES = 4
# (ZeRO stage, train.grad_accum_dtype) for the engine test; ("model") shows the comparison can fail
ENGINE_CASES = [(1, "fp32"), (2, "fp32"), (3, "fp32"), (1, "model")]


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
    # ZeRO 1's BF16_Optimizer adds each gradient into float32 as backward produces it
    assert generated["bf16"] == {"enabled": True, **({"immediate_grad_update": True} if stage == 1 else {})}
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


def test_bad_value_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"train\.grad_accum_dtype="):
        bf16_config(1, "bf16")


@pytest.mark.slow
def test_the_update_is_the_float32_sum_of_the_micro_batches_at_zero_1_to_3() -> None:
    errors = run_single_rank_worker(__file__, "engines")
    # tools/bench_train.py --grad-sums on the tiny model, in the same process
    sums = {row["mode"]: row for row in errors.pop("grad_sums")}
    assert (sums["model"]["optimizer"], sums["fp32"]["optimizer"]) == ("DeepSpeedZeroOptimizer", "BF16_Optimizer")
    added = (sums["fp32"]["micro_bytes"] - sums["model"]["micro_bytes"]) / sums["fp32"]["parameters"]
    # each gradient cast to float32 (2 read + 4 written) and added into its buffer (4 + 4 read, 4 written), less
    # autograd's bf16 accumulation (2 + 2 read, 2 written) that the immediate update replaces by a plain write: 12
    assert 11 < added < 13, added
    assert sums["fp32"]["step_ops"] < sums["model"]["step_ops"]  # no per-tensor overflow checks at the boundary
    for stage, accumulation in ENGINE_CASES:
        error = errors[f"zero{stage}_{accumulation}"]
        if accumulation == "fp32":
            # float32 sums of bf16 gradients; what is left is float32 rounding of w0 - w1 (~1e-7 of the weights)
            assert error < 1e-5, (stage, accumulation, error)
        else:
            assert error > 1e-4, (stage, accumulation, error)  # bf16 sums: ~1e-3 here


def engines_worker() -> dict[str, Any]:
    """Per ENGINE_CASES: relative L2 error of DeepSpeed's update (w0 - w1 with SGD at lr 1) against the float64
    sum of the micro batches' bf16 gradients, each of the loss divided by the accumulation steps as DeepSpeed does;
    and under "grad_sums" the rows of ``tools/bench_train.py --grad-sums`` for the tiny model."""
    import deepspeed

    from megatron_lite.training import engine as engine_lib
    from megatron_lite.training.distributed import init_distributed
    from megatron_lite.weights import load_step_state_dict

    dist_info = init_distributed()  # a one-rank world of its own (distributed.single_process_env)
    batches = torch.Generator().manual_seed(1)
    micro = [torch.randint(0, 250, (2, 17), generator=batches) for _ in range(MICRO_BATCHES)]
    errors: dict[str, Any] = {}
    for stage, accumulation in ENGINE_CASES:
        config = bf16_config(stage, accumulation)
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
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                          config=deepspeed_config(config, resolve_batch_sizes(config, 1)))
        for tokens in micro:  # as training/step.py: DeepSpeed updates at the 4th, the accumulation boundary
            engine.backward(engine(tokens[:, :-1], labels=tokens[:, 1:]))
            engine.step()
        with tempfile.TemporaryDirectory() as saved:
            engine.save_checkpoint(saved, tag="step")
            after = load_step_state_dict(Path(saved) / "step")
        engine.destroy()
        difference = torch.cat([(start[name] - after[name].double() - summed[name]).flatten() for name in summed])
        errors[f"zero{stage}_{accumulation}"] = (difference.norm() / torch.cat(
            [value.flatten() for value in summed.values()]).norm()).item()
    from megatron_lite.bench.grad_sums import GradSumsSettings, run_grad_sums

    errors["grad_sums"] = run_grad_sums(GradSumsSettings(config_path="configs/tiny/rope.yml"),
                                        progress=lambda line: print(line, file=sys.stderr))
    torch.distributed.destroy_process_group()
    return errors


if __name__ == "__main__" and sys.argv[1:] == ["engines"]:
    print(json.dumps(engines_worker()))
