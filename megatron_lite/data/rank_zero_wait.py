"""Ranks other than 0 wait for rank 0's data build, however long it takes, without a collective timeout.

On a fresh machine rank 0 tokenises the mix (hours for the paper's ~56B tokens) and builds the sample index
(minutes) while the other ranks wait. A collective of the training process group would give up at its timeout
(DeepSpeed's ``DEEPSPEED_TIMEOUT``, 10 minutes by default; NCCL then aborts the job). So every rank meets in an
all-reduce of a gloo group made for this, with a timeout of ``WAIT_TIMEOUT``, polled (every millisecond at first,
then less often, up to every 50 ms: a start that builds nothing loses milliseconds, a long wait costs 20 cheap checks a second); the first
waiting rank of each host prints "waiting for rank 0 to build data/cache/...: N min" every minute. The
all-reduce carries whether rank 0's build failed, so every rank stops with it; a rank 0 that dies closes its gloo
connections and the waiting ranks stop at once.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

WAIT_TIMEOUT = timedelta(days=3)
FIRST_POLL_SECONDS, POLL_SECONDS = 0.001, 0.05
LINE_SECONDS = 60.0

_GROUP: dict[str, Any] = {}  # "world" -> the default group it was made for, "group" -> the gloo group


def _patient_group() -> Any:
    """The gloo group with the long timeout (one per process group; every rank must make it at the same point,
    so it is made before rank 0 starts building); None with one rank or no process group."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    world = dist.group.WORLD
    if _GROUP.get("world") is not world:  # first use, or a new process group (in-process runs one after another)
        _GROUP["group"] = dist.new_group(backend="gloo", timeout=WAIT_TIMEOUT)
        _GROUP["world"] = world
    return _GROUP["group"]


class RankZeroBuild:
    """Made on every rank before rank 0 builds ``what``; ``failed_anywhere`` on every rank after it."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.group = _patient_group()

    def failed_anywhere(self, failed: bool) -> bool:
        """Wait for every rank (rank 0's build included); True when any rank reports ``failed``."""
        flag = torch.tensor([1.0 if failed else 0.0], dtype=torch.float64)
        if self.group is None:
            return failed
        work = dist.all_reduce(flag, group=self.group, async_op=True)
        rank = dist.get_rank()
        speaks = rank != 0 and (rank == 1 or int(os.environ.get("LOCAL_RANK", "-1")) == 0)
        start = time.monotonic()
        next_line = start + LINE_SECONDS
        poll = FIRST_POLL_SECONDS
        while not work.is_completed():
            time.sleep(poll)
            poll = min(2 * poll, POLL_SECONDS)
            if speaks and time.monotonic() >= next_line:
                minutes = round((time.monotonic() - start) / 60)
                print(f"waiting for rank 0 to build {self.what}: {minutes} min", file=sys.stderr, flush=True)
                next_line += LINE_SECONDS
        try:
            work.wait()
        except RuntimeError as error:  # rank 0 gone (gloo: "Connection closed by peer"), or WAIT_TIMEOUT
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise ValueError(f"waiting for rank 0 to build {self.what}: {reason}") from None
        return flag.item() > 0
