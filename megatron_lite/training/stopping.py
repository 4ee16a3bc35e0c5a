"""When a run stops early or moves to its next stage: the stop policies asked after each step, and the
SIGTERM/SIGINT flag they read.

A step ends in two halves, both decided here: after the optimizer update (``after_update``: too many
non-finite losses in a row stop the run before anything else happens) and, once the step's evaluation
and checkpoint are done, after the save (``after_save``: failed saves, then train.exit_interval or a
signal, then a stage boundary). ``step_end`` says in between whether a checkpoint is due.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from megatron_lite.config import TrainConfig
from megatron_lite.training.distributed import all_reduce_sum


class Action(Enum):
    CONTINUE = "continue"
    STOP = "stop"
    NEXT_STAGE = "next_stage"  # the step ended a stage that is not the last: the next one starts from its checkpoint


@dataclass(frozen=True)
class Decision:
    action: Action
    stopped_by: str = ""  # when STOP: "nonfinite" | "failed_saves" | "final_save_failed" | "exit_interval" | "signal"
    message: str = ""  # when STOP: the console line saying why and how to resume
    names_last_good: bool = False  # a failure stop: the run's checkpoint to report is ``last_good``, not its last save
    last_good: Path | None = None  # the latest complete checkpoint on disk when the failure stop was decided


CONTINUE = Decision(Action.CONTINUE)
NEXT_STAGE = Decision(Action.NEXT_STAGE)


@dataclass(frozen=True)
class StepEnd:
    """What the end of step ``step`` holds before its evaluation and save."""

    step: int
    last: bool  # the run's final step
    requested_stop: Decision | None  # train.exit_interval or a signal: saved, then stopped
    boundary: bool  # the step ends a stage that is not the last
    save: bool  # a checkpoint is due: train.save_interval, the final step (train.save_final), a requested stop or a
    # stage boundary


class StopPolicies:
    """The run's stop policies, asked after every step.

    * ``train.max_consecutive_nonfinite`` non-finite (skipped) updates in a row stop the run;
    * ``train.max_consecutive_failed_saves`` failed checkpoint saves in a row stop it, and so does a failed save at a
      stage boundary (the next stage starts from that checkpoint);
    * a failed save that the run's end depends on (the final step's, or a requested stop's) stops it as
      ``final_save_failed``, naming the last complete checkpoint, never as completed;
    * ``train.exit_interval`` (except at the final step) and a signal (on any rank) stop it after saving;
    * a stage's last step, unless it is the run's, moves to the next stage.

    ``last_good`` looks up the latest complete checkpoint on disk, named by the failure stops.
    """

    def __init__(self, train: TrainConfig, total_steps: int, stage_ends: Collection[int],
                 last_good: Callable[[], Path | None]) -> None:
        self.train = train
        self.total_steps = total_steps
        self.stage_ends = sorted(stage_ends)  # each stage's final step; the last one is total_steps
        self.last_good = last_good
        self.consecutive_nonfinite = 0
        self.consecutive_failed_saves = 0

    def after_update(self, step: int, finite: bool) -> Decision:
        """``step`` (counted from 1) was taken, or skipped when some rank's loss was not ``finite``."""
        self.consecutive_nonfinite = 0 if finite else self.consecutive_nonfinite + 1
        if finite or self.consecutive_nonfinite < self.train.max_consecutive_nonfinite:
            return CONTINUE
        last_good = self.last_good()
        return Decision(Action.STOP, "nonfinite",
                        f"stopping: {self.consecutive_nonfinite} consecutive non-finite losses, the last at step {step}; "
                        f"last good checkpoint: {last_good or 'none'} (resume with --resume {last_good} after fixing the "
                        "cause, e.g. a lower train.lr)", names_last_good=True, last_good=last_good)

    def step_end(self, step: int, signal_name: str | None) -> StepEnd:
        """``signal_name``: the signal some rank received (``StopRequest.received``), else None."""
        last = step == self.total_steps
        boundary = step in self.stage_ends and not last
        requested_stop = None
        if not last and self.train.exit_interval and step % self.train.exit_interval == 0:
            requested_stop = Decision(Action.STOP, "exit_interval",
                                      f"stopped by train.exit_interval at step {step}; resume with --resume auto")
        elif signal_name is not None:
            requested_stop = Decision(Action.STOP, "signal",
                                      f"stopped by {signal_name} at step {step}; resume with --resume auto")
        interval = bool(self.train.save_interval) and step % self.train.save_interval == 0
        return StepEnd(step, last, requested_stop, boundary,
                       save=interval or (last and self.train.save_final) or requested_stop is not None or boundary)

    def after_save(self, end: StepEnd, saved: bool) -> Decision:
        """``saved``: whether the checkpoint due at ``end`` (if one was) was written; every rank agrees."""
        if end.save:
            self.consecutive_failed_saves = 0 if saved else self.consecutive_failed_saves + 1
            if self.consecutive_failed_saves >= self.train.max_consecutive_failed_saves:
                last_good = self.last_good()
                return Decision(Action.STOP, "failed_saves",
                                f"stopping: {self.consecutive_failed_saves} consecutive checkpoint saves failed, the "
                                f"last at step {end.step}; last good checkpoint: {last_good or 'none'} (free disk "
                                "space or fix the cause, then resume with --resume auto)",
                                names_last_good=True, last_good=last_good)
            if end.boundary and not saved:
                stage_number = self.stage_ends.index(end.step) + 1
                return Decision(Action.STOP, "failed_saves",
                                f"stopping: the checkpoint at the end of stage {stage_number} (step {end.step}) failed, "
                                "and the next stage starts from it; free disk space or fix the cause, then resume "
                                "with --resume auto")
        if end.save and not saved and (end.last or end.requested_stop is not None):
            last_good = self.last_good()
            ending = "the run's final step" if end.last else f"a stop ({end.requested_stop.stopped_by})"
            return Decision(Action.STOP, "final_save_failed",
                            f"stopping: the checkpoint at step {end.step}, {ending}, failed: steps after "
                            f"{_step_of(last_good)} are in no checkpoint; last complete checkpoint: "
                            f"{last_good or 'none'} (free disk space or fix the cause, then resume with --resume auto to redo them)",
                            names_last_good=True, last_good=last_good)
        if end.requested_stop is not None:
            return end.requested_stop
        return NEXT_STAGE if end.boundary else CONTINUE


def _step_of(step_dir: Path | None) -> str:
    from megatron_lite.checkpoint_dirs import checkpoint_step

    step = checkpoint_step(step_dir) if step_dir is not None else None
    return f"step {step}" if step is not None else "the start"


# Test hook: a requested stop lingers before its save (every rank) until this process gets another signal, at most
# this many seconds, so that a test's second signal surely lands inside the stop, as a scheduler's may during a
# large model's save. Copies of the first signal within a second of it (a launcher passing it on) do not count.
STOP_LINGER_ENV = "MEGATRON_LITE_TEST_STOP_LINGER_SECONDS"
_SAME_SIGNAL_SECONDS = 1.0


class StopRequest:
    """SIGTERM/SIGINT set a flag the loop checks after each step (all ranks agree via all-reduce);
    a second SIGINT interrupts at once. The first signal is the one reported: on Ctrl-C the deepspeed launcher
    sends its ranks a SIGTERM of its own right after the SIGINT they got from the terminal.

    A second SIGTERM never shortens the stop: a scheduler may signal again (scancel after the time limit's
    warning, a batch shell signalled too) while the stop's checkpoint is written. Inside the block it is only
    noted; once a stop was requested, leaving the block ignores SIGTERM for the rest of the process, whose
    remaining work is the closing metrics row, the loss curve and releasing the run lock (then exit 143)."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._times: list[float] = []  # time.monotonic() of each signal received
        self._previous: dict[int, Any] = {}
        self._linger = float(os.environ.get(STOP_LINGER_ENV) or 0)

    def __enter__(self) -> StopRequest:
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self._times.append(time.monotonic())
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt

    def received(self, on_any_rank: bool) -> str | None:
        """The signal to report when the ranks agree that one of them received one."""
        if not on_any_rank:
            return None
        if self._linger and self._times:  # the test hook, once: the stop's save waits for another signal
            deadline = time.monotonic() + self._linger
            while self._times[-1] - self._times[0] < _SAME_SIGNAL_SECONDS and time.monotonic() < deadline:
                time.sleep(0.01)
            self._linger = 0.0
        return self.signal_name or "a signal on another rank"

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            stopping = signum == signal.SIGTERM and self.signal_name is not None
            signal.signal(signum, _ignore if stopping else handler)


def _ignore(signum: int, frame: Any) -> None:
    """A SIGTERM after a stop was requested. A handler of our own rather than SIG_IGN, which processes started
    later would inherit."""


class EvaluationInterrupted(Exception):
    """Some rank received a stop signal during an evaluation: its row is dropped and the step's checkpoint saved."""


def evaluation_interrupt_check(stop: StopRequest, device: torch.device, world_size: int,
                               inject_sigterm: bool = False) -> Callable[[], None]:
    """What an evaluation calls before each batch: raises ``EvaluationInterrupted`` once some rank has received a
    stop signal. With several ranks that is one all-reduce per batch, which is safe because every rank runs every
    evaluation batch (``ValidationShare``, ``ExtrapolationEval``) and so asks equally often.

    ``inject_sigterm`` (train.fault_injection.sigterm_during_evaluation_step, on rank 0): the first call sends this
    process a real SIGTERM first, as a scheduler's stop arriving mid-evaluation."""
    pending_injection = inject_sigterm

    def check() -> None:
        nonlocal pending_injection
        if pending_injection:
            pending_injection = False
            os.kill(os.getpid(), signal.SIGTERM)  # the handler has run when os.kill returns (same thread)
        signalled_here = stop.signal_name is not None
        if world_size > 1:
            signalled_here = all_reduce_sum([float(signalled_here)], device)[0] > 0
        if signalled_here:
            raise EvaluationInterrupted

    return check
