"""train.py under `torchrun` (docs/run_at_scale.md, "torchrun"): 2 CPU ranks train the losses of the `deepspeed`
launcher's 2 ranks, and a SIGTERM to torchrun saves a checkpoint on every rank.

torchrun (torch.distributed.elastic) answers SIGTERM by sending it on to each worker's process group, waiting up
to `--shutdown-timeout` seconds (default 30) for them to exit, SIGKILLing any still alive, and exiting 1 with a
SignalException traceback. So the run's own code comes from `python -m megatron_lite.training.run_lock RUN_DIR`:
143, with the checkpoint of the step the signal landed in complete. (A resume after such a stop, under the
`deepspeed` launcher: tests/test_slurm_requeue.py.)
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_lite import checkpoint_dirs
from megatron_lite.training.sample_record import read_sample_indices
from training_helpers import REPO, free_port, metrics, run_train, tiny_train_config, train_losses, write_config

STEPS = 40  # long enough for the signal to land mid-run (a tiny step takes ~50 ms)
SIGNAL_AFTER_STEPS = 12  # past the first validation (step 10), which the comparison then covers
RELATIVE_TOLERANCE = 1e-5
DOCS = REPO / "docs" / "run_at_scale.md"


def documented_torchrun_commands() -> list[list[str]]:
    """The `torchrun ...` lines of the guide's ```bash blocks, continuations joined."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", DOCS.read_text(), flags=re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            words = shlex.split(line.split(" # ", 1)[0])
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
                words = words[1:]
            if words[:1] == ["torchrun"]:
                commands.append(words[1:])
    return commands


def test_documented_torchrun_commands_parse() -> None:
    """Each documented torchrun command through torch's own parser, and its train.py arguments through train.py's:
    one node (--standalone) and two (--nnodes 2, a c10d rendezvous), both with a --shutdown-timeout."""
    from torch.distributed.run import get_args_parser

    from script_loading import load_script

    train_parser = load_script("train.py").build_parser()
    parsed = [get_args_parser().parse_args(words) for words in documented_torchrun_commands()]
    assert any(args.standalone for args in parsed), "a single-node command"
    assert any(args.nnodes == "2" and args.rdzv_backend == "c10d" and args.rdzv_endpoint for args in parsed)
    for args in parsed:
        assert args.training_script == "train.py" and args.shutdown_timeout is not None
        train_parser.parse_args(args.training_script_args)


@pytest.fixture(scope="module")
def config(training_corpus, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny run at global batch 8 (micro 4, accumulation derived), ZeRO 1, validation every 10 steps, no
    periodic save: only the signal's and the final checkpoint."""
    mix, cache = training_corpus
    data = tiny_train_config(mix, cache, train_iters=STEPS, train_batch_size=8, gradient_accumulation_steps=None,
                             zero_stage=1, eval_interval=10, save_interval=0, record_sample_indices=True)
    return write_config(tmp_path_factory.mktemp("torchrun") / "config.yml", data)


def torchrun(config: Path, run_dir: Path) -> list[str]:
    executable = Path(sys.executable).with_name("torchrun")
    launcher = [str(executable)] if executable.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return [*launcher, "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--shutdown-timeout", "600",
            str(REPO / "train.py"), "--config", str(config), "--run-dir", str(run_dir)]


@pytest.mark.slow
def test_torchrun_trains_like_deepspeed_and_saves_on_sigterm(config: Path, tmp_path: Path) -> None:
    reference = tmp_path / "deepspeed"
    run_train(config, reference, ranks=2)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    run_dir = tmp_path / "torchrun"

    launcher = subprocess.Popen(torchrun(config, run_dir), cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "metrics.jsonl").is_file() or len(train_losses(run_dir)) < SIGNAL_AFTER_STEPS:
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[0][-4000:]
            time.sleep(0.05)
        launcher.send_signal(signal.SIGTERM)  # torchrun alone: each worker leads a process group of its own
        output = launcher.communicate(timeout=300)[0]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    # torchrun waited for its workers, then exited 1 on its SignalException; the run's code comes from its lock
    assert launcher.returncode == 1 and "SignalException" in output, output[-4000:]
    waited = subprocess.run([sys.executable, "-m", "megatron_lite.training.run_lock", str(run_dir)], cwd=REPO,
                            env=env, text=True, capture_output=True, timeout=120)
    stopped = checkpoint_dirs.latest_complete(run_dir / checkpoint_dirs.CHECKPOINTS_DIR)
    assert stopped is not None, output[-4000:]
    marker = checkpoint_dirs.read_complete_marker(stopped)
    step = marker["step"]
    assert waited.returncode == 143, waited.stdout + waited.stderr
    assert f"{run_dir}: stopped by SIGTERM at step {step}" in waited.stdout
    assert SIGNAL_AFTER_STEPS <= step < STEPS and (marker["world_size"], marker["stopped_by"]) == (2, "signal")
    for rank in (0, 1):  # both ranks saved their share
        assert (stopped / f"rng_state_rank{rank:05d}.pt").is_file()
        assert len(list(stopped.glob(f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))) == 1
    assert "2 rank(s) on cpu; batch 8 = 4 micro x 1 accumulation (derived) x 2 rank(s)" in output
    # every step up to the signal's: the deepspeed launcher's losses, validation loss and samples
    steps = [row["step"] for row in metrics(run_dir) if row.get("loss") is not None]
    losses, expected = train_losses(run_dir), train_losses(reference)
    assert steps == list(range(1, step + 1)) and sorted(expected) == list(range(1, STEPS + 1))
    for each in steps:
        assert losses[each] == pytest.approx(expected[each], rel=RELATIVE_TOLERANCE), each

    def validation(run: Path) -> dict[int, float]:
        return {row["step"]: row["val_loss"] for row in metrics(run) if row.get("val_loss") is not None}

    assert 10 in validation(run_dir) and validation(reference).keys() == {10, 20, 30, 40}
    for each, loss in validation(run_dir).items():
        assert loss == pytest.approx(validation(reference)[each], rel=RELATIVE_TOLERANCE), each
    expected_samples = read_sample_indices(reference)
    assert read_sample_indices(run_dir) == {each: expected_samples[each] for each in steps}
