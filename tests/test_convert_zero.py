"""DeepSpeed checkpoints of every ZeRO stage (0-3), written by 1 and 2 ranks, consolidate to the
weights the engines held, and all of them to the same weights.

The test launches this file as a DeepSpeed worker on CPU: once with plain python (1 rank) and once
with the real launcher, ``deepspeed --num_gpus 2`` (2 ranks, gloo). Each worker trains the same tiny
model for two SGD steps on the same global batch under each ZeRO stage, saves a checkpoint in the
run layout of megatron_lite/checkpoint_dirs.py (DeepSpeed tag dir + config.yml + COMPLETE marker), and
saves the live fp32 weights it gathered from the engine next to it for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_lite.training.distributed import free_port

# The worker saves with DeepSpeed directly, not through train.py: its step dirs have no MANIFEST.json.
pytestmark = [pytest.mark.filterwarnings("ignore:.*no MANIFEST.json:UserWarning"), pytest.mark.slow]

STAGES = (0, 1, 2, 3)
STEPS = 2
GLOBAL_BATCH = 4
TAG = "step_00000002"
LIVE_WEIGHTS = "live_weights.safetensors"


def run_dir(root: Path, stage: int, world_size: int) -> Path:
    return root / f"zero{stage}_ranks{world_size}"


# ----------------------------------------------------------------------------------------------
# Worker (runs under the DeepSpeed launcher or plain python)


def gathered_weights(engine: object, stage: int) -> dict[str, torch.Tensor]:
    """Full fp32 weights as the engine holds them; ZeRO-3 gathers its partitions first."""
    import deepspeed

    module = engine.module  # type: ignore[attr-defined]
    if stage < 3:
        return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def worker(root: Path) -> None:
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)  # plain python: no launcher, no MPI discovery
    import deepspeed
    from safetensors.torch import save_file

    from conftest import tiny_config
    from megatron_lite import checkpoint_dirs
    from megatron_lite import config as config_lib
    from megatron_lite.model import GPT, language_model_loss

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    config = tiny_config("coca", "strict")
    micro_batch = GLOBAL_BATCH // world_size

    def train_and_save(engine: Any, target: Path, weights: Callable[[], dict[str, torch.Tensor]]) -> None:
        """STEPS SGD steps on this rank's share of each global batch, then the checkpoint and ``weights()`` (a
        collective under ZeRO-3 and BF16_Optimizer) in the run layout."""
        batches = torch.Generator().manual_seed(1)
        for _ in range(STEPS):
            batch = torch.randint(0, config.model.vocab_size, (GLOBAL_BATCH, 17), generator=batches)
            mine = batch[rank * micro_batch : (rank + 1) * micro_batch]  # this rank's share of one global batch
            engine.backward(language_model_loss(engine(mine[:, :-1]), mine[:, 1:]))
            engine.step()
        engine.save_checkpoint(str(target / checkpoint_dirs.CHECKPOINTS_DIR), tag=TAG)
        live = weights()
        if rank == 0:
            step_dir = target / checkpoint_dirs.CHECKPOINTS_DIR / TAG
            config_lib.save(config, target / checkpoint_dirs.CONFIG_FILE)
            config_lib.save(config, step_dir / checkpoint_dirs.CONFIG_FILE)
            (step_dir / checkpoint_dirs.COMPLETE_MARKER).write_text(json.dumps({"step": STEPS, "world_size": world_size}))
            save_file(live, str(target / LIVE_WEIGHTS))
        torch.distributed.barrier()

    for stage in STAGES:
        torch.manual_seed(0)
        model = GPT(config.model)
        ds_config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
                     "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                                          config=ds_config)
        train_and_save(engine, run_dir(root, stage, world_size), lambda: gathered_weights(engine, stage))
    # bf16 at ZeRO 1 with float32 gradient sums (train.grad_accum_dtype: fp32) is DeepSpeed's BF16_Optimizer, whose
    # files zero_to_fp32 does not read; the reference is its float32 master weights as DeepSpeed hands them out
    torch.manual_seed(0)
    model = GPT(config.model)
    ds_config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
                 "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True, "bf16": {"enabled": True},
                 "data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "fp32"}
    by_size = sorted(model.parameters(), key=torch.Tensor.numel)  # so that 2 ranks' partitions cut a matrix in two
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(by_size, lr=0.5), config=ds_config)
    train_and_save(engine, root / f"bf16_zero1_ranks{world_size}",
                   lambda: {name: deepspeed.utils.safe_get_full_fp32_param(parameter).detach().clone()
                            for name, parameter in engine.module.named_parameters()})
    torch.distributed.destroy_process_group()  # else gloo's threads can abort the exit ("terminate called ...")


# ----------------------------------------------------------------------------------------------
# Test


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("deepspeed") is None:
        pytest.skip("the deepspeed launcher is not on PATH")
    root = tmp_path_factory.mktemp("zero")
    script = str(Path(__file__).resolve())
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        environment.pop(name, None)
    commands = [
        ([sys.executable, script, "--root", str(root)], {"MASTER_PORT": str(free_port())}),
        (["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), script, "--root", str(root)], {}),
    ]
    for command, extra in commands:  # one after the other: the machine has few cores
        done = subprocess.run(command, env={**environment, **extra}, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return root


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("stage", STAGES)
def test_checkpoint_consolidates_to_the_engine_weights(checkpoints: Path, stage: int, world_size: int) -> None:
    from safetensors.torch import load_file

    from megatron_lite.convert import read_checkpoint

    target = run_dir(checkpoints, stage, world_size)
    loaded = read_checkpoint(target)  # run dir -> latest complete step dir -> DeepSpeed's consolidation
    live = load_file(str(target / LIVE_WEIGHTS))
    assert loaded.kind == "step" and loaded.state.keys() == live.keys()
    for name, tensor in live.items():
        assert loaded.state[name].dtype == torch.float32 and torch.equal(loaded.state[name], tensor), name


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_bf16_optimizer_checkpoint_consolidates_to_its_float32_master_weights(checkpoints: Path,
                                                                                world_size: int) -> None:
    """Two ranks cut parameters at their partitions' boundary: the fragments must join in rank order."""
    from safetensors.torch import load_file

    from megatron_lite.checkpoint_integrity import safe_load
    from megatron_lite.convert import read_checkpoint

    target = checkpoints / f"bf16_zero1_ranks{world_size}"
    files = sorted((target / "checkpoints" / TAG).glob("bf16_zero_pp_rank_*_optim_states.pt"))
    assert len(files) == world_size
    held = [set(safe_load(file)["optimizer_state_dict"]["param_slice_mappings"][0]) for file in files]
    assert world_size == 1 or held[0] & held[1], "no parameter is cut between the ranks' partitions"
    loaded = read_checkpoint(target / "checkpoints" / TAG)
    masters = load_file(str(target / LIVE_WEIGHTS))
    assert loaded.state.keys() == read_checkpoint(run_dir(checkpoints, 1, world_size)).state.keys()
    for name, tensor in masters.items():
        assert loaded.state[name].dtype == torch.float32 and torch.equal(loaded.state[name], tensor), name


def test_every_stage_and_world_size_gives_the_same_weights(checkpoints: Path, tmp_path: Path) -> None:
    from megatron_lite.convert import convert_checkpoint, read_checkpoint
    from megatron_lite.model import GPT

    states = {(stage, world): read_checkpoint(run_dir(checkpoints, stage, world)).state for stage in STAGES for world in (1, 2)}
    reference = states[(0, 1)]
    for key, state in states.items():
        for name, tensor in reference.items():
            torch.testing.assert_close(state[name], tensor, rtol=0, atol=1e-6, msg=f"{key} {name}")
    config = read_checkpoint(run_dir(checkpoints, 0, 1)).config
    torch.manual_seed(0)
    initial = GPT(config.model).state_dict()
    assert max((reference[name] - initial[name]).abs().max().item() for name in initial) > 1e-3  # training moved them
    # The step dir of a 2-rank ZeRO-3 run converts straight to Hugging Face.
    step_dir = run_dir(checkpoints, 3, 2) / "checkpoints" / TAG
    result = convert_checkpoint(step_dir, tmp_path / "hf", "hf")
    assert result.source_kind == "step" and (tmp_path / "hf" / "model.safetensors").is_file()


def test_the_cli_names_the_step_it_exported(checkpoints: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from script_loading import load_script

    cli = load_script("tools/convert_checkpoint.py")
    assert cli.main([str(run_dir(checkpoints, 0, 1)), str(tmp_path / "out"), "--to", "safetensors"]) == 0
    assert f"(run dir: its latest complete checkpoint, training step {STEPS}) -> " in capsys.readouterr().out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="DeepSpeed worker of tests/test_convert_zero.py")
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--local_rank", type=int, default=None)  # passed by the deepspeed launcher
    worker(parser.parse_args().root)
