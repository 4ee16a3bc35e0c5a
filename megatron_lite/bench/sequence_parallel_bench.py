"""Sequence parallelism's memory and speed: per-rank peak memory and tokens/s of one training step at a fixed
long sequence, for each sequence-parallel size P (``tools/bench_train.py --sequence-parallel 1,2,4``).

Each P is its own launch of P ranks (the deepspeed launcher: gloo on CPU, NCCL on GPUs), all of one
sequence-parallel group (data-parallel 1), training one sequence of ``length`` tokens. A rank's peak is what
its forward + backward allocate above the weights and the gradient buffers that exist before the step
(``megatron_lite.bench.memory.track_peak_memory`` on CPU, the allocator's peak on CUDA): the activations and
the kernels' transients, which sequence parallelism divides by P. The largest peak over the ranks is reported.
Tokens/s: the whole sequence over the median of timed steps (forward, backward), timed without the tracker.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# a wide, shallow model: activations per token dominate, so the peak follows the tokens a rank holds
WIDE_TINY_MODEL: dict[str, Any] = {
    "num_layers": 2, "hidden_size": 512, "num_attention_heads": 8, "intermediate_size": 2048,
    "vocab_size": 1024, "make_vocab_size_divisible_by": 128, "no_weight_tying": True,
    "position": {"scheme": "coca", "constraint": "slack"}, "attention": {"backend": "sdpa"},
}


@dataclass
class SequenceParallelRow:
    sequence_parallel_size: int
    length: int
    peak_bytes_per_rank: int  # the largest rank's
    tokens_per_second: float
    device: str

    def ratio_to(self, baseline: SequenceParallelRow) -> float:
        return self.peak_bytes_per_rank / baseline.peak_bytes_per_rank


def bench_config(length: int) -> Any:
    from megatron_lite import config as config_lib

    return config_lib.from_dict({"model": {**WIDE_TINY_MODEL, "seq_length": length, "max_position_embeddings": length},
                                 "precision": "fp32", "seed": 1234})


def _step(model: Any, input_ids: torch.Tensor, labels: torch.Tensor) -> None:
    model(input_ids, labels=labels).backward()


def worker(length: int, steps: int, out: Path) -> None:
    """One rank: build the model (sequence parallel over all ranks when there are several), one step to create
    the gradient buffers, one tracked step for the peak, ``steps`` timed steps."""
    import torch.distributed as dist

    from megatron_lite.bench.memory import track_peak_memory
    from megatron_lite.model import GPT
    from megatron_lite.training.distributed import init_distributed, shutdown_distributed

    info = init_distributed()
    config = bench_config(length)
    torch.manual_seed(config.seed)
    with torch.device(info.device):
        model = GPT(config.model)
    if info.world_size > 1:
        model.enable_sequence_parallel(dist.new_group(list(range(info.world_size))))
    tokens = torch.randint(0, config.model.vocab_size, (1, length + 1), generator=torch.Generator().manual_seed(0))
    input_ids, labels = tokens[:, :-1].to(info.device), tokens[:, 1:].to(info.device)
    _step(model, input_ids, labels)  # gradient buffers exist from here on: the peak below is the step's own
    model.zero_grad(set_to_none=False)
    if info.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
        _step(model, input_ids, labels)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - baseline
    else:
        with track_peak_memory() as tracker:
            _step(model, input_ids, labels)
        peak = tracker.peak_bytes
    seconds = []
    for _ in range(steps):
        model.zero_grad(set_to_none=False)
        dist.barrier()
        started = time.perf_counter()
        _step(model, input_ids, labels)
        if info.device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        seconds.append(time.perf_counter() - started)
    peaks = [0] * info.world_size
    dist.all_gather_object(peaks, peak)
    if info.is_main:
        row = SequenceParallelRow(info.world_size, length, max(peaks), length / statistics.median(seconds),
                                  info.device.type)
        out.write_text(json.dumps(row.__dict__) + "\n")
    shutdown_distributed()  # every rank got here: the process exits next


def run_sequence_parallel_bench(sizes: list[int], length: int, steps: int, out_dir: Path) -> list[SequenceParallelRow]:
    """One launch of P ranks per size, one after the other; their rows."""
    for size in sizes:
        if size < 1 or WIDE_TINY_MODEL["num_attention_heads"] % size or length % size:
            raise ValueError(f"--sequence-parallel {size}: must divide the {WIDE_TINY_MODEL['num_attention_heads']} "
                             f"heads and --sequence-length {length}")
    from megatron_lite.training.distributed import free_port

    rows = []
    out_dir.mkdir(parents=True, exist_ok=True)
    for size in sizes:
        out = out_dir / f"sequence_parallel_{size}.json"
        command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(size), "--master_port",
                   str(free_port()), "--module", "megatron_lite.bench.sequence_parallel_bench", "--length",
                   str(length), "--steps", str(steps), "--out", str(out)]
        environment = {key: value for key, value in os.environ.items()
                       if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        done = subprocess.run(command, env=environment, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"sequence-parallel benchmark at P={size} failed:\n{done.stderr[-3000:]}")
        rows.append(SequenceParallelRow(**json.loads(out.read_text())))
    return rows


def format_sequence_parallel(rows: list[SequenceParallelRow]) -> str:
    baseline = rows[0]
    lines = [f"sequence parallelism at T={baseline.length} ({baseline.device}; wide tiny model: "
             f"{WIDE_TINY_MODEL['num_layers']} layers, hidden {WIDE_TINY_MODEL['hidden_size']}, "
             f"{WIDE_TINY_MODEL['num_attention_heads']} heads, coca slack, sdpa, fp32, one sequence)", "",
             f"| P | peak per rank (MiB) | vs P={baseline.sequence_parallel_size} | tokens/s |", "|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row.sequence_parallel_size} | {row.peak_bytes_per_rank / 2**20:.1f} | "
                     f"{row.ratio_to(baseline):.2f}x | {row.tokens_per_second:.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="worker of the sequence-parallel benchmark (one rank)")
    parser.add_argument("--length", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--local_rank", type=int, default=None)  # passed by the deepspeed launcher
    arguments = parser.parse_args()
    worker(arguments.length, arguments.steps, arguments.out)
