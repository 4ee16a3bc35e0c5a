"""The run's checkpoint saves, at once or in the background (``train.async_save``), with their waits and failures.

A synchronous save writes every rank's files, then completes the checkpoint (``checkpoint_writes``). An
asynchronous one (``train.save_interval``'s checkpoints with ``train.async_save``) blocks the step loop only
while the states are copied to host memory; a thread on each rank writes, hashes and fsyncs them while the next
steps run. At each later step end the ranks agree (one small all-reduce) whether every writer has ended; the
first step end where all have completes the checkpoint, the same way a synchronous save does, and only then is it
logged as saved. One save at most is in flight: a save that falls due earlier, a stop, the run's end and a stage
boundary first wait for it (the log says how long). A writer that has not ended ``WRITE_TIMEOUT_S`` after its
save started fails the save, which never hangs the run. docs/checkpoints.md describes the guarantees.
"""

from __future__ import annotations

import copy
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_lite.config import Config
from megatron_lite.console import console
from megatron_lite.training import checkpoint_writes
from megatron_lite.training.checkpoint_writes import StepFiles
from megatron_lite.training.checkpointing import TrainingState
from megatron_lite.training.distributed import DistributedInfo, all_reduce_sum
from megatron_lite.training.engine import StagedEngine
from megatron_lite.training.stopping import CONTINUE, Action, Decision, StepEnd, StopPolicies

WRITE_TIMEOUT_S = 3600.0  # a background write still running this long after its save started has stopped answering


@dataclass
class _InFlight:
    """An asynchronous save whose files are being written."""

    end: StepEnd
    state: TrainingState  # the counters at the save (the loop's own go on)
    ending: dict[str, str] | None
    files: StepFiles
    writer: threading.Thread
    blocked_s: float  # how long the snapshot held the step loop


class Checkpointer:
    """Saves the checkpoints the stop policies ask for and reports each outcome back to them."""

    def __init__(self, staged: StagedEngine, run_dir: Path, config: Config, tokenizer_path: Path | None,
                 dist_info: DistributedInfo, policies: StopPolicies) -> None:
        self.staged, self.run_dir, self.config = staged, run_dir, config
        self.tokenizer_path, self.dist_info, self.policies = tokenizer_path, dist_info, policies
        self.asynchronous = config.train.async_save
        self.last_saved: Path | None = None  # the newest checkpoint this run completed
        self._in_flight: _InFlight | None = None
        if self.asynchronous and config.train.fault_injection.disk_full_save_steps:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a writer thread cannot set it: writes past the limit fail

    def after_step(self, end: StepEnd, state: TrainingState, ending: dict[str, str] | None) -> Decision:
        """The step end's save, if one is due (``end.save``), after completing the save in flight when every rank
        has written it (or, when a save is due, after waiting for it). What the stop policies decide."""
        decision = self._complete_in_flight(wait=end.save)
        if decision.action is Action.STOP or not end.save:
            return decision
        if self.asynchronous and not (end.last or end.boundary or end.requested_stop is not None):
            self._start(end, state, ending)
            return CONTINUE
        files = checkpoint_writes.prepare_step_dir(self.run_dir, state.step, self.dist_info)
        checkpoint_writes.write_files(files, self.staged.engine, state, self.config, self.dist_info)
        return self._commit(end, state, ending, files, None)

    def finish(self, decision: Decision) -> Decision:
        """The loop ended with ``decision``: the save in flight is waited for and completed; a stop its failure
        causes replaces a decision that is not a stop."""
        completed = self._complete_in_flight(wait=True)
        return decision if decision.action is Action.STOP or completed.action is not Action.STOP else completed

    def _start(self, end: StepEnd, state: TrainingState, ending: dict[str, str] | None) -> None:
        started = time.perf_counter()
        files = checkpoint_writes.prepare_step_dir(self.run_dir, state.step, self.dist_info)
        checkpoint_writes.snapshot_files(files, self.staged.engine, state, self.dist_info)
        writer = threading.Thread(target=checkpoint_writes.write_snapshot, name=f"checkpoint-{state.step}",
                                  args=(files, state.step, self.config.train.fault_injection, self.dist_info.rank,
                                        self.staged.engine.checkpoint_engine.zipfile_serialization), daemon=True)
        writer.start()
        self._in_flight = _InFlight(end, copy.copy(state), ending, files, writer, time.perf_counter() - started)

    def _complete_in_flight(self, wait: bool) -> Decision:
        """Complete the save in flight if every rank's writer has ended (``wait``: once they have, or timed
        out); what the stop policies make of its outcome; CONTINUE while it is still being written."""
        in_flight = self._in_flight
        if in_flight is None:
            return CONTINUE
        if not wait:
            ended = all_reduce_sum([0.0 if in_flight.writer.is_alive() else 1.0], self.dist_info.device)[0]
            if ended < self.dist_info.world_size:
                return CONTINUE
        waited = self._wait_for(in_flight)
        self._in_flight = None
        if waited >= 0.01 and self.dist_info.is_main:
            console(f"waited {waited:.2f} s for the checkpoint at step {in_flight.state.step} to finish writing")
        return self._commit(in_flight.end, in_flight.state, in_flight.ending, in_flight.files, in_flight.blocked_s)

    def _wait_for(self, in_flight: _InFlight) -> float:
        """Seconds this rank waited for its writer; a writer past the timeout fails the save (it is left running)."""
        started = time.perf_counter()
        in_flight.writer.join(max(0.0, in_flight.files.started + WRITE_TIMEOUT_S - started))
        if in_flight.writer.is_alive():
            self.staged.engine.checkpoint_engine.drop_buffers()  # the abandoned writer still reads them
            if in_flight.files.error is None:
                in_flight.files.error = TimeoutError(f"the background write did not end within "
                                                     f"{WRITE_TIMEOUT_S:.0f} s")
        return time.perf_counter() - started

    def _commit(self, end: StepEnd, state: TrainingState, ending: dict[str, str] | None, files: StepFiles,
                snapshot_s: float | None) -> Decision:
        """Complete the checkpoint (``snapshot_s``: a background write's, whose snapshot took that long)."""
        started = time.perf_counter()
        saved = checkpoint_writes.commit(files, state, self.config, self.tokenizer_path, self.dist_info, ending)
        if saved is not None:
            self.last_saved = saved
            if self.dist_info.is_main:  # what the step loop waited for: tools/bench_checkpoint.py reads it
                how = (f"the step loop waited {time.perf_counter() - files.started:.2f} s"
                       if snapshot_s is None else f"written in the background; the step loop waited "
                       f"{snapshot_s:.2f} s for its snapshot and {time.perf_counter() - started:.2f} s to complete it")
                console(f"saved checkpoint {saved} ({how})")
        return self.policies.after_save(end, saved is not None)
