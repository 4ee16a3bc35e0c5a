"""Two nodes on one machine: one DeepSpeed launcher per "node", as on a cluster without ssh.

Each launcher is the real `deepspeed --no_ssh --node_rank R` (gloo on CPU, one rank each) reading a
two-line hostfile; together they train one 2-rank run that must equal the 2-rank run of one launcher
(`deepspeed --num_gpus 2`) step for step. The SLURM batch script (tools/slurm/train.sbatch) starts its
launchers the same way; tests/test_slurm_requeue.py runs it, stopped, requeued and resumed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_lite import checkpoint_dirs
from megatron_lite.training.sample_record import read_sample_indices
from training_helpers import REPO, free_port, metrics, run_train, tiny_train_config, train_losses, write_config

pytestmark = pytest.mark.slow  # real multi-process training runs

STEPS = 4
RELATIVE_TOLERANCE = 1e-5
# Two names for this machine: DeepSpeed refuses a hostfile naming one host twice, and with --no_ssh the
# names are only labels (each launcher takes the line of its --node_rank; only --master_addr is dialled).
HOSTFILE = "localhost slots=1\n127.0.0.1 slots=1\n"
STARTUP = "2 rank(s) on cpu; batch 8 = 4 micro x 1 accumulation (derived) x 2 rank(s)"


def launcher_env() -> dict[str, str]:
    # A launcher whose partner never starts waits DEEPSPEED_TIMEOUT minutes (default 10) for it: fail sooner.
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1",
            "DEEPSPEED_TIMEOUT": "2"}


def deepspeed_executable() -> list[str]:
    deepspeed = Path(sys.executable).with_name("deepspeed")
    return [str(deepspeed)] if deepspeed.exists() else [sys.executable, "-m", "deepspeed.launcher.runner"]


@pytest.fixture(scope="module")
def config(training_corpus, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny run with a global batch of 8 at micro batch 4 and accumulation left to be derived, ZeRO 1
    (the optimizer state split over the nodes), every step's sample indices recorded."""
    mix, cache = training_corpus
    data = tiny_train_config(mix, cache, train_iters=STEPS, train_batch_size=8, gradient_accumulation_steps=None,
                             zero_stage=1, eval_interval=2, save_interval=STEPS, record_sample_indices=True)
    return write_config(tmp_path_factory.mktemp("multinode") / "config.yml", data)


@pytest.fixture(scope="module")
def one_launcher(config: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same run from one launcher with both ranks (`deepspeed --num_gpus 2`): what the nodes must equal."""
    run_dir = tmp_path_factory.mktemp("one_launcher") / "run"
    result = run_train(config, run_dir, ranks=2)
    assert STARTUP in result.stdout
    return run_dir


def assert_same_training(run_dir: Path, reference: Path) -> None:
    """Finished at STEPS with world size 2 (both ranks wrote their share), the reference's losses to 1e-5,
    its validation loss, and the same global samples in every step."""
    step_dir = run_dir / checkpoint_dirs.CHECKPOINTS_DIR / checkpoint_dirs.step_tag(STEPS)
    marker = json.loads((step_dir / checkpoint_dirs.COMPLETE_MARKER).read_text())
    assert (marker["step"], marker["world_size"], marker["stopped_by"]) == (STEPS, 2, "completed")
    for rank in (0, 1):  # each rank saves its RNG state and its ZeRO-1 optimizer partition
        assert (step_dir / f"rng_state_rank{rank:05d}.pt").is_file()
        assert len(list(step_dir.glob(f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))) == 1
    losses, expected = train_losses(run_dir), train_losses(reference)
    assert sorted(losses) == list(range(1, STEPS + 1)) and sorted(expected) == sorted(losses)
    for step in losses:
        assert losses[step] == pytest.approx(expected[step], rel=RELATIVE_TOLERANCE), step

    def validation(run: Path) -> dict[int, float]:
        return {row["step"]: row["val_loss"] for row in metrics(run) if row.get("val_loss") is not None}

    assert validation(run_dir).keys() == validation(reference).keys() == {2, 4}
    for step, loss in validation(run_dir).items():
        assert loss == pytest.approx(validation(reference)[step], rel=RELATIVE_TOLERANCE), step
    assert read_sample_indices(run_dir) == read_sample_indices(reference)
    assert sorted(index for indices in read_sample_indices(run_dir).values() for index in indices) == \
        list(range(8 * STEPS))


def test_two_launchers_with_no_ssh_train_like_one_launcher_with_two_ranks(config: Path, one_launcher: Path, tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(HOSTFILE)
    port, run_dir = free_port(), tmp_path / "run"
    launchers = []
    for node_rank in (0, 1):
        command = [*deepspeed_executable(), "--hostfile", str(hostfile), "--num_nodes", "2", "--num_gpus", "1",
                   "--no_ssh", "--node_rank", str(node_rank), "--master_addr", "127.0.0.1", "--master_port", str(port),
                   str(REPO / "train.py"), "--config", str(config), "--run-dir", str(run_dir)]
        launchers.append(subprocess.Popen(command, cwd=REPO, env=launcher_env(), text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    try:
        outputs = [launcher.communicate(timeout=300)[0] for launcher in launchers]
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                launcher.kill()
    for node_rank, (launcher, output) in enumerate(zip(launchers, outputs)):
        assert launcher.returncode == 0, f"launcher {node_rank} exited {launcher.returncode}:\n{output[-4000:]}"
        # each launcher placed its own rank: world size 2, one process here, global rank = node rank
        assert f"nnodes=2, num_local_procs=1, node_rank={node_rank}" in output, output[-4000:]
    assert STARTUP in outputs[0]  # rank 0 (node 0) prints the header; it counts both ranks
    assert f"done: completed at step {STEPS}/{STEPS}" in outputs[0]
    assert_same_training(run_dir, one_launcher)

