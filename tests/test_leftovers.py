"""What a killed or damaged earlier run leaves behind is cleaned up or rebuilt by the next one, and named: a
universal conversion's staging folder, a truncated data shard, a garbage cached tokenizer."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch

from megatron_lite import config as config_lib
from megatron_lite.console import Notice
from megatron_lite.convert.universal import conversion_lock
from megatron_lite.training.checkpointing import plan_resume
from megatron_lite.training.distributed import DistributedInfo

ONE_RANK = DistributedInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def _notices(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(warning.message) for warning in caught if issubclass(warning.category, Notice)]


# ----------------------------------------------------------------------------------------------
# A universal conversion killed before its rename


def test_a_resume_removes_the_staging_folder_of_a_killed_conversion_but_not_a_running_ones(tmp_path: Path) -> None:
    """A resume on the saved number of ranks converts nothing, yet removes the staging folder a killed conversion
    left in the step dir (with one notice naming it); while a conversion of the step dir runs (it holds the step
    dir's lock) the folder is its own and stays."""
    step_dir = tmp_path / "checkpoints" / "step_00000004"
    staging = step_dir / ".universal.partial-4242"
    (staging / "universal" / "zero").mkdir(parents=True)
    (staging / "universal" / "zero" / "optimizer_state.pt").write_bytes(b"\0" * 300_000)
    (staging / "source").mkdir()
    (staging / "source" / "mp_rank_00_model_states.pt").symlink_to(tmp_path)  # links to the step's files
    config = config_lib.Config()
    marker = {"step": 4, "world_size": 1, "zero_stage": config.train.zero_stage}

    with conversion_lock(step_dir), warnings.catch_warnings(record=True) as caught:  # a conversion running now
        warnings.simplefilter("always")
        assert not plan_resume(step_dir, marker, config, ONE_RANK).universal
    assert staging.is_dir() and _notices(caught) == []

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not plan_resume(step_dir, marker, config, ONE_RANK).universal
    assert not staging.exists() and tmp_path.is_dir()  # the link removed, not what it points to
    assert _notices(caught) == [f"{staging}: removed (0.3 MB), the staging folder of a universal conversion that "
                                "did not finish"]
