"""How long a checkpoint save holds the step loop, synchronous against asynchronous (``train.async_save``).

Each mode is one ``train.py`` run of the same config, steps and seed (its own run dir, ``--resume none``), saving
every ``save_interval`` steps and not at the end. What it prints is read back:

* blocked per save: a synchronous save's whole time; an asynchronous one's snapshot, plus its completion at a later
  step end, plus any wait for the previous save still writing (the ``saved checkpoint`` and ``waited`` lines). The
  first asynchronous save also allocates its host buffers (later ones reuse them), so the first save and the later
  ones are reported apart; the wait at the run's end for the last background write holds no step and is reported
  on its own (``end_wait_s``);
* step time: each step's tokens / its logged tokens/s (the loop's side work, such as saves, excluded), the median
  of the steps trained while a background write was in flight against the median of the others.

The first step (start-up) and the steps before the first save are left out of the step medians.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SAVED = re.compile(r"saved checkpoint \S+/step_(\d+) \((?:the step loop waited (?P<sync>[\d.]+) s|written in the "
                   r"background; the step loop waited (?P<snap>[\d.]+) s for its snapshot and (?P<done>[\d.]+) s)")
WAITED = re.compile(r"waited ([\d.]+) s for the checkpoint at step (\d+) to finish writing")
STEP = re.compile(r"^step (\d+)/(\d+) \|")


@dataclass
class ModeResult:
    mode: str  # "sync" | "async"
    saves: int
    blocked_s: list[float]  # per completed save, what the step loop waited for it
    end_wait_s: float  # after the last step: the wait for the last background write (no step waits on it)
    step_s_quiet: float | None  # median step time with no background write in flight
    step_s_overlapping: float | None  # median step time while one was in flight
    wall_s: float  # the whole run, start-up included

    @property
    def blocked_median_s(self) -> float:
        return statistics.median(self.blocked_s) if self.blocked_s else float("nan")

    @property
    def later_blocked_median_s(self) -> float:
        """The saves after the first (which also allocates an asynchronous save's host buffers)."""
        later = self.blocked_s[1:] or self.blocked_s
        return statistics.median(later) if later else float("nan")


def parse_run(output: str, rows: list[dict[str, Any]], tokens_per_step: int, mode: str, wall_s: float) -> ModeResult:
    """The blocked time of each save and the step medians from a run's stdout and metrics rows. A background
    write of step k's checkpoint overlaps the steps logged after k up to the line saying it completed."""
    blocked: dict[int, float] = {}
    waits: dict[int, float] = {}
    overlapping: set[int] = set()
    last_step, total_steps, end_wait = 0, -1, 0.0
    for raw in output.splitlines():
        line = raw.strip().split("\r")[-1]
        if match := STEP.match(line):
            last_step, total_steps = int(match.group(1)), int(match.group(2))
        elif match := WAITED.search(line):
            if last_step == total_steps:  # the run's end waits for the last write: no step is held
                end_wait += float(match.group(1))
            else:
                waits[int(match.group(2))] = float(match.group(1))
        elif match := SAVED.search(line):
            step = int(match.group(1))
            if match.group("sync") is not None:
                blocked[step] = float(match.group("sync"))
            else:
                blocked[step] = float(match.group("snap")) + float(match.group("done")) + waits.get(step, 0.0)
                overlapping |= set(range(step + 1, last_step + 1))
    first_save = min(blocked, default=0)
    times = {int(row["step"]): tokens_per_step / row["tokens_per_sec"] for row in rows
             if row.get("tokens_per_sec") and int(row["step"]) > max(1, first_save)}
    quiet = [time_s for step, time_s in times.items() if step not in overlapping]
    busy = [time_s for step, time_s in times.items() if step in overlapping]
    return ModeResult(mode, len(blocked), [blocked[step] for step in sorted(blocked)], end_wait,
                      statistics.median(quiet) if quiet else None, statistics.median(busy) if busy else None, wall_s)


def run_mode(config: Path, overrides: list[str], mode: str, run_dir: Path, steps: int, save_interval: int,
             tokens_per_step: int) -> ModeResult:
    command = [sys.executable, str(Path(__file__).resolve().parents[2] / "train.py"), "--config", str(config),
               "--run-dir", str(run_dir), "--resume", "none", "--train-iters", str(steps),
               *[arg for item in [*overrides, f"train.async_save={str(mode == 'async').lower()}",
                                  f"train.save_interval={save_interval}", "train.save_final=false",
                                  "train.log_interval=1", "train.eval_interval=0", "train.keep_last_checkpoints=1",
                                  "train.wandb.mode=disabled"] for arg in ("--set", item)]]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=_env())
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"train.py ({mode}) exited {done.returncode}: {done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return parse_run(done.stdout, rows, tokens_per_step, mode, wall)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}


def format_report(results: list[ModeResult], label: str) -> str:
    sync, background = results
    lines = [f"{label}",
             "| mode | saves | step loop blocked: first save (s) | later saves (median, s) | wait at the end (s) | "
             "step time, no write in flight (s) | step time, write in flight (s) |", "|---|---|---|---|---|---|---|"]
    for result in results:
        first = result.blocked_s[0] if result.blocked_s else float("nan")
        lines.append(f"| {result.mode} | {result.saves} | {first:.2f} | {result.later_blocked_median_s:.2f} | "
                     f"{result.end_wait_s:.2f} | {_fmt(result.step_s_quiet)} | {_fmt(result.step_s_overlapping)} |")
    ratio = background.later_blocked_median_s / sync.later_blocked_median_s
    slowdown = (background.step_s_overlapping / background.step_s_quiet
                if background.step_s_overlapping and background.step_s_quiet else float("nan"))
    lines.append(f"async / sync blocked per save after the first: {ratio:.3f}; steps overlapping a background write: "
                 f"{slowdown:.2f}x the others")
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def as_json(results: list[ModeResult]) -> list[dict[str, Any]]:
    return [{**asdict(result), "blocked_median_s": result.blocked_median_s,
             "later_blocked_median_s": result.later_blocked_median_s} for result in results]
