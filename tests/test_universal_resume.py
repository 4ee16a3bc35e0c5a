"""A run saved by 2 ranks continues on 1 and on 4 (docs/run_at_scale.md, "Continue on a different number of
GPUs"): real train.py runs (``run_training``) under real DeepSpeed ranks over gloo on CPU, every ZeRO stage.

Three launches, each looping over the cases (a launch costs more than a tiny run):

1. ``deepspeed --num_gpus 2``: per ZeRO stage 0-3, a 14-step run stopped by ``train.exit_interval`` at step 4
   (its checkpoint: 2 ranks); then the state a same-world-size resume loads from it (the saved state: that
   load is DeepSpeed's exact one), captured as the snapshot.
2. plain python (1 rank) and 3. ``deepspeed --num_gpus 4``: per stage, the resume (``--resume auto``: converts
   through DeepSpeed's universal checkpoint at ZeRO 1-3) with the state it loaded captured before the first
   step, trained to step 14; and the uninterrupted 14-step run at that world size. Stage 1 also resumes from a
   conversion made ahead by ``tools/convert_checkpoint.py --to universal`` (reused), and crafted pickles are
   planted in the universal folder (load_universal on: refused before DeepSpeed reads them). A staged ZeRO 1
   run saved at step 4 continues across its stage boundary (step 6) and matches its uninterrupted run.

Two observers wrap our own functions and call the real ones: ``loop.load_training_state`` (the loaded state,
gathered with DeepSpeed's ``safe_get_full_*``) and ``StagedEngine._build`` (whether each engine loads
universally). DeepSpeed itself is not replaced. The 2-rank checkpoints are also converted in-process (racing
resumes, the tool on ZeRO 0, a checkpoint without ``universal_checkpoint_info``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow

STAGES = (0, 1, 2, 3)
SAVED_STEP = 4
TOTAL_STEPS = 14
NEW_WORLD_SIZES = (1, 4)
GROUP_SETTINGS = ("lr", "betas", "eps", "weight_decay")
SNAPSHOT = "state_after_load.pt"
OUTCOMES = "outcomes.json"
# A staged run (ZeRO 1) resumed inside its first stage: the engine rebuilt at the boundary (step 6) must not
# load universally (DeepSpeed fixes checkpoint.load_universal at initialize).
STAGED_RUN = [{"steps": 6, "trainable": ["*"]}, {"steps": 4, "trainable": ["layers.*.attention.query_key_value.*"]}]
PLANTED = ("zero/embed_in.weight/exp_avg.pt", "zero/optimizer_state.pt", "mp_rank_00_model_states.pt",
           "zero/layers.0.attention.dense.bias/fp32.pt")


def saved_run(root: Path, stage: int) -> Path:
    return root / f"saved_zero{stage}"


def resumed_run(root: Path, stage: int, world_size: int) -> Path:
    return root / f"resumed_zero{stage}_on{world_size}"


def reference_run(root: Path, stage: int, world_size: int) -> Path:
    return root / f"uninterrupted_zero{stage}_on{world_size}"


def run_config(root: Path, stage: int, exit_interval: int | None = None, staged: bool = False) -> Any:
    """14 steps of 16 samples (accumulation derived from the world size), fp32, dropout 0, a checkpoint every
    5 steps and the last 2 kept; ``exit_interval`` stops it early with a checkpoint. ``staged``: ``STAGES_RUN``
    instead of 14 plain steps."""
    from megatron_lite import config as config_lib
    from training_helpers import tiny_train_config

    corpus = json.loads((root / "corpus.json").read_text())
    steps = {"train_iters": None, "stages": STAGED_RUN} if staged else {"train_iters": TOTAL_STEPS}
    data = tiny_train_config(Path(corpus["mix"]), Path(corpus["cache"]), **steps, zero_stage=stage,
                             gradient_accumulation_steps=None, train_batch_size=16, eval_interval=0, save_interval=5,
                             keep_last_checkpoints=2, record_sample_indices=True, exit_interval=exit_interval)
    data["model"].update(attention_dropout=0.0, hidden_dropout=0.0)
    return config_lib.from_dict(data)


# ----------------------------------------------------------------------------------------------
# Worker (runs under the DeepSpeed launcher or plain python)


def _gathered_state(engine: Any, optimizer: Any) -> dict[str, Any]:
    """Full fp32 weights and Adam moments (every rank takes part: ZeRO gathers) and each group's settings."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:  # ZeRO 1/2 link the moments to the parameters at the first step, or here
        link()
    tensors = {}
    for name, parameter in engine.module.named_parameters():
        tensors[f"{name}/fp32"] = safe_get_full_fp32_param(parameter).detach().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            tensors[f"{name}/{key}"] = safe_get_full_optimizer_state(parameter, key).detach().clone()
    groups = [{key: group[key] for key in GROUP_SETTINGS} for group in optimizer.param_groups]
    return {"tensors": tensors, "groups": groups}


class CaptureAfterLoad:
    """Wraps ``loop.load_training_state``: the real load, then its result gathered and saved to ``target``."""

    def __init__(self) -> None:
        from megatron_lite.training import loop

        self.loop, self.real, self.target = loop, loop.load_training_state, None
        loop.load_training_state = self

    def __call__(self, engine: Any, plan: Any, optimizer: Any) -> Any:
        state = self.real(engine, plan, optimizer)
        if self.target is not None and engine.zero_optimization_stage() > 0:
            captured = _gathered_state(engine, optimizer)
            if int(os.environ["RANK"]) == 0:
                torch.save(captured, self.target)
        return state


class RecordLoadUniversal:
    """Wraps ``StagedEngine._build``: each engine built since ``start`` and whether DeepSpeed loads it universally."""

    def __init__(self) -> None:
        from megatron_lite.training.engine import StagedEngine

        real = StagedEngine._build
        self.flags: list[bool] = []

        def build(engine: Any, model: Any, load_universal: bool) -> None:
            real(engine, model, load_universal)
            self.flags.append(bool(engine.engine.load_universal_checkpoint()))

        StagedEngine._build = build  # type: ignore[method-assign]


def _train(config: Any, run_dir: Path, **options: Any) -> list[str]:
    """run_training; the notices it gave (rank 0 prints them)."""
    from megatron_lite.console import Notice
    from megatron_lite.training.loop import run_training

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", Notice)
        run_training(config, run_dir, **options)
    return [str(warning.message) for warning in caught if issubclass(warning.category, Notice)]


def _copy_on_rank0(source: Path, target: Path) -> None:
    from megatron_lite.training.distributed import barrier

    if int(os.environ["RANK"]) == 0:
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(source, target)
    barrier()


def _save_phase(root: Path) -> dict[str, Any]:
    capture = CaptureAfterLoad()
    for stage in STAGES:
        config = run_config(root, stage)
        _train(run_config(root, stage, exit_interval=SAVED_STEP), saved_run(root, stage), resume="none")
        # The saved state, as a same-world-size resume loads it (one more step trains in a copy, then it stops).
        _copy_on_rank0(saved_run(root, stage), root / f"snapshot_zero{stage}")
        capture.target = saved_run(root, stage) / SNAPSHOT
        _train(config, root / f"snapshot_zero{stage}", train_iters=SAVED_STEP + 1)
        capture.target = None
    _train(run_config(root, 1, exit_interval=SAVED_STEP, staged=True), root / "saved_staged", resume="none")
    return {}


def _planted_refusals(root: Path, config: Any, world_size: int) -> dict[str, str]:
    """Crafted pickles in the universal folder of a 2-rank ZeRO 1 checkpoint (manifest rewritten to match, or not
    listed at all): the resume on ``world_size`` ranks stops with one line; the payload never runs."""
    from megatron_lite.checkpoint_integrity import read_manifest, write_manifest
    from megatron_lite.convert import universal
    from megatron_lite.files import file_sha256
    from megatron_lite.training.distributed import barrier
    from test_checkpoint_safety import Payload

    outcomes = {}
    for name in (*PLANTED, "zero/embed_in.weight/extra.pt"):
        run = root / f"planted_on{world_size}"
        _copy_on_rank0(saved_run(root, 1), run)
        step_dir = run / "checkpoints" / f"step_{SAVED_STEP:08d}"
        marker = root / f"owned_on{world_size}"
        if int(os.environ["RANK"]) == 0:
            target = universal.universal_dir(step_dir)
            universal.convert_to_universal(step_dir, target)
            torch.save({"param": Payload(marker)}, target / name)
            records = read_manifest(target)
            assert records is not None
            if name in records:  # an attacker with write access rewrites the manifest too
                records[name].bytes, records[name].sha256 = (target / name).stat().st_size, file_sha256(target / name)
                write_manifest(target, list(records.values()))
        barrier()
        try:
            _train(config, run, resume=str(step_dir))
            outcomes[name] = "resumed"
        except ValueError as error:
            outcomes[name] = str(error)
        outcomes[name + " payload ran"] = str(marker.exists())
    return outcomes


def _resume_phase(root: Path) -> dict[str, Any]:
    from megatron_lite.training.distributed import barrier
    from script_loading import load_script

    world_size = int(os.environ["WORLD_SIZE"])
    capture = CaptureAfterLoad()
    outcomes: dict[str, Any] = {}
    for stage in STAGES:
        config = run_config(root, stage)
        run = resumed_run(root, stage, world_size)
        _copy_on_rank0(saved_run(root, stage), run)
        step_dir = run / "checkpoints" / f"step_{SAVED_STEP:08d}"
        if stage == 1 and int(os.environ["RANK"]) == 0:  # converted ahead: the resume reuses it
            tool = load_script("tools/convert_checkpoint.py")
            assert tool.main([str(step_dir), str(step_dir / "universal"), "--to", "universal"]) == 0
        barrier()
        capture.target = run / SNAPSHOT
        notices = _train(config, run)
        capture.target = None
        _train(config, reference_run(root, stage, world_size), resume="none")
        outcomes[f"zero{stage}"] = {"notices": [text for text in notices if "rank(s)" in text],
                                    "step_dir_left": step_dir.exists()}
    outcomes["planted"] = _planted_refusals(root, run_config(root, 1), world_size)
    builds = RecordLoadUniversal()
    _copy_on_rank0(root / "saved_staged", root / f"resumed_staged_on{world_size}")
    _train(run_config(root, 1, staged=True), root / f"resumed_staged_on{world_size}")
    outcomes["staged_builds"] = list(builds.flags)  # before the uninterrupted run builds its own
    _train(run_config(root, 1, staged=True), root / f"uninterrupted_staged_on{world_size}", resume="none")
    return outcomes


def worker(root: Path, phase: str) -> None:
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)  # plain python: no launcher
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    outcomes = _save_phase(root) if phase == "save" else _resume_phase(root)
    if int(os.environ["RANK"]) == 0:
        (root / f"{phase}_on{os.environ['WORLD_SIZE']}_{OUTCOMES}").write_text(json.dumps(outcomes, indent=1))


# ----------------------------------------------------------------------------------------------
# Tests


def _launch(root: Path, phase: str, ranks: int) -> None:
    from training_helpers import REPO, free_port

    script = str(Path(__file__).resolve())
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "PYTHONPATH": str(REPO)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        environment.pop(name, None)
    arguments = [script, "--root", str(root), "--phase", phase]
    if ranks == 1:
        command, environment["MASTER_PORT"] = [sys.executable, *arguments], str(free_port())
    else:
        command = ["deepspeed", "--num_gpus", str(ranks), "--master_port", str(free_port()), *arguments]
    done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-5000:]}\n{done.stderr[-5000:]}"


@pytest.fixture(scope="module")
def runs(training_corpus: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("deepspeed") is None:
        pytest.skip("the deepspeed launcher is not on PATH")
    mix, cache = training_corpus
    root = tmp_path_factory.mktemp("universal")
    (root / "corpus.json").write_text(json.dumps({"mix": str(mix), "cache": str(cache)}))
    _launch(root, "save", 2)
    for world_size in NEW_WORLD_SIZES:
        _launch(root, "resume", world_size)
    return root


def _outcomes(root: Path, world_size: int) -> dict[str, Any]:
    return json.loads((root / f"resume_on{world_size}_{OUTCOMES}").read_text())


@pytest.mark.parametrize("world_size", NEW_WORLD_SIZES)
@pytest.mark.parametrize("stage", (1, 2, 3))
def test_weights_moments_and_group_settings_carry_bitwise(runs: Path, stage: int, world_size: int) -> None:
    from megatron_lite.checkpoint_integrity import safe_load

    saved = safe_load(saved_run(runs, stage) / SNAPSHOT)
    loaded = safe_load(resumed_run(runs, stage, world_size) / SNAPSHOT)
    assert loaded["tensors"].keys() == saved["tensors"].keys() and len(saved["tensors"]) > 40
    for name, tensor in saved["tensors"].items():
        assert torch.equal(loaded["tensors"][name], tensor), name
    assert any(tensor.abs().sum() > 0 for name, tensor in saved["tensors"].items() if name.endswith("/exp_avg"))
    # (d) every group's own settings: the no-decay group keeps weight decay 0 (ZeRO-3's load copies group 0's)
    assert [group["weight_decay"] for group in saved["groups"]] == [0.1, 0.0]
    assert loaded["groups"] == saved["groups"]


@pytest.mark.parametrize("world_size", NEW_WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
def test_losses_and_samples_continue_the_uninterrupted_run(runs: Path, stage: int, world_size: int) -> None:
    from megatron_lite.training.sample_record import read_sample_indices
    from training_helpers import train_losses

    resumed, reference = resumed_run(runs, stage, world_size), reference_run(runs, stage, world_size)
    after = range(SAVED_STEP + 1, TOTAL_STEPS + 1)
    losses, expected = train_losses(resumed), train_losses(reference)
    assert list(after) == [step for step in losses if step > SAVED_STEP]
    for step in after:
        assert losses[step] == pytest.approx(expected[step], rel=1e-5, abs=0), step
    assert read_sample_indices(resumed) == read_sample_indices(reference)  # steps 1-4 on 2 ranks, 5-14 here
    assert len(read_sample_indices(reference)) == TOTAL_STEPS
    outcome = _outcomes(runs, world_size)[f"zero{stage}"]
    notice = outcome["notices"]
    assert len(notice) == 1 and f"(saved by 2 rank(s)) on {world_size} rank(s)" in notice[0], notice
    if stage == 0:
        assert "ZeRO 0 loads as saved" in notice[0]
    else:
        reused = "reusing the conversion" if stage == 1 else "converted it in"
        assert "loading DeepSpeed's universal checkpoint" in notice[0] and reused in notice[0]
    assert not outcome["step_dir_left"]  # keep_last_checkpoints deleted step 4, its universal folder with it


@pytest.mark.parametrize("world_size", NEW_WORLD_SIZES)
def test_crafted_pickles_in_the_universal_folder_never_run(runs: Path, world_size: int) -> None:
    planted = _outcomes(runs, world_size)["planted"]
    for name in PLANTED:
        assert planted[f"{name} payload ran"] == "False"
        message = planted[name]
        assert "\n" not in message and "fails verification" in message, message
        assert f"universal/{name}: refused to unpickle posix.system" in message, message
    assert "universal/zero/embed_in.weight/extra.pt: not listed in" in planted["zero/embed_in.weight/extra.pt"]
    assert planted["zero/embed_in.weight/extra.pt payload ran"] == "False"


@pytest.mark.parametrize("world_size", NEW_WORLD_SIZES)
def test_the_engine_rebuilt_at_a_stage_boundary_does_not_load_universally(runs: Path, world_size: int) -> None:
    from training_helpers import train_losses

    assert _outcomes(runs, world_size)["staged_builds"] == [True, False]  # the resume's engine, then stage 2's
    losses = train_losses(runs / f"resumed_staged_on{world_size}")
    expected = train_losses(runs / f"uninterrupted_staged_on{world_size}")
    assert [step for step in losses if step > SAVED_STEP] == list(range(SAVED_STEP + 1, 11))
    for step in range(SAVED_STEP + 1, 11):
        assert losses[step] == pytest.approx(expected[step], rel=1e-5, abs=0), step


def test_a_zero0_checkpoint_has_nothing_to_convert(runs: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from script_loading import load_script

    tool = load_script("tools/convert_checkpoint.py")
    assert tool.main([str(saved_run(runs, 0)), str(tmp_path / "out"), "--to", "universal"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: ") and "\n" not in error and "a ZeRO 0 checkpoint loads on any number" in error
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_saved_without_universal_info_converts_too(runs: Path, tmp_path: Path) -> None:
    """Checkpoints saved before megatron_lite recorded ``universal_checkpoint_info`` differ from today's by that
    key alone: without it ds_to_universal asserts, so the conversion injects it (DeepSpeed's own option)."""
    from megatron_lite.checkpoint_integrity import read_manifest, safe_load, write_manifest
    from megatron_lite.convert.universal import convert_step_to_universal
    from megatron_lite.files import file_sha256

    step_dir = tmp_path / f"step_{SAVED_STEP:08d}"
    shutil.copytree(saved_run(runs, 1) / "checkpoints" / step_dir.name, step_dir)
    convert_step_to_universal(step_dir, tmp_path / "today")
    states = step_dir / "mp_rank_00_model_states.pt"
    older = safe_load(states)
    del older["universal_checkpoint_info"]
    torch.save(older, states)
    records = read_manifest(step_dir)
    assert records is not None
    records[states.name].bytes, records[states.name].sha256 = states.stat().st_size, file_sha256(states)
    write_manifest(step_dir, list(records.values()))
    convert_step_to_universal(step_dir, tmp_path / "older")
    today = read_manifest(tmp_path / "today") or {}
    assert len(today) > 100 and sorted(today) == sorted(read_manifest(tmp_path / "older") or {})
    for name in today:
        if name.startswith("zero/"):
            assert (tmp_path / "today" / name).read_bytes() == (tmp_path / "older" / name).read_bytes(), name


RACER = """
import sys, warnings
from pathlib import Path
import torch
from megatron_lite import checkpoint_dirs, config as config_lib
from megatron_lite.training.checkpointing import plan_resume
from megatron_lite.training.distributed import DistributedInfo
step_dir = Path(sys.argv[1])
print("ready", flush=True)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    plan_resume(step_dir, checkpoint_dirs.read_complete_marker(step_dir), config_lib.load(step_dir / "config.yml"),
                DistributedInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
print("\\n".join(str(warning.message) for warning in caught if "universal" in str(warning.message)))
"""


def test_two_resumes_racing_to_convert_one_checkpoint_convert_it_once(runs: Path, tmp_path: Path) -> None:
    """Two processes resume the same 2-rank ZeRO 2 step dir on 1 rank at once (``--resume PATH`` from two run
    dirs: the run-dir lock does not order them). Both wait on the step dir's lock, held here until both are
    at it; then one converts and the other reuses its result."""
    from megatron_lite.checkpoint_integrity import verify_checkpoint
    from megatron_lite.convert.universal import conversion_lock
    from training_helpers import REPO

    step_dir = tmp_path / f"step_{SAVED_STEP:08d}"
    shutil.copytree(saved_run(runs, 2) / "checkpoints" / step_dir.name, step_dir)
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with conversion_lock(step_dir):
        racers = [subprocess.Popen([sys.executable, "-c", RACER, str(step_dir)], env=environment, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
        assert [racer.stdout.readline().strip() for racer in racers] == ["ready", "ready"]  # type: ignore[union-attr]
    said = []
    for racer in racers:
        out, err = racer.communicate(timeout=300)
        assert racer.returncode == 0, err[-3000:]
        said.append(out.strip())
    assert sorted("converted it in" in line for line in said) == [False, True], said
    assert any("(reusing the conversion)" in line for line in said), said
    assert verify_checkpoint(step_dir).ok and not list(step_dir.glob(".universal.partial-*"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="DeepSpeed worker of tests/test_universal_resume.py")
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--phase", choices=("save", "resume"), required=True)
    parser.add_argument("--local_rank", type=int, default=None)  # passed by the deepspeed launcher
    arguments = parser.parse_args()
    worker(arguments.root, arguments.phase)
