"""Several launchers on one machine against one uninterrupted 2-rank run (`deepspeed --num_gpus 2`, a tiny model):
two DeepSpeed launchers with --no_ssh as two nodes; the SLURM batch script (tools/slurm/train.sbatch) stopped by
SLURM's signal, requeued and resumed; and train.py under torchrun, stopped by SIGTERM.

Stand-ins on PATH behave like SLURM where it matters:
* `srun` starts the command once per node (each with its SLURM_NODEID) and holds every process they start
  (a child subreaper, like the step's cgroup: orphans stay in the step). On SIGUSR1 from the test it does what
  `#SBATCH --signal=TERM@N` (no `B:`) does near the time limit: SIGTERM to every process of the step. Once every
  task's main process has exited, or KillWait seconds after the signal, it SIGKILLs what is left of the step;
  `--kill-on-bad-exit=1` SIGKILLs the step when a task exits non-zero. It exits with the highest task code;
* `scontrol` answers `show hostnames` and records `requeue JOBID`; the test then reruns the script as the job's
  next allocation (SLURM_RESTART_COUNT=1), appending to the same output file (`--open-mode=append`).

In the SLURM test two "nodes" of one rank each train a tiny run; the signal lands mid-run. Every rank saves the
step it was on, the script requeues the job, and the next allocation resumes there and trains to the end with the
losses of the uninterrupted run. Every step is in metrics.jsonl once.
The script's static checks (each node's deepspeed command through DeepSpeed's parser): tests/test_docker.py.

The same uninterrupted run is the reference for train.py under `torchrun` (docs/run_at_scale.md, "torchrun"):
2 ranks stopped by a SIGTERM to torchrun save on every rank, `run_lock` exits 143, and the steps up to the
signal's are the `deepspeed` launcher's. The guide's torchrun commands: tests/test_torchrun.py.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_lite import checkpoint_dirs
from megatron_lite.training.sample_record import read_sample_indices
from megatron_lite.training.stopping import STOP_LINGER_ENV
from training_helpers import REPO, free_port, metrics, run_train, tiny_train_config, train_losses, write_config

STARTUP = "2 rank(s) on cpu; batch 8 = 4 micro x 1 accumulation (derived) x 2 rank(s)"
# Two names for this machine: DeepSpeed refuses a hostfile naming one host twice, and with --no_ssh the
# names are only labels (each launcher takes the line of its --node_rank; only --master_addr is dialled).
HOSTFILE = "localhost slots=1\n127.0.0.1 slots=1\n"

STEPS = 40  # long enough for the signal to land mid-run (a tiny step takes ~50 ms)
TORCHRUN_SIGNAL_AFTER_STEPS = 12  # past the first validation (step 10), which the comparison then covers
RELATIVE_TOLERANCE = 1e-5
SLURM_SCRIPT = REPO / "tools" / "slurm" / "train.sbatch"
JOB_ID = "4242"

SCONTROL = """#!/bin/bash
case "$1 $2" in
    "show hostnames") tr , '\\n' <<< "$3" ;;
    "requeue $SLURM_JOB_ID") echo "$2" >> "$SCONTROL_REQUEUE_FILE" ;;
    *) echo "scontrol stand-in: only 'show hostnames' and 'requeue $SLURM_JOB_ID', not '$*'" >&2; exit 2 ;;
esac
"""

SRUN = """#!{python}
import ctypes, os, signal, sys, time

ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: the step keeps its orphans
args = sys.argv[1:]
options = []
while args and args[0].startswith("-"):
    options.append(args.pop(0))
with open(os.environ["SRUN_OPTIONS_FILE"], "w") as handle:
    handle.write("\\n".join(options) + "\\n")
log = open(os.environ["SRUN_LOG_FILE"], "a", buffering=1)
kill_wait = float(os.environ.get("SLURM_KILL_WAIT", "30"))
signalled_at = None


def step_processes():
    parents = {{}}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{{entry}}/stat") as stat:
                    parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = [], [os.getpid()]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def signal_step(signum, why):
    pids = step_processes()
    log.write(f"{{why}}: {{signal.Signals(signum).name}} to {{len(pids)}} process(es)\\n")
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def time_limit_warning(signum, frame):
    global signalled_at
    signalled_at = time.monotonic()
    signal_step(signal.SIGTERM, "--signal")


signal.signal(signal.SIGUSR1, time_limit_warning)
tasks = {{}}
for node in range(int(os.environ["SLURM_NNODES"])):
    env = {{**os.environ, "SLURM_NODEID": str(node), "SLURM_PROCID": str(node), "SLURM_LOCALID": "0"}}
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        os.execvpe(args[0], args, env)
    tasks[pid] = node
with open(os.environ["SRUN_PID_FILE"], "w") as handle:
    handle.write(str(os.getpid()))
codes = {{}}
while len(codes) < len(tasks):
    while True:  # reap the tasks and the orphans the step inherits
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            pid = 0
        if pid == 0:
            break
        if pid in tasks:
            codes[pid] = os.waitstatus_to_exitcode(status)
            codes[pid] = codes[pid] if codes[pid] >= 0 else 128 - codes[pid]
            log.write(f"task {{tasks[pid]}} exited {{codes[pid]}}\\n")
    if "--kill-on-bad-exit=1" in options and any(codes.values()) and len(codes) < len(tasks):
        signal_step(signal.SIGKILL, "a task exited non-zero (--kill-on-bad-exit)")
    elif signalled_at is not None and time.monotonic() - signalled_at > kill_wait:
        signal_step(signal.SIGKILL, "KillWait over")
    time.sleep(0.05)
signal_step(signal.SIGKILL, "every task exited: the step ends")
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
sys.exit(max(codes.values()))
"""


def install_stand_ins(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN.format(python=sys.executable))):
        (directory / name).write_text(text)
        (directory / name).chmod(0o755)
    return directory


@pytest.fixture(scope="module")
def config(training_corpus, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny run at global batch 8 (micro 4, accumulation derived), ZeRO 1 (each rank saves its optimizer
    partition), validation every 10 steps, no periodic save: only the signal's and the final checkpoint."""
    mix, cache = training_corpus
    data = tiny_train_config(mix, cache, train_iters=STEPS, train_batch_size=8, gradient_accumulation_steps=None,
                             zero_stage=1, eval_interval=10, save_interval=0, record_sample_indices=True)
    return write_config(tmp_path_factory.mktemp("slurm_requeue") / "config.yml", data)


@pytest.fixture(scope="module")
def uninterrupted(config: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same run from one launcher with both ranks, never stopped: what the requeued job must equal."""
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    run_train(config, run_dir, ranks=2)
    return run_dir


def test_run_dir_of_is_train_pys_run_dir() -> None:
    """`run_lock --run-dir-of ARGS` (how the script finds the run dir to wait on) names the dir train.py writes."""
    from megatron_lite.training.run_lock import train_run_dir
    from script_loading import load_script

    parser = load_script("train.py").build_parser()
    for args in (["--config", "configs/coca_350m.yml", "--set", "train.zero_stage=2"],
                 ["--wait-for-lock", "300", "--config=configs/tiny/coca_slack.yml", "--run-dir", "runs/x"],
                 ["--config", "a/b.yml", "--run-dir=/abs/run", "--resume", "none"]):
        parsed = parser.parse_args(args)
        assert train_run_dir(args) == (parsed.run_dir or Path("runs") / Path(parsed.config).stem), args
    with pytest.raises(ValueError, match="without --config or --run-dir"):
        train_run_dir(["--set", "train.lr=1"])


def launcher_env() -> dict[str, str]:
    # A launcher whose partner never starts waits DEEPSPEED_TIMEOUT minutes (default 10) for it: fail sooner.
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1",
            "DEEPSPEED_TIMEOUT": "2"}


def assert_trained_like(run_dir: Path, reference: Path) -> None:
    """Finished at STEPS with world size 2 (both ranks wrote their share), every step once, the reference's losses
    and validation losses to 1e-5, and the same global samples in every step."""
    marker = checkpoint_dirs.read_complete_marker(run_dir / checkpoint_dirs.CHECKPOINTS_DIR /
                                                  checkpoint_dirs.step_tag(STEPS))
    assert (marker["step"], marker["world_size"], marker["stopped_by"]) == (STEPS, 2, "completed")
    steps = [row["step"] for row in metrics(run_dir) if row.get("loss") is not None]
    assert steps == list(range(1, STEPS + 1))  # every step once
    losses, expected = train_losses(run_dir), train_losses(reference)
    assert sorted(expected) == steps
    for each in steps:
        assert losses[each] == pytest.approx(expected[each], rel=RELATIVE_TOLERANCE), each

    def validation(run: Path) -> dict[int, float]:
        return {row["step"]: row["val_loss"] for row in metrics(run) if row.get("val_loss") is not None}

    assert validation(run_dir).keys() == validation(reference).keys() == {10, 20, 30, 40}
    for each, loss in validation(run_dir).items():
        assert loss == pytest.approx(validation(reference)[each], rel=RELATIVE_TOLERANCE), each
    assert read_sample_indices(run_dir) == read_sample_indices(reference)


@pytest.mark.slow  # real multi-process training runs
def test_two_launchers_with_no_ssh_train_like_one_launcher_with_two_ranks(config: Path, uninterrupted: Path,
                                                                          tmp_path: Path) -> None:
    """`deepspeed --no_ssh --node_rank R` once per "node" (one rank each) reading a two-line hostfile: the run of
    one launcher with both ranks."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(HOSTFILE)
    port, run_dir = free_port(), tmp_path / "run"
    deepspeed = Path(sys.executable).with_name("deepspeed")
    executable = [str(deepspeed)] if deepspeed.exists() else [sys.executable, "-m", "deepspeed.launcher.runner"]
    launchers = []
    for node_rank in (0, 1):
        command = [*executable, "--hostfile", str(hostfile), "--num_nodes", "2", "--num_gpus", "1", "--no_ssh",
                   "--node_rank", str(node_rank), "--master_addr", "127.0.0.1", "--master_port", str(port),
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
    step_dir = run_dir / checkpoint_dirs.CHECKPOINTS_DIR / checkpoint_dirs.step_tag(STEPS)
    for rank in (0, 1):  # each rank saves its RNG state and its ZeRO-1 optimizer partition
        assert (step_dir / f"rng_state_rank{rank:05d}.pt").is_file()
        assert len(list(step_dir.glob(f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))) == 1
    assert_trained_like(run_dir, uninterrupted)


def sbatch_directives(text: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH (--[\w-]+)(?:=(\S+))?$", text, flags=re.M))


@pytest.mark.slow  # real multi-process training runs
def test_signal_saves_on_every_rank_requeues_and_the_next_allocation_resumes(config: Path, uninterrupted: Path,
                                                                            tmp_path: Path) -> None:
    directives = sbatch_directives(SLURM_SCRIPT.read_text())
    # the step variant of --signal (no "B:"): SLURM signals the step's processes, the ranks among them
    assert re.fullmatch(r"TERM@(\d+)", directives["--signal"]) and int(directives["--signal"][5:]) >= 120
    assert "--requeue" in directives and directives["--open-mode"] == "append"

    stand_ins = install_stand_ins(tmp_path / "bin")
    run_dir, output_file, requeues = tmp_path / "run", tmp_path / "job.out", tmp_path / "requeues"
    path = os.pathsep.join([str(stand_ins), str(Path(sys.executable).parent), os.environ["PATH"]])
    env = {**launcher_env(), "PATH": path, "SLURM_JOB_ID": JOB_ID, "SLURM_JOB_NODELIST": "127.0.0.1,localhost",
           "SLURM_NNODES": "2",
           "SLURM_GPUS_PER_NODE": "cpu:1", "SLURM_CPUS_ON_NODE": "2", "HOSTFILE": str(tmp_path / "hostfile"),
           "SRUN_OPTIONS_FILE": str(tmp_path / "srun_options"), "SRUN_LOG_FILE": str(tmp_path / "srun.log"),
           "SRUN_PID_FILE": str(tmp_path / "srun.pid"), "SCONTROL_REQUEUE_FILE": str(requeues),
           "WAIT_FOR_LOCK": "30"}

    def allocation(restart_count: int, signal_after_steps: int | None) -> int:
        """One run of the batch script as SLURM starts it (output appended to the job's file); with
        ``signal_after_steps``, the time limit's warning once that many steps are logged, and again (scancel after
        the warning) while the ranks are stopping and each node's task waits for their save."""
        (tmp_path / "srun.pid").unlink(missing_ok=True)
        with output_file.open("a") as output:
            job = subprocess.Popen(["bash", str(SLURM_SCRIPT), "--config", str(config), "--run-dir", str(run_dir)],
                                   cwd=REPO, env={**env, "SLURM_RESTART_COUNT": str(restart_count),
                                                  "MASTER_PORT": str(free_port()), STOP_LINGER_ENV: "60"},
                                   stdout=output, stderr=subprocess.STDOUT)
            try:
                if signal_after_steps is not None:
                    deadline = time.monotonic() + 300
                    while not (run_dir / "metrics.jsonl").is_file() or len(train_losses(run_dir)) < signal_after_steps:
                        assert job.poll() is None and time.monotonic() < deadline, output_file.read_text()[-4000:]
                        time.sleep(0.05)
                    srun = int((tmp_path / "srun.pid").read_text())
                    os.kill(srun, signal.SIGUSR1)
                    while output_file.read_text().count("waiting up to") < 2:  # both nodes' run_lock waits
                        assert job.poll() is None and time.monotonic() < deadline, output_file.read_text()[-4000:]
                        time.sleep(0.05)
                    time.sleep(1.5)  # past the launcher's copy of the first signal
                    os.kill(srun, signal.SIGUSR1)  # the second SIGTERM to every process of the step
                return job.wait(timeout=300)
            finally:
                if job.poll() is None:
                    job.kill()

    code = allocation(0, signal_after_steps=3)
    log = output_file.read_text()
    assert code == 143, log[-4000:]
    assert requeues.read_text().split() == [JOB_ID], log[-4000:]
    stopped = checkpoint_dirs.latest_complete(run_dir / checkpoint_dirs.CHECKPOINTS_DIR)
    assert stopped is not None, log[-4000:]
    marker = checkpoint_dirs.read_complete_marker(stopped)
    step = marker["step"]
    assert 3 <= step < STEPS and (marker["world_size"], marker["stopped_by"]) == (2, "signal")
    for rank in (0, 1):  # every rank saved its share
        assert (stopped / f"rng_state_rank{rank:05d}.pt").is_file()
        assert len(list(stopped.glob(f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))) == 1
    assert max(train_losses(run_dir)) == step  # no step past the signal is lost: the last one trained is saved
    assert f"{run_dir}: stopped by SIGTERM at step {step}" in log  # node_task.sh's wait, on both nodes
    assert (tmp_path / "srun.log").read_text().count("--signal: SIGTERM to ") == 2
    assert log.count("run_lock: SIGTERM received; still waiting for the run") == 2  # and went on waiting
    assert "KillWait over" not in (tmp_path / "srun.log").read_text()
    # the job's layout: its hostfile, srun's options, each task's own SLURM_NODEID reaching its launcher
    assert (tmp_path / "hostfile").read_text() == "127.0.0.1 slots=1\nlocalhost slots=1\n"
    assert (tmp_path / "srun_options").read_text().split() == [
        "--ntasks-per-node=1", "--cpus-per-task=2", "--kill-on-bad-exit=1"]
    for node_rank in (0, 1):
        assert f"nnodes=2, num_local_procs=1, node_rank={node_rank}" in log
    assert STARTUP in log
    assert "requeueing job 4242" in log

    code = allocation(1, signal_after_steps=None)
    log = output_file.read_text()
    assert code == 0, log[-4000:]
    assert requeues.read_text().split() == [JOB_ID]  # completed: no second requeue
    assert "allocation 1 of job 4242" in log and "allocation 2 of job 4242" in log  # one output file, appended
    assert f"resumed from {stopped} at step {step}" in log
    assert_trained_like(run_dir, uninterrupted)


def torchrun(config: Path, run_dir: Path) -> list[str]:
    executable = Path(sys.executable).with_name("torchrun")
    launcher = [str(executable)] if executable.exists() else [sys.executable, "-m", "torch.distributed.run"]
    return [*launcher, "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--shutdown-timeout", "600",
            str(REPO / "train.py"), "--config", str(config), "--run-dir", str(run_dir)]


@pytest.mark.slow
def test_torchrun_trains_like_deepspeed_and_saves_on_sigterm(config: Path, uninterrupted: Path, tmp_path: Path) -> None:
    """torchrun (torch.distributed.elastic) answers SIGTERM by sending it on to each worker's process group, waiting
    up to --shutdown-timeout seconds (default 30) for them, SIGKILLing any still alive, and exiting 1 with a
    SignalException traceback: the run's own code comes from run_lock, 143, with the signal's checkpoint complete.
    Up to that step the losses, validation loss and samples are those of the deepspeed launcher's run."""
    reference = uninterrupted
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    run_dir = tmp_path / "torchrun"

    launcher = subprocess.Popen(torchrun(config, run_dir), cwd=REPO, env={**env, STOP_LINGER_ENV: "60"}, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "metrics.jsonl").is_file() or len(train_losses(run_dir)) < TORCHRUN_SIGNAL_AFTER_STEPS:
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[0][-4000:]
            time.sleep(0.05)
        launcher.send_signal(signal.SIGTERM)  # torchrun alone: each worker leads a process group of its own
        time.sleep(2)
        launcher.send_signal(signal.SIGTERM)  # again while its workers stop: it signals them again and waits again
        output = launcher.communicate(timeout=300)[0]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    # torchrun waited for its workers, then exited 1 on its SignalException; the run's code comes from its lock
    assert launcher.returncode == 1 and "SignalException" in output, output[-4000:]
    waited = subprocess.run([sys.executable, "-m", "megatron_lite.training.run_lock", str(run_dir)], cwd=REPO,
                            env=env, text=True, capture_output=True, timeout=120)
    # the run finished its stop whole despite the second signal: its own lock released, its loss curve drawn
    assert "taking over" not in waited.stderr and (run_dir / "loss_curve.png").is_file(), waited.stderr + output[-3000:]
    stopped = checkpoint_dirs.latest_complete(run_dir / checkpoint_dirs.CHECKPOINTS_DIR)
    assert stopped is not None, output[-4000:]
    marker = checkpoint_dirs.read_complete_marker(stopped)
    step = marker["step"]
    assert waited.returncode == 143, waited.stdout + waited.stderr
    assert f"{run_dir}: stopped by SIGTERM at step {step}" in waited.stdout
    assert TORCHRUN_SIGNAL_AFTER_STEPS <= step < STEPS and (marker["world_size"], marker["stopped_by"]) == (2, "signal")
    for rank in (0, 1):  # both ranks saved their share
        assert (stopped / f"rng_state_rank{rank:05d}.pt").is_file()
        assert len(list(stopped.glob(f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))) == 1
    assert STARTUP in output
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
