"""How a checkpoint loads on this run's ranks (``checkpointing.plan_resume``), decided before DeepSpeed starts:
the cases that need no conversion and the one it refuses. The conversions themselves: test_universal_resume.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from megatron_lite.console import Notice
from megatron_lite.training.checkpointing import plan_resume
from megatron_lite.training.distributed import DistributedInfo

ONE_RANK = DistributedInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def with_zero(stage: int):  # type: ignore[no-untyped-def]
    config = tiny_config()
    return dataclasses.replace(config, train=dataclasses.replace(config.train, zero_stage=stage))


def test_the_same_world_size_loads_as_saved_without_a_word(tmp_path: Path, recwarn: pytest.WarningsRecorder) -> None:
    plan = plan_resume(tmp_path, {"world_size": 1, "zero_stage": 3}, with_zero(3), ONE_RANK)
    assert not plan.universal and plan.saved_world_size == 1 and not recwarn.list


def test_zero0_on_another_world_size_loads_as_saved_with_one_notice(tmp_path: Path) -> None:
    with pytest.warns(Notice) as caught:
        plan = plan_resume(tmp_path, {"world_size": 2, "zero_stage": 0}, with_zero(0), ONE_RANK)
    assert not plan.universal and len(caught) == 1
    assert str(caught[0].message) == (f"resuming {tmp_path} (saved by 2 rank(s)) on 1 rank(s): ZeRO 0 loads as "
                                      "saved; rank 0 continues its RNG stream")
    assert not (tmp_path / "universal").exists()


@pytest.mark.parametrize(("saved", "now"), [(0, 1), (2, 0), (1, 3)])
def test_another_zero_stage_with_another_world_size_is_one_line(tmp_path: Path, saved: int, now: int) -> None:
    with pytest.raises(ValueError, match=rf"train.zero_stage={now} but the checkpoint is ZeRO {saved}; on another "
                                         "number of ranks") as raised:
        plan_resume(tmp_path, {"world_size": 2, "zero_stage": saved}, with_zero(now), ONE_RANK)
    assert "\n" not in str(raised.value)
