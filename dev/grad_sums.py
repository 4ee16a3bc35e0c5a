"""What summing a bf16 run's gradients in float32 costs (``train.grad_accum_dtype``), counted on CPU.

For each mode (bf16 sums; float32 sums through DeepSpeed's per-tensor hooks, ``bf16.immediate_grad_update``; float32
sums as training runs them, ``training/fp32_grad_sums.py``), one engine of the config's model (bf16, ZeRO 1, one rank)
runs optimizer steps of ``micro_batches`` micro batches of one short sequence. The second step's ``engine.backward``
calls (the model's backward and DeepSpeed's epilogue) and its boundary ``engine.step`` run under the step census's
dispatch mode (``step_census.CensusMode``), which adds up the bytes every non-GEMM operator reads and writes and counts
the operators; the ``timed_steps`` after it are timed on the host: each micro batch as ``training/step.py`` drives it
(forward, backward, the engine's non-boundary step) and each boundary ``engine.step``. With a narrow model those times
are Python and dispatch cost, which is what bounds a GPU whose queue runs empty. The sequence is short so that the
parameter-sized work (gradient accumulation, casts, the optimizer) dominates what is counted; the model's own
activations differ little between the modes. On a GPU those bytes are
memory-bound time: the difference per optimizer step at ``accumulation`` micro batches (the paper config on one
GPU: 16) divided by the memory bandwidth is what float32 sums cost.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dev.step_census import CensusMode
from megatron_lite import config as config_lib
from megatron_lite.eval.report import markdown_table

MODES = ("model", "fp32-hooks", "fp32")
MODE_NAMES = {"model": "model (bf16 sums)", "fp32-hooks": "fp32, DeepSpeed's hook per tensor",
              "fp32": "fp32, one add_ per group"}


@dataclass
class GradSumsSettings:
    config_path: str = "configs/coca_350m.yml"
    overrides: list[str] = field(default_factory=list)  # e.g. narrower dimensions for a quick run
    tokens: int = 32  # per micro batch (one sequence)
    micro_batches: int = 4  # per counted optimizer step
    accumulation: int = 16  # micro batches per step in the per-step projection (the paper config on one GPU)
    timed_steps: int = 3  # optimizer steps timed after the counted one

    def validate(self) -> None:
        for name in ("tokens", "micro_batches", "accumulation", "timed_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--grad-sums-{name.replace('_', '-')} {getattr(self, name)}: must be >= 1")
        if self.micro_batches < 2:
            raise ValueError(f"--grad-sums-micro-batches {self.micro_batches}: must be >= 2 (one is a boundary)")


def _count(census: CensusMode) -> tuple[int, int]:
    """(bytes, operators that are not views) of everything the census saw."""
    counts = census.phases.get("forward")
    if counts is None:
        return 0, 0
    return sum(counts.traffic.values()), counts.dispatched_ops - counts.view_ops


def measure_mode(settings: GradSumsSettings, mode: str) -> dict[str, Any]:
    """One mode's counts: per non-boundary micro batch (median of the second step's) and per boundary step; and its
    host times (medians of the timed steps'). The engine is built as training builds it (``StagedEngine``)."""
    from megatron_lite.training import engine as engine_lib
    from megatron_lite.training import fp32_grad_sums
    from megatron_lite.training.deepspeed_config import resolve_batch_sizes
    from megatron_lite.training.distributed import DistributedInfo

    hooks = ["train.deepspeed.bf16.immediate_grad_update=true"] if mode == "fp32-hooks" else []
    config = config_lib.load(settings.config_path, [
        *settings.overrides, "precision=bf16", "train.zero_stage=1",
        f"train.grad_accum_dtype={'model' if mode == 'model' else 'fp32'}", *hooks,
        "train.train_micro_batch_size_per_gpu=1", f"train.train_batch_size={settings.micro_batches}",
        "train.gradient_accumulation_steps=null", f"model.seq_length={settings.tokens}", "train.fused_optimizer=false",
        "train.compile=false"])
    dist_info = DistributedInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    torch.manual_seed(0)
    model = engine_lib.new_model(config, dist_info)
    parameters = sum(parameter.numel() for parameter in model.parameters())
    tensors = len(list(model.parameters()))
    # what a GPU runs: the flat sum's one add_ per group (on CPU it sums in runs of parameters, CPU_RUN_ELEMENTS)
    cpu_runs, fp32_grad_sums.CPU_RUN_ELEMENTS = fp32_grad_sums.CPU_RUN_ELEMENTS, None
    try:
        staged = engine_lib.StagedEngine(config, resolve_batch_sizes(config, 1), dist_info, [], model, None)
    finally:
        fp32_grad_sums.CPU_RUN_ELEMENTS = cpu_runs
    engine = staged.engine
    flat_sums = fp32_grad_sums.installed(engine.optimizer)
    ids_BT1 = torch.randint(0, config.model.vocab_size, (1, settings.tokens + 1),  # (1, T + 1)
                            generator=torch.Generator().manual_seed(0))
    micro: list[tuple[int, int]] = []
    boundary = (0, 0)
    micro_seconds: list[float] = []
    step_seconds: list[float] = []
    for index in range((2 + settings.timed_steps) * settings.micro_batches):  # the first step warms up
        counted = settings.micro_batches <= index < 2 * settings.micro_batches
        timed = index >= 2 * settings.micro_batches
        last = index % settings.micro_batches == settings.micro_batches - 1
        started = time.perf_counter()
        loss = engine(ids_BT1[:, :-1], labels=ids_BT1[:, 1:])
        census = CensusMode(torch.device("cpu"))
        with census if counted else contextlib.nullcontext():
            engine.backward(loss)
        if counted and not last:
            micro.append(_count(census))
        census = CensusMode(torch.device("cpu"))
        stepping = time.perf_counter()
        with census if counted else contextlib.nullcontext():
            engine.step()
        if counted and last:
            boundary = _count(census)
        if timed and last:
            step_seconds.append(time.perf_counter() - stepping)
        elif timed:
            micro_seconds.append(time.perf_counter() - started)
    optimizer = type(engine.optimizer).__name__
    engine.destroy()
    del staged, engine, model
    gc.collect()
    micro.sort()
    micro_bytes, micro_ops = micro[len(micro) // 2]
    return {"mode": mode, "optimizer": optimizer, "flat_sums": flat_sums, "parameters": parameters, "tensors": tensors,
            "micro_bytes": micro_bytes, "micro_ops": micro_ops, "step_bytes": boundary[0], "step_ops": boundary[1],
            "micro_host_ms": statistics.median(micro_seconds) * 1e3,
            "step_host_ms": statistics.median(step_seconds) * 1e3}


def run_grad_sums(settings: GradSumsSettings, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    from megatron_lite.training.distributed import init_distributed

    if not torch.distributed.is_initialized():
        init_distributed()  # a one-rank world of its own (distributed.single_process_env)
    rows = []
    for mode in MODES:
        progress(f"grad sums: {MODE_NAMES[mode]} ...")
        rows.append(measure_mode(settings, mode))
    return rows


def per_step_bytes(row: dict[str, Any], accumulation: int) -> int:
    """Bytes of one optimizer step of ``accumulation`` micro batches (every micro batch counted as a middle one)."""
    return accumulation * row["micro_bytes"] + row["step_bytes"]


def format_grad_sums(rows: list[dict[str, Any]], settings: GradSumsSettings) -> str:
    gb = lambda value: f"{value / 1e9:.2f}"  # noqa: E731
    header = ["gradient sums", "DeepSpeed optimizer", "GB per micro batch", "operators per micro batch",
              "host ms per micro batch", "GB per optimizer step", "operators per optimizer step",
              "host ms per optimizer step", f"GB per step of {settings.accumulation} micro batches"]
    body = [[MODE_NAMES[row["mode"]], row["optimizer"], gb(row["micro_bytes"]), f"{row['micro_ops']:,}",
             f"{row['micro_host_ms']:.2f}", gb(row["step_bytes"]), f"{row['step_ops']:,}", f"{row['step_host_ms']:.2f}",
             gb(per_step_bytes(row, settings.accumulation))] for row in rows]
    by_mode = {row["mode"]: row for row in rows}
    lines = [f"# Gradient sums: {settings.config_path}, bf16, ZeRO 1, one rank, {settings.tokens} tokens per micro "
             f"batch, {by_mode['model']['parameters']:,} parameters (memory traffic of the non-GEMM operators and "
             "count of the operators that are not views, in engine.backward and the boundary engine.step; host time "
             f"of a whole micro batch and of the boundary engine.step, medians over {settings.timed_steps} steps)", "",
             markdown_table(header, body)]
    if {"model", "fp32"} <= by_mode.keys():
        fp32, bf16 = by_mode["fp32"], by_mode["model"]
        extra = per_step_bytes(fp32, settings.accumulation) - per_step_bytes(bf16, settings.accumulation)
        lines += ["", f"float32 sums add {(fp32['micro_bytes'] - bf16['micro_bytes']) / fp32['parameters']:.1f} bytes "
                  f"per parameter per micro batch and {gb(extra)} GB per step of {settings.accumulation} micro "
                  f"batches: {extra / 3.3e12 * 1e3:.1f} ms at 3.3 TB/s (an H200's measured rate at the margin)"]
    if {"fp32-hooks", "fp32"} <= by_mode.keys():
        hooks, flat = by_mode["fp32-hooks"], by_mode["fp32"]
        lines += ["", f"one add_ per group instead of DeepSpeed's hook per tensor: "
                  f"{hooks['micro_host_ms'] - flat['micro_host_ms']:.2f} ms of host time and "
                  f"{hooks['micro_ops'] - flat['micro_ops']:,} operators fewer per micro batch, the same sums bit for "
                  "bit (tests/test_grad_accumulation.py)"]
    return "\n".join(lines) + "\n"
