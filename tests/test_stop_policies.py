"""The training loop's stop policies (megatron_lite/training/stopping.py), fed step outcomes without
DeepSpeed: non-finite losses, failed saves, train.exit_interval, signals, stage boundaries."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from megatron_lite.config import TrainConfig
from megatron_lite.training.stopping import Action, StopPolicies, StopRequest

LAST_GOOD = Path("run/checkpoints/step_00000004")


def _policies(total_steps: int = 20, stage_ends: tuple[int, ...] = (), **train: Any) -> StopPolicies:
    settings = {"save_interval": 0, "exit_interval": None, **train}
    return StopPolicies(TrainConfig(**settings), total_steps, stage_ends, last_good=lambda: LAST_GOOD)


def _run_step(policies: StopPolicies, step: int, signal_name: str | None = None, saved: bool = True) -> Action:
    """One whole step whose update was taken: its end, its (successful unless ``saved`` is False) save."""
    assert policies.after_update(step, finite=True).action is Action.CONTINUE
    return policies.after_save(policies.step_end(step, signal_name), saved).action


def test_nonfinite_losses_stop_the_run_at_the_limit_in_a_row() -> None:
    policies = _policies(max_consecutive_nonfinite=3)
    outcomes = [False, False, True, False, False]  # a finite step resets the count
    decisions = [policies.after_update(step, finite) for step, finite in enumerate(outcomes, start=1)]
    assert [decision.action for decision in decisions] == [Action.CONTINUE] * 5
    assert policies.consecutive_nonfinite == 2
    stop = policies.after_update(6, finite=False)
    assert stop.action is Action.STOP and stop.stopped_by == "nonfinite"
    assert stop.names_last_good and stop.last_good == LAST_GOOD
    assert stop.message.startswith("stopping: 3 consecutive non-finite losses, the last at step 6; "
                                   f"last good checkpoint: {LAST_GOOD}")


def test_consecutive_failed_saves_stop_at_train_max_consecutive_failed_saves() -> None:
    policies = _policies(save_interval=1, max_consecutive_failed_saves=2)
    assert _run_step(policies, 1, saved=False) is Action.CONTINUE
    assert _run_step(policies, 2, saved=True) is Action.CONTINUE  # a good save resets the count
    assert _run_step(policies, 3, saved=False) is Action.CONTINUE
    policies.after_update(4, finite=True)
    stop = policies.after_save(policies.step_end(4, None), saved=False)
    assert stop.action is Action.STOP and stop.stopped_by == "failed_saves"
    assert stop.names_last_good and stop.last_good == LAST_GOOD
    assert "2 consecutive checkpoint saves failed, the last at step 4" in stop.message


def test_steps_without_a_due_save_leave_the_failed_save_count_alone() -> None:
    policies = _policies(save_interval=2, max_consecutive_failed_saves=2)
    assert _run_step(policies, 2, saved=False) is Action.CONTINUE
    assert not policies.step_end(3, None).save
    assert _run_step(policies, 3, saved=False) is Action.CONTINUE  # nothing was due: not a failure
    assert policies.consecutive_failed_saves == 1
    assert _run_step(policies, 4, saved=False) is Action.STOP


def test_save_schedule() -> None:
    policies = _policies(total_steps=10, save_interval=4, exit_interval=3)
    due = [step for step in range(1, 11) if policies.step_end(step, None).save]
    assert due == [3, 4, 6, 8, 9, 10]  # the interval, each exit (saved before stopping) and the final step
    assert policies.step_end(5, "SIGTERM").save


def test_save_final_false_skips_only_the_final_steps_own_save() -> None:
    policies = _policies(total_steps=10, save_interval=4, save_final=False)
    assert [step for step in range(1, 11) if policies.step_end(step, None).save] == [4, 8]
    assert policies.step_end(10, "SIGTERM").save  # a requested stop still saves
    assert _policies(total_steps=8, save_interval=4, save_final=False).step_end(8, None).save  # the interval's
    assert _run_step(policies, 10) is Action.CONTINUE  # the run ends as completed, with no failed save


def test_exit_interval_stops_after_saving_but_not_at_the_final_step() -> None:
    policies = _policies(total_steps=8, exit_interval=4)
    assert [_run_step(policies, step) for step in (1, 2, 3)] == [Action.CONTINUE] * 3
    policies.after_update(4, finite=True)
    end = policies.step_end(4, None)
    stop = policies.after_save(end, saved=True)
    assert end.save and stop.action is Action.STOP and stop.stopped_by == "exit_interval"
    assert stop.message == "stopped by train.exit_interval at step 4; resume with --resume auto"
    assert not stop.names_last_good
    assert _run_step(policies, 8) is Action.CONTINUE  # the final step completes the run instead


def test_a_signal_stops_after_saving_even_at_the_final_step() -> None:
    policies = _policies(total_steps=5)
    assert _run_step(policies, 2) is Action.CONTINUE
    policies.after_update(3, finite=True)
    end = policies.step_end(3, "SIGTERM")
    stop = policies.after_save(end, saved=True)
    assert end.save and stop.action is Action.STOP and stop.stopped_by == "signal"
    assert stop.message == "stopped by SIGTERM at step 3; resume with --resume auto"
    final = policies.step_end(5, "a signal on another rank")
    assert policies.after_save(final, saved=True).stopped_by == "signal"


def test_the_exit_interval_is_the_reason_when_a_signal_arrives_at_the_same_step() -> None:
    policies = _policies(exit_interval=2)
    assert policies.step_end(2, "SIGINT").requested_stop.stopped_by == "exit_interval"


def test_a_stage_boundary_saves_and_starts_the_next_stage() -> None:
    policies = _policies(total_steps=9, stage_ends=(3, 6, 9))
    assert _run_step(policies, 2) is Action.CONTINUE
    end = policies.step_end(3, None)
    assert end.boundary and end.save
    assert policies.after_save(end, saved=True).action is Action.NEXT_STAGE
    assert _run_step(policies, 6) is Action.NEXT_STAGE
    last = policies.step_end(9, None)
    assert not last.boundary and last.last  # the last stage's end is the run's
    assert policies.after_save(last, saved=True).action is Action.CONTINUE


def test_a_failed_save_at_a_stage_boundary_stops_the_run() -> None:
    policies = _policies(total_steps=9, stage_ends=(3, 6, 9), max_consecutive_failed_saves=3)
    stop = policies.after_save(policies.step_end(6, None), saved=False)
    assert stop.action is Action.STOP and stop.stopped_by == "failed_saves" and not stop.names_last_good
    assert stop.message.startswith("stopping: the checkpoint at the end of stage 2 (step 6) failed")


def test_a_requested_stop_at_a_stage_boundary_stops_instead_of_starting_the_next_stage() -> None:
    policies = _policies(total_steps=9, stage_ends=(3, 6, 9))
    assert _run_step(policies, 3, signal_name="SIGTERM") is Action.STOP


def test_stop_request_records_the_signal_and_restores_the_handlers() -> None:
    outer = signal.getsignal(signal.SIGTERM)  # an earlier stop in this process may have left its own handler
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    previous = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with StopRequest() as stop:
        assert stop.received(on_any_rank=True) == "a signal on another rank"
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == previous  # no stop: as before
    try:
        with StopRequest() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.signal_name == "SIGTERM"
            os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM is only noted
            assert stop.received(on_any_rank=True) == "SIGTERM" and stop.received(on_any_rank=False) is None
            with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C interrupts at once
                os.kill(os.getpid(), signal.SIGINT)
        # a stop was requested: the process finishes it (closing row, lock) whatever SIGTERM comes next
        assert signal.getsignal(signal.SIGTERM) not in previous and signal.getsignal(signal.SIGINT) is previous[1]
        os.kill(os.getpid(), signal.SIGTERM)  # ignored
        # ... by a handler of the process's own, not SIG_IGN: a process started now gets SIGTERM's default
        child = subprocess.run([sys.executable, "-c", "import signal; print(int(signal.getsignal(signal.SIGTERM)))"],
                               capture_output=True, text=True, check=True)
        assert child.stdout.strip() == str(int(signal.SIG_DFL))
    finally:
        signal.signal(signal.SIGTERM, outer)
