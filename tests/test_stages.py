"""Staged fine-tuning (train.stages) end to end with the real train.py and DeepSpeed on CPU: the paper's
three stages (K slot -> QKV -> all) leave every frozen tensor and row bitwise unchanged, hold optimizer
state for the trainable elements only (ZeRO 0, 1 and 3), log the trainable counts, and resume bitwise
after a SIGKILL inside stage 2, from a checkpoint inside a slot stage and from one at a stage boundary.

ZeRO 1 and 3 cover the partitioned optimizers: 1 keeps no copy of frozen tensors in its consolidation (2
keeps them as 3 does), 3 partitions them and saves the fused QKV's state_dict as placeholders. A model
family is one ``Family`` entry (its model keys, its three stages and what each trains, written
out independently of megatron_lite/training/stages.py); add one to ``FAMILIES`` to run every test on it.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_lite import checkpoint_dirs
from megatron_lite import config as config_lib
from megatron_lite.model import GPT
from megatron_lite.model.qkv_slots import SlotQKV, join_qkv_slots
from training_helpers import (
    metrics, optimizer_elements, run_train, step_weights, tiny_train_config, train_losses, write_config,
)

STAGE_ENDS = (3, 6, 8)  # stages of 3, 3 and 2 steps


@dataclass(frozen=True)
class Family:
    name: str
    model: dict[str, Any]  # model.* keys over tiny_train_config's
    stages: list[dict[str, Any]]  # train.stages
    # (parameter name, shape, model config, stage index) -> bool mask of the elements that stage trains
    trains: Callable[[str, torch.Size, Any, int], torch.Tensor] = field(repr=False)


def _neox_trains(name: str, shape: torch.Size, model: Any, stage: int) -> torch.Tensor:
    """Stage 0: the K slot (CoCA's T) of every fused QKV -- rows h*3D + D .. h*3D + 2D of each head h --
    and the same bias entries; stage 1: the whole QKV weights and biases; stage 2: everything."""
    if stage == 2:
        return torch.ones(shape, dtype=torch.bool)
    if "query_key_value" not in name:
        return torch.zeros(shape, dtype=torch.bool)
    if stage == 1:
        return torch.ones(shape, dtype=torch.bool)
    rows = torch.zeros(model.num_attention_heads, 3, model.head_dim, dtype=torch.bool)  # (H, 3, D)
    rows[:, 1] = True
    rows = rows.reshape(-1)  # (3 * H * D,)
    return rows[:, None].expand(shape) if len(shape) == 2 else rows


GPT_NEOX = Family(
    "gpt_neox_coca_slack", {"position": {"scheme": "coca", "constraint": "slack"}},
    [{"steps": 3, "trainable": ["layers.*.attention.query_key_value[1]"]},
     {"steps": 3, "trainable": ["layers.*.attention.query_key_value.*"], "lr": 2.0e-3},
     {"steps": 2, "trainable": ["*"]}],
    _neox_trains)
FAMILIES = [GPT_NEOX]


def staged_config(family: Family, mix: Path, cache: Path, **train: Any) -> dict[str, Any]:
    data = tiny_train_config(mix, cache, **{"train_iters": None, "save_interval": 4, "eval_interval": 0,
                                            "stages": family.stages, **train})
    data["model"].update(family.model)
    return data


def initial_weights(run: Path) -> dict[str, torch.Tensor]:
    """What train.py starts from: the model built right after torch.manual_seed(config.seed)."""
    config = config_lib.load(run / checkpoint_dirs.CONFIG_FILE)
    torch.manual_seed(config.seed)
    return {name: tensor.clone() for name, tensor in GPT(config.model).state_dict().items()}


def masks(run: Path, family: Family, stage: int) -> dict[str, torch.Tensor]:
    config = config_lib.load(run / checkpoint_dirs.CONFIG_FILE)
    return {name: family.trains(name, tensor.shape, config.model, stage)
            for name, tensor in initial_weights(run).items()}


def trainable_count(run: Path, family: Family, stage: int) -> int:
    return sum(int(mask.sum()) for mask in masks(run, family, stage).values())


@pytest.fixture(scope="module", params=FAMILIES, ids=[family.name for family in FAMILIES])
def family(request: pytest.FixtureRequest) -> Family:
    return request.param


class StagedRuns:
    """ZeRO stage -> (run dir, stdout) of an uninterrupted 3-stage run (checkpoints at 3, 4, 6, 8), each
    trained once, when a test first asks for it."""

    def __init__(self, family: Family, corpus: tuple[Path, Path], root: Path) -> None:
        self.family, self.corpus, self.root = family, corpus, root
        self.runs: dict[int, tuple[Path, str]] = {}

    def __getitem__(self, zero: int) -> tuple[Path, str]:
        if zero not in self.runs:
            config = write_config(self.root / f"zero{zero}.yml",
                                  staged_config(self.family, *self.corpus, zero_stage=zero))
            self.runs[zero] = (self.root / f"zero{zero}", run_train(config, self.root / f"zero{zero}").stdout)
        return self.runs[zero]


@pytest.fixture(scope="module")
def staged_runs(training_corpus, family: Family, tmp_path_factory: pytest.TempPathFactory) -> StagedRuns:
    return StagedRuns(family, training_corpus, tmp_path_factory.mktemp(f"stages_{family.name}"))


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 1, 3])  # ZeRO-1 consolidates no frozen tensors: weights.py adds them
def test_frozen_tensors_and_rows_stay_bitwise_and_trainable_ones_train(staged_runs, family: Family, zero: int) -> None:
    run = staged_runs[zero][0]
    starts = [initial_weights(run)] + [step_weights(run, end) for end in STAGE_ENDS[:-1]]
    for stage, end in enumerate(STAGE_ENDS):
        before, after = starts[stage], step_weights(run, end)
        assert after.keys() == before.keys()  # ordinary names, the fused QKV joined back
        for name, trains in masks(run, family, stage).items():
            assert torch.equal(before[name][~trains], after[name][~trains]), f"stage {stage + 1}: {name} frozen part moved"
            if trains.any():
                assert not torch.equal(before[name][trains], after[name][trains]), f"stage {stage + 1}: {name} untrained"
        if stage == 0:  # every head's K rows of every layer moved, not just some
            qkv = [name for name in before if name.endswith("query_key_value.weight")]
            heads = config_lib.load(run / checkpoint_dirs.CONFIG_FILE).model.num_attention_heads
            for name in qkv:
                moved = (before[name] != after[name]).reshape(heads, 3, -1).any(dim=-1)  # (H, 3)
                assert moved[:, 1].all() and not moved[:, [0, 2]].any(), name


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_optimizer_state_only_for_trainable_elements_and_counts_logged(staged_runs, family: Family, zero: int) -> None:
    run, stdout = staged_runs[zero]
    total = sum(tensor.numel() for tensor in initial_weights(run).values())
    expected = [trainable_count(run, family, stage) for stage in range(3)]
    assert expected[0] < expected[1] < expected[2] == total
    for stage, end in enumerate(STAGE_ENDS):  # each written by the engine of the stage it ends
        found = optimizer_elements(run / checkpoint_dirs.CHECKPOINTS_DIR / checkpoint_dirs.step_tag(end))
        assert found["exp_avg"] == found["exp_avg_sq"] == expected[stage], (stage, found)
        assert found["fp32"] == (expected[stage] if zero else 0), (stage, found)  # ZeRO's fp32 master partitions
        first = STAGE_ENDS[stage - 1] + 1 if stage else 1
        share = 100.0 * expected[stage] / total
        assert (f"stage {stage + 1}/3 (steps {first}-{end}): trainable {expected[stage]:,} of {total:,} parameters "
                f"({share:.1f}%): {', '.join(family.stages[stage]['trainable'])}") in stdout
    rows = [row for row in metrics(run) if row.get("loss") is not None]
    assert [row["trainable_parameters"] for row in rows] == [expected[0]] * 3 + [expected[1]] * 3 + [expected[2]] * 2
    assert [row["stage"] for row in rows] == [1, 1, 1, 2, 2, 2, 3, 3]
    lrs = {row["step"]: row["lr"] for row in rows}  # per_stage: warm-up restarts at each stage's first step
    assert lrs[1] == lrs[4] == lrs[7] == pytest.approx(1e-7)
    assert lrs[5] == pytest.approx(2.0e-3) and lrs[8] == pytest.approx(3.0e-3)  # stage 2's own peak lr


@pytest.mark.slow
def test_sigkill_inside_stage_2_resumes_bitwise(training_corpus, staged_runs, family: Family, tmp_path: Path) -> None:
    """Killed right after step 5 (stage 2, checkpoint 4 complete): --resume auto reloads stage 2's engine and
    optimizer state and ends bitwise equal to the uninterrupted run."""
    mix, cache = training_corpus
    baseline = staged_runs[0][0]
    killed = write_config(tmp_path / "killed.yml", staged_config(family, mix, cache,
                                                                 fault_injection={"kill_after_step": 5}))
    crashed = run_train(killed, tmp_path / "run", check=False)
    assert crashed.returncode == -signal.SIGKILL
    checkpoints = tmp_path / "run" / checkpoint_dirs.CHECKPOINTS_DIR
    assert checkpoint_dirs.latest_complete(checkpoints) == checkpoints / "step_00000004"
    assert checkpoint_dirs.read_complete_marker(checkpoints / "step_00000004")["stage"] == 1
    resumed = run_train(write_config(tmp_path / "config.yml", staged_config(family, mix, cache)), tmp_path / "run")
    assert "resumed from" in resumed.stdout and "step_00000004 at step 4" in resumed.stdout
    assert "stage 2/3 (steps 4-6)" in resumed.stdout and "stage 3/3 (steps 7-8)" in resumed.stdout
    assert train_losses(tmp_path / "run") == train_losses(baseline)
    for step in (6, 8):
        ours, theirs = step_weights(tmp_path / "run", step), step_weights(baseline, step)
        assert ours.keys() == theirs.keys()
        assert not [name for name in ours if not torch.equal(ours[name], theirs[name])], step


@pytest.mark.slow
def test_zero3_resumes_inside_a_slot_stage_and_at_a_stage_boundary(training_corpus, staged_runs, family: Family,
                                                                   tmp_path: Path) -> None:
    """ZeRO-3: stop at step 2 (inside stage 1, QKV split into slots), resume and stop at 3 (the end of stage
    1), resume to the end: the stage-2 engine starts from the boundary checkpoint's weights."""
    mix, cache = training_corpus
    baseline = staged_runs[3][0]
    config = write_config(tmp_path / "config.yml", staged_config(family, mix, cache, zero_stage=3))
    run_train(config, tmp_path / "run", "--set", "train.exit_interval=2")
    second = run_train(config, tmp_path / "run", "--set", "train.exit_interval=3")
    assert "step_00000002 at step 2" in second.stdout and "stopped by train.exit_interval at step 3" in second.stdout
    third = run_train(config, tmp_path / "run")
    assert "step_00000003 at step 3" in third.stdout and "stage 2/3 (steps 4-6)" in third.stdout
    assert train_losses(tmp_path / "run") == train_losses(baseline)
    ours, theirs = step_weights(tmp_path / "run", 8), step_weights(baseline, 8)
    assert not [name for name in ours if not torch.equal(ours[name], theirs[name])]


def test_slot_module_is_the_fused_linear() -> None:
    """Same output and gradient rows as the nn.Linear it replaces; state_dict and consolidation keep the
    fused names and layout."""
    torch.manual_seed(0)
    heads, head_dim, hidden = 4, 8, 32
    linear = torch.nn.Linear(hidden, 3 * heads * head_dim)
    slots = SlotQKV(linear, heads, weight_slots=[1], bias_slots=[1])
    x = torch.randn(2, 5, hidden)
    assert torch.equal(slots(x), linear(x))
    slots(x).square().sum().backward()
    linear(x).square().sum().backward()
    rows = torch.arange(3 * heads * head_dim).reshape(heads, 3, head_dim)[:, 1].reshape(-1)  # the K rows
    assert torch.allclose(slots.slot1_weight.grad.reshape(-1, hidden), linear.weight.grad[rows])
    assert slots.slot0_weight.grad is None and slots.slot2_bias.grad is None  # frozen slots
    state = slots.state_dict()
    assert list(state) == ["weight", "bias"] and torch.equal(state["weight"], linear.weight)
    slots.load_state_dict({"weight": linear.weight * 2, "bias": linear.bias})
    assert torch.equal(slots.state_dict()["weight"], linear.weight * 2)
    named = {f"attention.query_key_value.{name}": tensor for name, tensor in slots.named_parameters()}
    joined = join_qkv_slots(named)
    assert list(joined) == ["attention.query_key_value.weight", "attention.query_key_value.bias"]
    assert torch.equal(joined["attention.query_key_value.weight"], linear.weight * 2)


@pytest.mark.parametrize("schedule", ["per_stage", "across"])
def test_stage_schedule_restarts_per_stage_or_runs_across(schedule: str) -> None:
    """Linear warm-up over 10% then linear decay, written out: per stage over its own steps from its own
    start, or across over the whole run; the stage's lr is the peak either way."""
    from megatron_lite.training.schedule import run_learning_rate

    train = config_lib.from_dict({"train": {
        "lr": 1e-3, "min_lr": 1e-5, "warmup_start_lr": 0.0, "warmup": 0.1, "stage_schedule": schedule,
        "stages": [{"steps": 20, "trainable": ["*"]}, {"steps": 30, "trainable": ["*"], "lr": 5e-4}]}}).train

    def linear(step: int, total: int, peak: float) -> float:
        warmup = round(0.1 * total)
        if step < warmup:
            return peak * step / warmup
        return peak + (1e-5 - peak) * (step - warmup) / (total - 1 - warmup)

    for step in (0, 1, 2, 10, 19, 20, 21, 25, 49):
        peak = 1e-3 if step < 20 else 5e-4
        start, steps = (0, 20) if step < 20 else (20, 30)
        expected = linear(step, 50, peak) if schedule == "across" else linear(step - start, steps, peak)
        assert run_learning_rate(step, 50, train) == pytest.approx(expected, rel=1e-12), step


@pytest.mark.parametrize(("train", "expected"), [
    ({"stages": [{"steps": 2, "trainable": ["*"]}, {"steps": 0, "trainable": ["*"]}]},
     "train.stages[1].steps=0: must be positive"),
    ({"stages": [{"steps": 2, "trainable": []}]}, "train.stages[0].trainable=[]"),
    ({"stages": [{"steps": 2, "trainable": ["*"], "lr": -1}]}, "train.stages[0].lr=-1.0: must be positive"),
    ({"stages": [{"steps": 2, "trainable": ["*"]}], "train_iters": 5},
     "train.train_iters=5 conflicts with train.stages, whose steps sum to 2"),
    ({"stages": [{"steps": 2, "trainable": ["*"], "learning_rate": 1}]},
     "unknown config key train.stages[0].learning_rate"),
    ({"stage_schedule": "per_step"}, "train.stage_schedule='per_step': must be one of"),
])
def test_stage_config_errors_name_the_key(training_corpus, train: dict[str, Any], expected: str) -> None:
    mix, cache = training_corpus
    data = tiny_train_config(mix, cache, **{"train_iters": None, **train})
    with pytest.raises(ValueError) as error:
        config_lib.from_dict(data)
    assert expected in str(error.value) and "\n" not in str(error.value)


@pytest.mark.slow
def test_a_pattern_matching_nothing_is_one_line_naming_real_parameters(training_corpus, family: Family,
                                                                       tmp_path: Path) -> None:
    mix, cache = training_corpus
    stages = [*family.stages[:2], {"steps": 2, "trainable": ["layers.*.attn.*"]}]
    config = write_config(tmp_path / "config.yml", staged_config(family, mix, cache, stages=stages))
    result = run_train(config, tmp_path / "run", check=False)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "train.stages[2].trainable[0]='layers.*.attn.*' matches no parameter; parameter names: embed_in.weight" \
        in errors[0]
    assert not (tmp_path / "run" / checkpoint_dirs.CHECKPOINTS_DIR).exists()  # refused before any training
