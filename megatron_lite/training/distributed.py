"""Process-group setup for `deepspeed train.py` (launcher env) and plain `python train.py` (one rank)."""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistributedInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    # train.sequence_parallel_size P: consecutive ranks [g P, (g + 1) P) share data-parallel rank g's samples
    sequence_parallel_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_parallel_size(self) -> int:
        """The ranks that train on different samples: world / P."""
        return self.world_size // self.sequence_parallel_size

    @property
    def data_parallel_rank(self) -> int:
        return self.rank // self.sequence_parallel_size

    @property
    def sequence_parallel_rank(self) -> int:
        """Which slice of its samples' tokens this rank holds."""
        return self.rank % self.sequence_parallel_size


EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """A TCP port free on this host now, for a rendezvous of ranks started here, picked below the OS's ephemeral
    range: the port is bound seconds later, when the ranks are up, and meanwhile any outgoing connection (the gloo
    or NCCL links among other jobs' ranks make hundreds) may be given an ephemeral port, which a port the OS picked
    for ``bind(0)`` is. Below that range only another listener can take it."""
    first_ephemeral = 32768  # Linux's default lower bound
    try:
        first_ephemeral = int(EPHEMERAL_PORTS.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    if first_ephemeral > 10_000:
        candidates = range(max(1024, first_ephemeral - 12_000), first_ephemeral)
        # its own generator, seeded from the OS: jobs whose global RNG is seeded alike must not pick alike
        for port in random.Random().sample(candidates, k=min(64, len(candidates))):
            if _bindable(port):
                return port
    with socket.socket() as probe:  # no room below the range, or all taken: any port the OS gives
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


def single_process_env() -> None:
    """Without a launcher, deepspeed.init_distributed falls back to MPI discovery (and fails without
    mpi4py): describe a one-rank world on this host instead."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    _refuse_unlaunched_tasks()
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    # Port 0: the lone rank's store binds whatever port the OS gives it then. A port probed free beforehand can be
    # taken by another process before the bind (EADDRINUSE when runs start side by side); no other rank connects.
    os.environ.setdefault("MASTER_PORT", "0")


# Set in each task by a scheduler or MPI that started many copies of train.py without a torch launcher.
_TASK_COUNT_VARIABLES = ("SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def _refuse_unlaunched_tasks() -> None:
    """``srun -n 16 python train.py`` (or DeepSpeed's ``--launcher slurm``, or mpirun) starts many copies
    with no RANK/WORLD_SIZE: each would set up a one-rank world and train alone. One line instead."""
    for name in _TASK_COUNT_VARIABLES:
        value = os.environ.get(name, "1")
        if value.isdigit() and int(value) > 1:
            raise ValueError(f"{name}={value}: this is one of {value} tasks started without a torch launcher "
                             "(RANK/WORLD_SIZE unset), so each would train alone; start one `deepspeed --no_ssh "
                             "--node_rank N` per node instead (tools/slurm/train.sbatch, docs/run_at_scale.md)")


def init_distributed() -> DistributedInfo:
    import deepspeed

    from megatron_lite.training.jit_lock import watch_jit_locks

    single_process_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        _init_nccl_bound(local_rank)
    with watch_jit_locks():  # it JIT-builds DeepSpeed's CPU comm op once; a stale lock would hang it silently
        deepspeed.init_distributed()  # on CUDA it adopts the group made above
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        if "OMP_NUM_THREADS" not in os.environ:  # ranks on one host share its cores
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    return DistributedInfo(rank, local_rank, world_size, device)


def _init_nccl_bound(local_rank: int) -> None:
    """The NCCL process group with this rank's GPU bound (``device_id``), made before DeepSpeed's
    ``init_distributed``, which then adopts it (its path for a group the user initialised). DeepSpeed 0.19.8 binds
    the device itself only with more than one rank (deepspeedai/DeepSpeed#8248, a new_group failure on one
    GPU under WSL); unbound, torch warns "Guessing device ID based on global rank" and every barrier, DeepSpeed's
    and the data index's included, warns "barrier(): using the device under current context". Same backend and
    timeout as DeepSpeed's own (nccl, DEEPSPEED_TIMEOUT minutes)."""
    from deepspeed.constants import default_pg_timeout

    torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl", timeout=default_pg_timeout, device_id=torch.device("cuda", local_rank))


def all_reduce_sum(values: list[float] | torch.Tensor, device: torch.device) -> list[float]:
    """Sum a few floats (or a small tensor of them, read once) over all ranks in one collective (float64 so
    step counts stay exact)."""
    if isinstance(values, torch.Tensor):
        tensor = values.detach().to(device=device, dtype=torch.float64)
    else:
        tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor)
    return tensor.tolist()


def all_gather_objects(value: Any) -> list[Any]:
    """Every rank's ``value`` (picklable), in rank order, on every rank."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, value)
        return gathered
    return [value]


def shutdown_distributed() -> None:
    """Destroy the process group before the interpreter exits. Left to the interpreter's teardown, gloo's worker
    threads can still be joinable when their C++ objects are destroyed, and a rank dies with "terminate called
    without an active exception" (SIGABRT) after a finished run (seen in 2-rank CPU runs; pytorch/pytorch#190489).
    Only after a normal end that every rank reached (a failing rank must not wait on the others), and only where
    the process ends next (train.py): DeepSpeed does not set the group up again for a later run in the process."""
    if dist.is_initialized() and dist.get_world_size() > 1:  # one rank (plain python): nothing to race
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier(device_ids=barrier_device_ids())


def barrier_device_ids() -> list[int] | None:
    """NCCL: this rank's GPU (init_distributed made it current), so the barrier never guesses a device (torch
    warns when it has to, and guessing from the global rank hangs where ranks map to GPUs otherwise); None
    for gloo (CPU), which takes no device ids."""
    if dist.get_backend() == "nccl":
        return [torch.cuda.current_device()]
    return None
