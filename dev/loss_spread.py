"""A run's training-loss noise and final losses from its metrics.jsonl (docs/data_loading.md's training comparison).

    python -m dev.loss_spread RUN_DIR [RUN_DIR ...] [--from-step 201]

Per run: the loss at the first and last step, the step-to-step spread (standard deviation of successive
differences of the per-step training loss, train.log_interval=1; from --from-step on, where the trend is small
against the noise), the last validation loss and the extrapolation perplexity at 1x the training length.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def summary(run_dir: Path, from_step: int) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = {row["step"]: row["loss"] for row in rows if "loss" in row}
    steps = sorted(losses)
    if any(b - a != 1 for a, b in zip(steps, steps[1:])):
        raise ValueError(f"{run_dir}: the training loss is not logged at every step (set train.log_interval=1)")
    tail = np.array([losses[s] for s in steps if s >= from_step])  # (steps,)
    last = {key: row[key] for row in rows for key in ("val_loss", "extrapolation_ppl_x1") if key in row}
    return {"run": str(run_dir), "first_loss": round(losses[steps[0]], 4), "last_loss": round(losses[steps[-1]], 4),
            "mean_loss_tail": round(float(tail.mean()), 4), "spread": round(float(np.diff(tail).std()), 4),
            **{key: round(value, 4) for key, value in last.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--from-step", type=int, default=201)
    args = parser.parse_args()
    for run_dir in args.run_dirs:
        print(json.dumps(summary(run_dir, args.from_step)))


if __name__ == "__main__":
    main()
