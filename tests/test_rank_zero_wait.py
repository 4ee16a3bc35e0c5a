"""Ranks other than 0 wait for rank 0's data build past the process group's collective timeout (two real gloo
ranks, a 1 s timeout): the sample index (a 2 s build) and the whole first data preparation of a run (tokenizer and
shards of a fresh cache, slowed to 3 s on rank 0), as train.py runs it."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_lite import config as config_lib
from megatron_lite.data import blend, rank_zero_wait
from megatron_lite.data.cache_lock import SLOW_BUILD_ENV
from megatron_lite.training.data import _prepare_on_rank0
from megatron_lite.training.distributed import DistributedInfo
from training_helpers import make_corpus, tiny_train_config

FORK = multiprocessing.get_context("fork")
COLLECTIVE_TIMEOUT = timedelta(seconds=1)
BUILD_SECONDS = 2.0  # twice the collective timeout


def _slow_build(fail: str) -> blend.BlendArrays:
    if fail == "dies":
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)  # a rank 0 killed mid-build (OOM killer, a node lost)
    time.sleep(BUILD_SECONDS)
    if fail == "raises":
        raise ValueError("source prose: no training tokens")
    return blend.BlendArrays({"blend_source": np.zeros(8, dtype=np.int16)}, {"split": "train"})


def _rank(rank: int, rendezvous: Path, root: Path, fail: str, results: Any) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2,
                            timeout=COLLECTIVE_TIMEOUT)
    try:
        index = blend.load_or_build(root, {"case": "slow"}, lambda: _slow_build(fail), is_builder=rank == 0)
        results.put((rank, f"index {len(index.arrays['blend_source'])}"))
    except Exception as error:  # noqa: BLE001 - the parent asserts on it
        results.put((rank, f"{type(error).__name__}: {error}"))
    results.close()
    results.join_thread()  # the result sent before the exit below
    os._exit(0)  # no teardown: a failed rank's peer may already be gone


def _two_ranks(tmp_path: Path, fail: str = "") -> dict[int, str]:
    results = FORK.Queue()
    ranks = [FORK.Process(target=_rank, args=(rank, tmp_path / "rendezvous", tmp_path / "index", fail, results))
             for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        return dict(results.get(timeout=60) for _ in ranks[fail == "dies":])
    finally:
        for process in ranks:
            process.join(10)


def test_ranks_wait_for_a_sample_index_slower_than_the_collective_timeout(tmp_path: Path) -> None:
    assert _two_ranks(tmp_path) == {0: "index 8", 1: "index 8"}


def test_a_failed_index_build_stops_every_rank_with_it(tmp_path: Path) -> None:
    outcome = _two_ranks(tmp_path, fail="raises")
    assert outcome[0] == "ValueError: source prose: no training tokens"
    assert outcome[1].startswith("ValueError: ") and "rank 0 could not build the sample index" in outcome[1]


def test_a_rank_0_killed_mid_build_stops_the_waiting_rank_at_once(tmp_path: Path) -> None:
    started = time.monotonic()
    outcome = _two_ranks(tmp_path, fail="dies")
    assert outcome[1].startswith(f"ValueError: waiting for rank 0 to build {tmp_path / 'index'}/"), outcome
    assert "\n" not in outcome[1] and time.monotonic() - started < 30


def _prepare_rank(rank: int, rendezvous: Path, config: config_lib.Config, results: Any) -> None:
    os.environ[SLOW_BUILD_ENV] = str(3 * COLLECTIVE_TIMEOUT.total_seconds())
    rank_zero_wait.LINE_SECONDS = 1.0  # the waiting line every second instead of every minute
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2,
                            timeout=COLLECTIVE_TIMEOUT)
    try:
        mix = _prepare_on_rank0(config, DistributedInfo(rank, rank, 2, torch.device("cpu")))
        results.put((rank, f"groups {sorted(mix.groups)}"))
    except Exception as error:  # noqa: BLE001 - the parent asserts on it
        results.put((rank, f"{type(error).__name__}: {error}"))
    results.close()
    results.join_thread()
    os._exit(0)


def test_a_first_start_outlasts_the_collective_timeout(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """The README's launch on a fresh cache, shrunk: rank 0 builds the data (tokenizer, shards) for three times the
    process group's timeout while rank 1 waits; both ranks go on, and rank 1 said it was waiting."""
    mix = make_corpus(tmp_path / "corpus")
    config = config_lib.from_dict(tiny_train_config(mix, tmp_path / "cache"))
    results = FORK.Queue()
    ranks = [FORK.Process(target=_prepare_rank, args=(rank, tmp_path / "rendezvous", config, results))
             for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        outcome = dict(results.get(timeout=120) for _ in ranks)
    finally:
        for process in ranks:
            process.join(10)
    assert outcome == {0: "groups ['code', 'text']", 1: "groups ['code', 'text']"}, outcome
    assert f"waiting for rank 0 to build {tmp_path / 'cache'}: " in capfd.readouterr().err
