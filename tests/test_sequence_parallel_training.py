"""train.py with train.sequence_parallel_size: real runs under the deepspeed launcher (gloo on CPU).

  * P=2 x data-parallel 2 on 4 ranks trains as data-parallel 2 on 2 ranks does: the same samples each step,
    the same losses, validation losses and weights to 1e-5;
  * an exact resume at the same P is bitwise the run that never stopped;
  * resuming at another P (ZeRO 1): the P=2 checkpoint at P=1 (4 ranks -> 2, through the universal checkpoint)
    and the P=1 checkpoint at P=2 (2 ranks, one data-parallel rank, so 4 micro batches of accumulation keep the
    global batch) continue the same trace;
  * KV-cache generation from the P=2-trained checkpoint equals the P=1-trained one's;
  * the in-training extrapolation evaluation (train.extrapolation_eval) logs the same perplexities at P=2.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_lite import checkpoint_dirs
from megatron_lite.eval.generation import generate
from megatron_lite.training.sample_record import read_sample_indices
from megatron_lite.weights import load_model, load_step_state_dict
from test_extrapolation_eval import curve_settings, write_books
from training_helpers import metrics, run_train, tiny_train_config, train_losses, write_config

pytestmark = pytest.mark.slow

TOLERANCE = 1e-5
SEQUENCE_PARALLEL_2 = ("--set", "train.sequence_parallel_size=2")


def run_config(mix: Path, cache: Path) -> dict[str, Any]:
    """8 steps of 16 samples (accumulation derived from the data-parallel ranks), saves at 4 and 8; ZeRO 1, so
    the 4-rank P=2 checkpoint resumed on 2 ranks goes through DeepSpeed's universal checkpoint."""
    return tiny_train_config(mix, cache, train_batch_size=16, gradient_accumulation_steps=None,
                             record_sample_indices=True, eval_interval=4, zero_stage=1)


def val_losses(run_dir: Path) -> dict[int, float]:
    return {row["step"]: row["val_loss"] for row in metrics(run_dir) if row.get("val_loss") is not None}


def resumable_copy(run_dir: Path, target: Path, step: int) -> Path:
    """``run_dir`` as a run stopped after its checkpoint at ``step`` leaves it (later checkpoints gone)."""
    shutil.copytree(run_dir, target)
    checkpoints = target / checkpoint_dirs.CHECKPOINTS_DIR
    for step_dir in checkpoints.iterdir():
        if step_dir.is_dir() and (checkpoint_dirs.tag_step(step_dir.name) or 0) > step:
            shutil.rmtree(step_dir)
    (checkpoints / checkpoint_dirs.LATEST_FILE).write_text(checkpoint_dirs.step_tag(step) + "\n")
    return target


def assert_close_trace(got: dict[int, float], expected: dict[int, float]) -> None:
    assert got.keys() == expected.keys()
    worst = max(abs(got[step] - expected[step]) for step in expected)
    assert worst <= TOLERANCE, (worst, got, expected)


@pytest.fixture(scope="module")
def runs(training_corpus, tmp_path_factory) -> dict[str, Path]:
    mix, cache = training_corpus
    root = tmp_path_factory.mktemp("sequence_parallel_runs")
    config = write_config(root / "config.yml", run_config(mix, cache))
    found = {"dp2": root / "dp2", "sp2_dp2": root / "sp2_dp2"}
    curve = [arg for key, value in curve_settings(write_books(root / "books")).items()
             for arg in ("--set", f"train.extrapolation_eval.{key}={json.dumps(value)}")]
    run_train(config, found["dp2"], *curve, ranks=2)
    run_train(config, found["sp2_dp2"], *SEQUENCE_PARALLEL_2, *curve, ranks=4)
    found["resumed_same_p"] = resumable_copy(found["sp2_dp2"], root / "resumed_same_p", 4)
    run_train(config, found["resumed_same_p"], *SEQUENCE_PARALLEL_2, ranks=4)
    found["p2_to_p1"] = resumable_copy(found["sp2_dp2"], root / "p2_to_p1", 4)
    run_train(config, found["p2_to_p1"], ranks=2)
    found["p1_to_p2"] = resumable_copy(found["dp2"], root / "p1_to_p2", 4)
    run_train(config, found["p1_to_p2"], *SEQUENCE_PARALLEL_2, ranks=2)
    return found


def test_sequence_parallel_trains_as_data_parallel(runs: dict[str, Path]) -> None:
    dp2, sp = runs["dp2"], runs["sp2_dp2"]
    assert sorted(train_losses(sp)) == list(range(1, 9))
    assert_close_trace(train_losses(sp), train_losses(dp2))
    assert_close_trace(val_losses(sp), val_losses(dp2))
    assert read_sample_indices(sp) == read_sample_indices(dp2)  # each group trained on one rank's samples
    final = checkpoint_dirs.step_tag(8)
    expected = load_step_state_dict(dp2 / checkpoint_dirs.CHECKPOINTS_DIR / final)
    got = load_step_state_dict(sp / checkpoint_dirs.CHECKPOINTS_DIR / final)
    assert max(float((got[name] - tensor).abs().max()) for name, tensor in expected.items()) <= TOLERANCE
    marker = checkpoint_dirs.read_complete_marker(sp / checkpoint_dirs.CHECKPOINTS_DIR / final)
    assert marker["sequence_parallel_size"] == 2 and marker["world_size"] == 4


def test_exact_resume_at_the_same_sequence_parallel_size_is_bitwise(runs: dict[str, Path]) -> None:
    resumed, straight = runs["resumed_same_p"], runs["sp2_dp2"]
    assert train_losses(resumed) == train_losses(straight)
    final = checkpoint_dirs.CHECKPOINTS_DIR + "/" + checkpoint_dirs.step_tag(8)
    got, expected = load_step_state_dict(resumed / final), load_step_state_dict(straight / final)
    assert [name for name in expected if not torch.equal(got[name], expected[name])] == []


@pytest.mark.parametrize("resumed, reference", [("p2_to_p1", "dp2"), ("p1_to_p2", "dp2")])
def test_resume_at_another_sequence_parallel_size_continues_the_trace(runs: dict[str, Path], resumed: str,
                                                                      reference: str) -> None:
    assert_close_trace(train_losses(runs[resumed]), train_losses(runs[reference]))
    assert read_sample_indices(runs[resumed]) == read_sample_indices(runs[reference])
    converted = (runs[resumed] / checkpoint_dirs.CHECKPOINTS_DIR / checkpoint_dirs.step_tag(4) / "universal").is_dir()
    assert converted == (resumed == "p2_to_p1")  # 4 ranks -> 2: universal; 2 ranks -> 2: loaded as saved


def test_generation_from_a_sequence_parallel_checkpoint(runs: dict[str, Path]) -> None:
    final = checkpoint_dirs.CHECKPOINTS_DIR + "/" + checkpoint_dirs.step_tag(8)
    parallel, plain = load_model(runs["sp2_dp2"] / final).model, load_model(runs["dp2"] / final).model
    prompt = torch.tensor([[5, 17, 42, 9, 100, 7]])
    tokens = generate(parallel, prompt, max_new_tokens=10)
    assert torch.equal(tokens, generate(plain, prompt, max_new_tokens=10))
    with torch.no_grad():  # the cached decode is the plain forward of what it generated
        assert torch.equal(parallel(tokens[:, :-1]).argmax(-1)[:, prompt.shape[1] - 1:], tokens[:, prompt.shape[1]:])


def test_extrapolation_curve_is_the_same_under_sequence_parallelism(runs: dict[str, Path]) -> None:
    def curve(run: Path) -> dict[int, dict[str, float]]:
        return {row["step"]: {key: value for key, value in row.items() if key.startswith("extrapolation_ppl_")}
                for row in metrics(run) if "extrapolation_ppl_x1" in row}

    plain, parallel = curve(runs["dp2"]), curve(runs["sp2_dp2"])
    assert sorted(plain) == [0, 4, 8] and len(plain[8]) == 6  # windows 1x, 2x, 4x; own scaling and dynamic:2
    for step, row in plain.items():
        assert row.keys() == parallel[step].keys()
        assert max(abs(parallel[step][key] / value - 1) for key, value in row.items()) <= TOLERANCE, step
