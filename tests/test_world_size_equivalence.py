"""One run, any number of ranks: the same tiny run (fp32, dropout 0, the same data, global batch 8) trains
the same model on 1 rank (accumulation 8), 2 ranks (4), 4 ranks (2) and 8 ranks (1), at every ZeRO stage.

The test launches this file as a worker once per world size: plain python for 1 rank, the real
``deepspeed --num_gpus N`` launcher (gloo, CPU) for 2, 4 and 8. Each worker calls the training loop's
``run_training`` once per ZeRO stage of its case list, in one process (starting 8 ranks costs more than a
run), with ``train.gradient_accumulation_steps`` left null so the loop derives the accumulation from the
world size. Every run records the global sample indices of each optimizer step
(``train.record_sample_indices``); the test compares each run's per-step losses, gradient norms and sample
sets, its validation loss and its final weights with the 1-rank ZeRO-0 run's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

if __name__ == "__main__":  # the worker: this checkout's package, as train.py's directory gives it to train.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest
import torch

from megatron_lite import config as config_lib
from megatron_lite.training.loop import run_training
from megatron_lite.training.sample_record import read_sample_indices
from training_helpers import REPO, free_port, metrics, step_weights, tiny_train_config

pytestmark = pytest.mark.slow  # four launches of real DeepSpeed ranks (about a minute on 2 cores)

GLOBAL_BATCH = 8  # micro batch 1: accumulation 8 / 4 / 2 / 1 on 1 / 2 / 4 / 8 ranks
STEPS = 5
VALIDATION_SAMPLES = 6  # 3 per rank on 2 ranks; on 4 and 8 the shares are padded to equal length (ValidationShare)
RELATIVE_TOLERANCE = 1e-5
# ZeRO stages each world size runs: every stage at every world size.
CASES: dict[int, tuple[int, ...]] = {1: (0, 1, 2, 3), 2: (0, 1, 2, 3), 4: (0, 1, 2, 3), 8: (0, 1, 2, 3)}
REFERENCE = (1, 0)  # (world size, ZeRO stage)


def case_dir(root: Path, world_size: int, stage: int) -> Path:
    return root / f"ranks{world_size}_zero{stage}"


def equivalence_config(mix: Path, cache: Path, stage: int) -> dict:
    """``tiny_train_config`` with micro batch 1 and a derived accumulation, no dropout (the tiny config has
    none), one validation pass at the end, every step's loss and sample indices recorded."""
    return tiny_train_config(mix, cache, train_iters=STEPS, train_micro_batch_size_per_gpu=1,
                             gradient_accumulation_steps=None, train_batch_size=GLOBAL_BATCH, zero_stage=stage,
                             eval_interval=STEPS, eval_iters=VALIDATION_SAMPLES, save_interval=0,
                             record_sample_indices=True)


# ----------------------------------------------------------------------------------------------
# Worker (plain python for 1 rank, under the deepspeed launcher for more)


def worker(mix: Path, cache: Path, root: Path, stages: list[int]) -> None:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    for stage in stages:
        config = config_lib.from_dict(equivalence_config(mix, cache, stage))
        result = run_training(config, case_dir(root, world_size, stage), resume="none")
        assert result.stopped_by == "completed" and result.steps == STEPS, result


# ----------------------------------------------------------------------------------------------
# Test


@pytest.fixture(scope="module")
def runs(training_corpus, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every case of ``CASES`` trained, one launch per world size (one after the other: the machine has few
    cores); each launch's output must announce its world size's derived batch once per case."""
    if shutil.which("deepspeed") is None:
        pytest.skip("the deepspeed launcher is not on PATH")
    mix, cache = training_corpus
    root = tmp_path_factory.mktemp("world_sizes")
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        environment.pop(name, None)
    script = [str(Path(__file__).resolve()), "--mix", str(mix), "--cache", str(cache), "--root", str(root)]
    for world_size, stages in CASES.items():
        launcher = ([sys.executable] if world_size == 1 else
                    ["deepspeed", "--num_gpus", str(world_size), "--master_port", str(free_port())])
        command = [*launcher, *script, "--stages", ",".join(map(str, stages))]
        done = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        announced = (f"batch {GLOBAL_BATCH} = 1 micro x {GLOBAL_BATCH // world_size} accumulation (derived) x "
                     f"{world_size} rank(s)")
        assert done.stdout.count(announced) == len(stages), f"{announced!r} not once per case:\n{done.stdout[-4000:]}"
    return root


ALL_CASES = [(world, stage) for world, stages in CASES.items() for stage in stages]
COMPARED = [case for case in ALL_CASES if case != REFERENCE]


def case_id(case: tuple[int, int]) -> str:
    return f"ranks{case[0]}-zero{case[1]}"


def test_reference_run_trains_on_distinct_samples(runs: Path) -> None:
    """The yardstick itself: every step logged, loss falling, each step 8 samples and none seen twice."""
    reference = case_dir(runs, *REFERENCE)
    losses = logged(reference, "loss")
    assert sorted(losses) == list(range(1, STEPS + 1)) and losses[STEPS] < losses[1]
    assert list(logged(reference, "val_loss")) == [STEPS]
    indices = read_sample_indices(reference)
    assert sorted(indices) == list(range(1, STEPS + 1))
    assert all(len(set(step)) == GLOBAL_BATCH for step in indices.values())
    assert len({index for step in indices.values() for index in step}) == STEPS * GLOBAL_BATCH


@pytest.mark.parametrize("case", COMPARED, ids=case_id)
def test_same_samples_per_step(runs: Path, case: tuple[int, int]) -> None:
    assert read_sample_indices(case_dir(runs, *case)) == read_sample_indices(case_dir(runs, *REFERENCE))


def logged(run: Path, key: str) -> dict[int, float]:
    """step -> ``key`` of the metrics.jsonl rows that have it."""
    return {row["step"]: row[key] for row in metrics(run) if row.get(key) is not None}


@pytest.mark.parametrize("key", ["loss", "grad_norm", "val_loss"])
@pytest.mark.parametrize("case", COMPARED, ids=case_id)
def test_same_logged_values(runs: Path, case: tuple[int, int], key: str) -> None:
    """Each step's training loss and gradient norm (before clipping: a wrongly scaled gradient that clipping
    would hide) and the final validation loss."""
    expected, got = logged(case_dir(runs, *REFERENCE), key), logged(case_dir(runs, *case), key)
    assert got.keys() == expected.keys() == ({STEPS} if key == "val_loss" else set(range(1, STEPS + 1)))
    for step, value in expected.items():
        assert got[step] == pytest.approx(value, rel=RELATIVE_TOLERANCE, abs=0), f"step {step}: {got} vs {expected}"


@pytest.mark.parametrize("case", COMPARED, ids=case_id)
def test_same_final_weights(runs: Path, case: tuple[int, int]) -> None:
    """The final checkpoints, consolidated from each world size's and stage's partitions, hold the same model."""
    expected, got = step_weights(case_dir(runs, *REFERENCE), STEPS), step_weights(case_dir(runs, *case), STEPS)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=RELATIVE_TOLERANCE, atol=1e-6, msg=name)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--mix", type=Path, required=True)
    parser.add_argument("--cache", type=Path, required=True)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--stages", required=True, help="comma-separated ZeRO stages, run one after the other")
    parser.add_argument("--local_rank", type=int, default=None)  # the deepspeed launcher's
    arguments = parser.parse_args()
    worker(arguments.mix, arguments.cache, arguments.root, [int(stage) for stage in arguments.stages.split(",")])
