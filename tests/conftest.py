"""Shared tiny-model builders (CPU, seconds)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_lite import config as config_lib
from megatron_lite.config import Config

# (scheme, constraint) pairs covering every position scheme.
SCHEMES = [
    ("none", "slack"),
    ("learned", "slack"),
    ("sinusoidal", "slack"),
    ("alibi", "slack"),
    ("rope", "slack"),
    ("coca", "slack"),
    ("coca", "strict"),
]
SCHEME_IDS = ["none", "learned", "sinusoidal", "alibi", "rope", "coca_slack", "coca_strict"]
ROTARY_SCHEMES = [s for s in SCHEMES if s[0] in ("rope", "coca")]
ROTARY_IDS = ["rope", "coca_slack", "coca_strict"]
SHARED_MEMORY = Path("/dev/shm")
DEEPSPEED_SHM_BUFFERS = "deepspeed_allreduce_buffer_*"  # DeepSpeed's CPU all-reduce buffers (~67 MB each)

# Tiny models gain nothing from intra-op threads, and on a 2-core machine a second thread spins against
# every other busy process (a tiny overfit test: 12 s with 2 threads beside one busy process, 1.3 s with 1).
# The environment variable carries the setting into the tools and train.py runs the tests start.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

# dev/ (the instruments that predict GPU figures on a CPU) is not installed: its tests import it from the checkout,
# appended so that the installed megatron_lite stays the one imported
if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parents[1]))


def run_single_rank_worker(test_file: str, argument: str, **environment: str) -> Any:
    """Run ``python test_file argument`` as a fresh one-rank process (no launcher's rank variables, one thread,
    the repository as working dir) and return the JSON its last stdout line holds; a failure shows its stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **environment}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, test_file, argument], capture_output=True, text=True, timeout=600,
                          env=env, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session", autouse=True)
def _remove_leaked_deepspeed_buffers() -> Iterator[None]:
    """Multi-rank CPU runs leave DeepSpeed's shared-memory all-reduce buffers in /dev/shm (never unlinked,
    and a killed rank cannot): ~14 per suite run, ~0.9 GB of RAM. Remove the ones this test run created."""
    before = set(SHARED_MEMORY.glob(DEEPSPEED_SHM_BUFFERS))
    yield
    for leaked in set(SHARED_MEMORY.glob(DEEPSPEED_SHM_BUFFERS)) - before:
        leaked.unlink(missing_ok=True)


def tiny_config(
    scheme: str = "coca", constraint: str = "slack", backend: str = "sdpa", precision: str = "fp32", **model_overrides
) -> Config:
    """2 layers, width 64, 4 heads, training length 16, vocab 256 (padded to 256)."""
    model = {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "seq_length": 16,
        "max_position_embeddings": 128,
        "vocab_size": 250,
        "make_vocab_size_divisible_by": 128,
        "position": {"scheme": scheme, "constraint": constraint, "rotary_pct": 1.0},
        "attention": {"backend": backend, "chunk_size": 16},
    }
    for key, value in model_overrides.items():
        node = model
        *parents, leaf = key.split(".")
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    return config_lib.from_dict({"model": model, "seed": 7, "precision": precision})


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def training_corpus(tmp_path_factory: pytest.TempPathFactory):
    """(mix file, data cache dir) of a tiny 75/25 corpus, tokenised once per test run."""
    from training_helpers import make_corpus, tiny_train_config

    from megatron_lite.data.preprocess import prepare_data

    root = tmp_path_factory.mktemp("training_corpus")
    mix, cache = make_corpus(root / "corpus"), root / "cache"
    config = config_lib.from_dict(tiny_train_config(mix, cache))
    prepare_data(config.data, config.model.vocab_size, progress=False)
    return mix, cache
