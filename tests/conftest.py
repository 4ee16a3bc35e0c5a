"""Shared tiny-model builders (CPU, seconds)."""

from __future__ import annotations

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
    """(mix file, data cache dir) of a tiny 75/25 corpus, tokenised once per session."""
    from training_helpers import make_corpus, tiny_train_config

    from megatron_lite.data.preprocess import prepare_data

    root = tmp_path_factory.mktemp("training_corpus")
    mix, cache = make_corpus(root / "corpus"), root / "cache"
    config = config_lib.from_dict(tiny_train_config(mix, cache))
    prepare_data(config.data, config.model.vocab_size, progress=False)
    return mix, cache
