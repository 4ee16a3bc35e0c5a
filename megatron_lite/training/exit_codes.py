"""train.py's exit codes (docs/training.md, "Stopping and exit codes"): what a run's ending means to a job script."""

from __future__ import annotations

import signal

EXIT_OK = 0
EXIT_NONFINITE = 3
EXIT_FAILED_SAVES = 4
EXIT_SIGNAL_BASE = 128  # a one-process run stopped by signal N exits 128 + N, as a shell reports it


def exit_code_for(stopped_by: str, signal_name: str | None = None) -> int:
    """train.py's exit code as one process for a run that ended so: 128 + the signal's number, 3, 4 or 0."""
    if signal_name is not None:
        return EXIT_SIGNAL_BASE + signal.Signals[signal_name].value
    return {"nonfinite": EXIT_NONFINITE, "failed_saves": EXIT_FAILED_SAVES,
            "final_save_failed": EXIT_FAILED_SAVES}.get(stopped_by, EXIT_OK)
