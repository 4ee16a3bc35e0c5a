"""``train.record_sample_indices``: which global samples each optimizer step trained on.

Every rank's micro batches carry their samples' global indices (``BlendedDataset.__getitem__``'s
``index``); they are gathered over the ranks and rank 0 appends one JSON line per step to
``<run dir>/sample_indices.jsonl``: ``{"step": 3, "indices": [16, 17, ...]}`` (sorted). The set a step
used is the same on any number of GPUs and across resumes, so two runs' files compare line by line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron_lite.training.distributed import DistributedInfo, all_gather_objects

SAMPLE_INDICES_FILE = "sample_indices.jsonl"


class SampleIndexRecorder:
    def __init__(self, run_dir: Path, dist_info: DistributedInfo, enabled: bool, start_step: int) -> None:
        self.enabled, self.is_main = enabled, dist_info.is_main
        self.sequence_parallel_rank = dist_info.sequence_parallel_rank
        self.path = run_dir / SAMPLE_INDICES_FILE
        if enabled and self.is_main:
            self._drop_rows_after(start_step)

    def _drop_rows_after(self, step: int) -> None:
        """A resume repeats the steps after its checkpoint: their rows from the interrupted run go."""
        if not self.path.is_file():
            return
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def record(self, step: int, micro_batches: list[dict[str, Any]]) -> None:
        """Called by every rank (it gathers) with the step's micro batches, before the step is counted."""
        if not self.enabled:
            return
        # a sequence-parallel group's ranks share their samples: its first rank speaks for it
        mine = ([int(index) for batch in micro_batches for index in batch["index"]]
                if self.sequence_parallel_rank == 0 else [])
        everyone = sorted(index for indices in all_gather_objects(mine) for index in indices)
        if self.is_main:
            with self.path.open("a") as file:
                file.write(json.dumps({"step": step, "indices": everyone}) + "\n")


def read_sample_indices(run_dir: Path) -> dict[int, list[int]]:
    """step -> the sorted global sample indices it trained on."""
    path = run_dir / SAMPLE_INDICES_FILE
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {row["step"]: row["indices"] for row in rows}
