"""Every random-number state a training step can draw from, captured at a step boundary and restored on
resume, per rank: torch's CPU generator, this rank's CUDA generator, numpy's and Python's global
generators, and DeepSpeed's CUDA RNG tracker (its activation checkpointing's model-parallel streams).

Data loaders never draw from these: they carry their own seeded generators (``data.loader.loader_generator``),
so building or iterating one (training's, each evaluation's) leaves the streams a step uses untouched.
The state is kept in plain tensors, ints and lists so that ``safe_load`` (weights_only) reads it back.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture(device: torch.device) -> dict[str, Any]:
    """This rank's generators' states now."""
    keys, position, has_gauss, cached_gaussian = np.random.get_state()[1:]
    version, python_state, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
        "python": [version, list(python_state), gauss_next],
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
        tracker = _deepspeed_cuda_tracker()
        if tracker is not None:
            state["deepspeed_cuda_tracker"] = tracker.get_states()
    return state


def restore(state: dict[str, Any], device: torch.device) -> None:
    """Set the generators ``state`` holds (older checkpoints hold torch's, and CUDA's, only)."""
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        saved = state["numpy"]
        np.random.set_state(("MT19937", saved["keys"].numpy().astype(np.uint32), saved["position"],
                             saved["has_gauss"], saved["cached_gaussian"]))
    if "python" in state:
        version, python_state, gauss_next = state["python"]
        random.setstate((version, tuple(python_state), gauss_next))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
        tracker = _deepspeed_cuda_tracker()
        if tracker is not None and "deepspeed_cuda_tracker" in state:
            tracker.set_states(state["deepspeed_cuda_tracker"])


def seed_new_rank(seed: int, rank: int, step: int) -> None:
    """Seed every generator of a rank that has no saved state (a resume on more ranks than saved) from
    (seed, rank, step): reproducible, and distinct per rank and per resume point."""
    derived = int(np.random.SeedSequence([seed, rank, step]).generate_state(1)[0])
    torch.manual_seed(derived)  # the CPU and every CUDA generator
    np.random.seed(derived)
    random.seed(derived)


def _deepspeed_cuda_tracker() -> Any:
    """DeepSpeed's activation-checkpointing CUDA RNG tracker, or None where DeepSpeed lacks it."""
    try:
        from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker
    except ImportError:
        return None
    return get_cuda_rng_tracker()
