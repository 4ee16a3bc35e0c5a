"""Ranks other than 0 wait for rank 0's data build past the process group's collective timeout: the sample index
(two real gloo ranks, a 1 s timeout, a 2 s build) and the whole first start (the deepspeed launcher, 2 CPU ranks,
DEEPSPEED_TIMEOUT=1 minute, a data build slowed past it)."""

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
import torch.distributed as dist

from megatron_lite.data import blend
from megatron_lite.data.cache_lock import SLOW_BUILD_ENV
from training_helpers import make_corpus, metrics, run_train, tiny_train_config, write_config

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


@pytest.mark.slow
def test_a_first_start_outlasts_the_collective_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's launch on a fresh cache, shrunk: rank 0 builds the data for longer than DeepSpeed's process
    group timeout (1 minute, its smallest) while rank 1 waits; the run trains, and rank 1 said it was waiting."""
    mix = make_corpus(tmp_path / "corpus")
    config = write_config(tmp_path / "tiny.yml", tiny_train_config(
        mix, tmp_path / "cache", train_iters=2, eval_interval=0, save_interval=0, save_final=False))
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "1")
    monkeypatch.setenv(SLOW_BUILD_ENV, "62")
    result = run_train(config, tmp_path / "run", ranks=2, timeout=400)
    assert [row["step"] for row in metrics(tmp_path / "run") if row.get("loss") is not None] == [1, 2]
    assert f"waiting for rank 0 to build {tmp_path / 'cache'}: 1 min" in result.stdout + result.stderr
