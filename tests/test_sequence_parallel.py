"""DeepSpeed-Ulysses sequence parallelism (train.sequence_parallel_size) against the whole sequence on one rank.

One 2-rank launch (``deepspeed --num_gpus 2``, gloo on CPU) runs this file as a worker and loops over the cases:
  * the model: for every position scheme (RoPE scalings, partial rotary, both CoCA constraints), both block
    families (grouped K/V heads that P divides and that it does not), every CPU backend, a document mask and
    activation checkpointing, the P=2 loss and every parameter's gradient (summed over the group, as DeepSpeed
    reduces them) equal the P=1 ones to 1e-5 in fp32;
  * DeepSpeed: at every ZeRO stage, an engine built as training builds it (DeepSpeed's Ulysses mpu, our
    DeepSpeed config) holds the P=1 gradient after backward and the P=1 weights after the step — the traps of
    training/sequence_parallel.py (gradients never summed over P; ZeRO-3's reduce-scatter dividing by dp x P).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_lite.training.distributed import free_port

pytestmark = pytest.mark.slow

TOLERANCE = 1e-5
BATCH, LENGTH = 2, 16

# (name, tiny_config arguments, model overrides)
MODEL_CASES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("none", {"scheme": "none"}, {}),
    ("learned", {"scheme": "learned"}, {}),
    ("sinusoidal", {"scheme": "sinusoidal"}, {}),
    ("alibi", {"scheme": "alibi"}, {}),
    ("rope", {"scheme": "rope"}, {}),
    ("rope partial", {"scheme": "rope"}, {"position.rotary_pct": 0.5}),
    ("rope linear scaling", {"scheme": "rope"}, {"position.scaling": {"type": "linear", "factor": 2.0}}),
    ("rope dynamic NTK", {"scheme": "rope"},  # the base follows the whole length 16, beyond the 8 trained
     {"position.scaling": {"type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8}}),
    ("coca strict yarn", {"scheme": "coca", "constraint": "strict"},
     {"position.scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}}),
    ("rope llama3", {"scheme": "rope"},
     {"position.scaling": {"type": "llama3", "factor": 4.0, "original_max_position_embeddings": 8}}),
    ("coca slack", {"scheme": "coca", "constraint": "slack"}, {}),
    ("coca strict", {"scheme": "coca", "constraint": "strict"}, {}),
    ("coca slack partial", {"scheme": "coca", "constraint": "slack"}, {"position.rotary_pct": 0.5}),
    ("coca slack ntk", {"scheme": "coca", "constraint": "slack"},
     {"position.scaling": {"type": "ntk", "factor": 2.0}}),
    ("coca slack chunked", {"scheme": "coca", "backend": "chunked"}, {"attention.chunk_size": 4}),
    ("alibi chunked", {"scheme": "alibi", "backend": "chunked"}, {"attention.chunk_size": 4}),
    ("coca strict reference", {"scheme": "coca", "constraint": "strict", "backend": "reference"}, {}),
    ("alibi flex", {"scheme": "alibi", "backend": "flex"}, {}),
    ("coca slack flex document mask", {"scheme": "coca", "backend": "flex"},
     {"attention.document_mask": True, "attention.eod_token_id": 3}),
    ("coca slack checkpointed", {"scheme": "coca"}, {"checkpoint_activations": True}),
    ("llama rope gqa 2", {"scheme": "rope"}, {"architecture": "llama", "num_key_value_heads": 2}),
    ("llama coca mqa (K/V repeated)", {"scheme": "coca"}, {"architecture": "llama", "num_key_value_heads": 1}),
    ("llama alibi", {"scheme": "alibi"}, {"architecture": "llama"}),
    ("llama learned", {"scheme": "learned"}, {"architecture": "llama"}),
]
ZERO_STAGES = (0, 1, 2, 3)


# ----------------------------------------------------------------------------------------------
# Worker (runs under the DeepSpeed launcher)


def _batch(vocab: int, eod: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(4, vocab, (BATCH, LENGTH + 1), generator=torch.Generator().manual_seed(5))
    if eod is not None:
        tokens[0, 5] = tokens[1, 9] = tokens[1, 12] = eod  # documents that cross the ranks' slice boundary
    labels = tokens[:, 1:].clone()
    labels[1, -3:] = -100  # padding: the group's token count is not P x a slice's
    return tokens[:, :-1], labels


def _model_case(name: str, arguments: dict[str, Any], overrides: dict[str, Any], group: Any) -> dict[str, Any]:
    from conftest import tiny_config
    from megatron_lite.model import GPT

    config = tiny_config(**arguments, **overrides)
    torch.manual_seed(0)
    reference = GPT(config.model)
    parallel = copy.deepcopy(reference)
    parallel.enable_sequence_parallel(group)
    eod = overrides.get("attention.eod_token_id")
    input_ids, labels = _batch(config.model.vocab_size, eod)
    reference.train(), parallel.train()

    expected = reference(input_ids, labels=labels)
    expected.backward()
    got = parallel(input_ids, labels=labels)
    got.backward()
    worst = abs(float(got) - float(expected))
    for (param_name, ref_param), param in zip(reference.named_parameters(), parallel.parameters()):
        grad = param.grad.clone()
        torch.distributed.all_reduce(grad, group=group)  # what DeepSpeed's reduction over the P ranks adds up
        worst = max(worst, float((grad - ref_param.grad).abs().max()))
    return {"case": name, "max_abs_diff": worst}


def _zero_case(stage: int) -> dict[str, Any]:
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    from conftest import tiny_config
    from megatron_lite import config as config_lib
    from megatron_lite.model import GPT
    from megatron_lite.training.deepspeed_config import BatchSizes, deepspeed_config
    from megatron_lite.training.sequence_parallel import sequence_parallel_mpu

    base = tiny_config("coca", "slack")
    config = config_lib.from_dict({**config_lib.to_dict(base), "train": {"zero_stage": stage, "sequence_parallel_size": 2,
                                                                          "gradient_clipping": 0.0}})
    torch.manual_seed(0)
    reference = GPT(config.model)
    model = copy.deepcopy(reference)
    mpu = sequence_parallel_mpu(2)
    assert mpu is not None
    model.enable_sequence_parallel(mpu.get_sequence_parallel_group())
    lr = 0.1
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr), mpu=mpu,
                                      config=deepspeed_config(config, BatchSizes(BATCH, 1, 1)))
    input_ids, labels = _batch(config.model.vocab_size, None)
    expected = reference(input_ids, labels=labels)
    expected.backward()
    loss = engine(input_ids, labels=labels)
    engine.backward(loss)
    worst_grad = 0.0
    for (name, ref_param), param in zip(reference.named_parameters(), engine.module.parameters()):
        worst_grad = max(worst_grad, float((safe_get_full_grad(param) - ref_param.grad).abs().max()))
    engine.step()
    with torch.no_grad():
        for ref_param in reference.parameters():
            ref_param -= lr * ref_param.grad
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        worst_weight = max(float((param.detach() - ref_param).abs().max())
                           for ref_param, param in zip(reference.parameters(), engine.module.parameters()))
    engine.destroy()
    return {"case": f"zero {stage}", "loss_diff": abs(float(loss) - float(expected)), "max_grad_diff": worst_grad,
            "max_weight_diff": worst_weight}


def worker(out: Path) -> None:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    group = torch.distributed.new_group([0, 1])
    results: dict[str, Any] = {"model": [], "zero": []}
    for name, arguments, overrides in MODEL_CASES:
        results["model"].append(_model_case(name, arguments, overrides, group))
    for stage in ZERO_STAGES:
        results["zero"].append(_zero_case(stage))
    if torch.distributed.get_rank() == 0:
        out.write_text(json.dumps(results, indent=1))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()  # else gloo's threads can abort the exit ("terminate called ...")


# ----------------------------------------------------------------------------------------------
# Test


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if shutil.which("deepspeed") is None:
        pytest.skip("the deepspeed launcher is not on PATH")
    out = tmp_path_factory.mktemp("sequence_parallel") / "results.json"
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        environment.pop(name, None)
    command = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), str(Path(__file__).resolve()),
               "--out", str(out)]
    done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", [name for name, _, _ in MODEL_CASES])
def test_sequence_parallel_loss_and_gradients_equal_the_whole_sequence(results: dict[str, Any], case: str) -> None:
    row = next(row for row in results["model"] if row["case"] == case)
    assert row["max_abs_diff"] <= TOLERANCE, row


@pytest.mark.parametrize("stage", ZERO_STAGES)
def test_every_zero_stage_reduces_sequence_parallel_gradients_over_the_right_group(results: dict[str, Any],
                                                                                   stage: int) -> None:
    row = next(row for row in results["zero"] if row["case"] == f"zero {stage}")
    assert row["loss_diff"] <= TOLERANCE and row["max_grad_diff"] <= TOLERANCE, row
    assert row["max_weight_diff"] <= TOLERANCE, row


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="DeepSpeed worker of tests/test_sequence_parallel.py")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--local_rank", type=int, default=None)  # passed by the deepspeed launcher
    worker(parser.parse_args().out)
