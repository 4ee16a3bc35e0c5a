"""``train.profile``: ``torch.profiler`` over a window of optimizer steps, as GPT-NeoX's ``profile`` and
torchtitan's ``[profiling]`` do, plus the two figures that say why a step is slow at a glance.

For each profiled rank it writes into ``<run dir>/profile/``:

* ``steps_A-B_rankR.trace.json.gz``: the trace, for https://ui.perfetto.dev or chrome://tracing;
* ``steps_A-B_rankR.txt``: the summary below, then the operator table (sorted by self device time on CUDA,
  self CPU time on CPU);
* ``steps_A-B_rankR.json``: the summary as numbers;
* with ``record_shapes``, ``steps_A-B_rankR_shapes.txt`` (the operators split by input shapes) and
  ``steps_A-B_rankR_gemms.txt`` (the GEMMs by shape and the TFLOP/s each ran at: ``gemm_shapes.py``).

The summary: the window's wall time; on CUDA the time the GPU was busy (the union of its kernel and memcpy
intervals: below the wall time, the GPU waited for the host: launches, syncs, data); and the device time
(CUDA kernels, or CPU self time on a CPU run) by kind: GEMMs, attention, compiled (inductor's fused triton
kernels), optimizer, communication, copies, other.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from megatron_lite.config import ProfileConfig
from megatron_lite.console import console
from megatron_lite.files import write_text_atomic
from megatron_lite.training.gemm_shapes import trace_gemm_text
from megatron_lite.training.kernel_kinds import kind_of

PROFILE_DIR = "profile"


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by (start, end) intervals: overlapping kernels (several streams) count once."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        covered += end - max(start, reach)
        reach = end
    return covered


@dataclass(frozen=True)
class ProfileSummary:
    first_step: int
    last_step: int
    rank: int
    device: str  # "cuda" or "cpu": what by_kind_s measures (kernel time, or CPU self time)
    wall_s: float
    busy_s: float | None  # CUDA: the union of kernel and memcpy intervals; None on CPU
    by_kind_s: dict[str, float]

    @property
    def steps_label(self) -> str:
        return f"{self.first_step}-{self.last_step}" if self.last_step > self.first_step else str(self.first_step)

    def line(self) -> str:
        """One console line: wall time, busy share (CUDA), the kinds by share of the measured time."""
        total = sum(self.by_kind_s.values()) or 1.0
        shares = ", ".join(f"{kind} {seconds / total:.0%}" for kind, seconds in
                           sorted(self.by_kind_s.items(), key=lambda item: -item[1]) if seconds / total >= 0.005)
        busy = (f"GPU busy {self.busy_s / self.wall_s:.0%} of {self.wall_s:.2f} s" if self.busy_s is not None
                else f"{self.wall_s:.2f} s wall")
        what = "kernel time" if self.device == "cuda" else "CPU self time"
        plural = "s" if self.last_step > self.first_step else ""
        return f"profiled step{plural} {self.steps_label}: {busy}; {what}: {shares}"


def summarise(events: list[Any], device: str, wall_s: float, first_step: int, last_step: int,
              rank: int) -> ProfileSummary:
    """The summary of a profiler's events: device-side events (kernels, memcpy) on CUDA, the operators' self CPU
    time on CPU (device-side events absent there). On CUDA the GPU-side user annotations are left out: each
    compiled graph's call (``## Call CompiledFxGraph ...``) spans its kernels and the idle gaps between them on
    the GPU's timeline, and counted as a kernel it doubled the kernel time and made a host-bound step look busy
    (Run 4's users' command: 69% "busy" where its kernels covered 34% of the step)."""
    by_kind: dict[str, float] = {}
    busy_s: float | None = None
    if device == "cuda":
        spans = []
        for event in events:
            if event.device_type == torch.autograd.DeviceType.CUDA and not getattr(event, "is_user_annotation", False):
                start, end = event.time_range.start, event.time_range.end  # microseconds
                spans.append((start, end))
                kind = kind_of(event.name)
                by_kind[kind] = by_kind.get(kind, 0.0) + (end - start) / 1e6
        busy_s = union_length(spans) / 1e6
    else:
        for event in events:
            if event.device_type == torch.autograd.DeviceType.CPU:
                kind = kind_of(event.name)
                by_kind[kind] = by_kind.get(kind, 0.0) + event.self_cpu_time_total / 1e6
    return ProfileSummary(first_step, last_step, rank, device, wall_s, busy_s, by_kind)


def describe_window(section: ProfileConfig, start_step: int, total_steps: int, run_dir: Path) -> str:
    """The start-up line: which steps will be profiled where, or why none will be."""
    first, last = section.start_step, section.start_step + section.steps - 1
    if first > total_steps:
        return f"train.profile.start_step={first}: past the run's last step {total_steps}; nothing is profiled"
    if last <= start_step:
        return f"train.profile: steps {first}-{last} were taken before this resume (step {start_step}); not profiled"
    ranks = ", ".join(str(rank) for rank in section.ranks)
    return (f"profiling steps {max(first, start_step + 1)}-{min(last, total_steps)} on rank {ranks} into "
            f"{run_dir / PROFILE_DIR} (those steps run a little slower)")


class StepProfiler:
    """Profiles optimizer steps ``start_step .. start_step + steps - 1`` on the ranks ``train.profile`` names:
    ``before_step(n)`` / ``after_step(n)`` around step n (1-based); a window the run leaves early (a stop, the
    last step) is written when the profiler closes."""

    def __init__(self, section: ProfileConfig, run_dir: Path, rank: int, device: torch.device) -> None:
        self.section, self.rank, self.device = section, rank, device
        self.active = section.start_step > 0 and rank in section.ranks
        self.first, self.last = section.start_step, section.start_step + section.steps - 1
        self.directory = run_dir / PROFILE_DIR
        self._profiler: torch.profiler.profile | None = None
        self._started = 0.0
        self._first_taken = self._last_taken = 0  # the window's steps this run took (a resume may start inside it)
        self._done = False

    def before_step(self, step: int) -> None:
        if not self.active or self._profiler is not None or self._done or not self.first <= step <= self.last:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._synchronize()
        # one window, one cycle: acc_events keeps nothing more, and spares the log torch's UserWarning that events
        # are cleared "at the end of each cycle" (printed by the users' command profiled on the H200, 2026-11-27)
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=self.section.record_shapes,
                                                acc_events=True)
        self._profiler.start()
        self._started, self._first_taken = time.perf_counter(), step

    def after_step(self, step: int) -> None:
        """Closes the window after its last step (the writing is side work, not training time: the caller's
        throughput clock should leave it out)."""
        self._last_taken = step
        if self._profiler is not None and step >= self.last:
            self.close()

    def close(self) -> ProfileSummary | None:
        if self._profiler is None:
            return None
        self._synchronize()
        wall_s = time.perf_counter() - self._started
        profiler, self._profiler, self._done = self._profiler, None, True
        profiler.stop()
        last = max(self._last_taken, self._first_taken)
        summary = summarise(list(profiler.events()), self.device.type, wall_s, self._first_taken, last, self.rank)
        self._write(profiler, summary)
        return summary

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if kind is None:
            self.close()
        elif self._profiler is not None:  # a failing run: stop the profiler, write nothing half-made
            self._profiler.stop()
            self._profiler, self._done = None, True

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _write(self, profiler: torch.profiler.profile, summary: ProfileSummary) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        stem = self.directory / f"steps_{summary.steps_label}_rank{self.rank}"
        trace = stem.with_name(stem.name + ".trace.json.gz")
        profiler.export_chrome_trace(str(trace))
        sort_by = "self_device_time_total" if summary.device == "cuda" else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=sort_by, row_limit=self.section.row_limit)
        write_text_atomic(stem.with_suffix(".txt"), f"{summary.line()}\n\n{table}\n")
        if self.section.record_shapes:  # the same operators split by their input shapes, readable without the trace
            rows = 2 * self.section.row_limit  # an operator takes a row per shape
            shapes = profiler.key_averages(group_by_input_shape=True).table(sort_by=sort_by, row_limit=rows)
            write_text_atomic(stem.with_name(stem.name + "_shapes.txt"), f"{summary.line()}\n\n{shapes}\n")
            steps = summary.last_step - summary.first_step + 1
            try:  # side work: a trace torch wrote but json cannot read costs this table, not the run
                text = trace_gemm_text(trace, steps, "per step")
            except ValueError as error:
                text = f"no GEMM table: {error}"
            write_text_atomic(stem.with_name(stem.name + "_gemms.txt"), text + "\n")
        write_text_atomic(stem.with_suffix(".json"), json.dumps(asdict(summary), indent=1) + "\n")
        console(f"{summary.line()} ({stem}.txt, {trace.name})")
