"""What summing a bf16 run's gradients in float32 costs (``train.grad_accum_dtype``), counted on CPU.

For each mode, one engine of the config's model (bf16, ZeRO 1, one rank) runs two optimizer steps of
``micro_batches`` micro batches of one short sequence; the second step's ``engine.backward`` calls (the model's
backward and DeepSpeed's epilogue) and its boundary ``engine.step`` run under the step census's dispatch mode
(``step_census.CensusMode``), which adds up the bytes every non-GEMM operator reads and writes and counts the
operators. The sequence is short so that the parameter-sized work (gradient accumulation, casts, the optimizer)
dominates what is counted; the model's own activations differ little between the modes. On a GPU those bytes are
memory-bound time: the difference per optimizer step at ``accumulation`` micro batches (the paper config on one
GPU: 16) divided by the memory bandwidth is what float32 sums cost.
"""

from __future__ import annotations

import contextlib
import gc
import io
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_lite import config as config_lib
from megatron_lite.bench.step_census import CensusMode
from megatron_lite.eval.report import markdown_table

MODES = ("model", "fp32")


@dataclass
class GradSumsSettings:
    config_path: str = "configs/coca_350m.yml"
    overrides: list[str] = field(default_factory=list)  # e.g. narrower dimensions for a quick run
    tokens: int = 32  # per micro batch (one sequence)
    micro_batches: int = 4  # per counted optimizer step
    accumulation: int = 16  # micro batches per step in the per-step projection (the paper config on one GPU)

    def validate(self) -> None:
        for name in ("tokens", "micro_batches", "accumulation"):
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
    """One mode's counts: per non-boundary micro batch (median of the second step's) and per boundary step."""
    import deepspeed

    from megatron_lite.model import GPT
    from megatron_lite.training.deepspeed_config import deepspeed_config, resolve_batch_sizes
    from megatron_lite.training.optim import build_optimizer

    config = config_lib.load(settings.config_path, [
        *settings.overrides, "precision=bf16", "train.zero_stage=1", f"train.grad_accum_dtype={mode}",
        "train.train_micro_batch_size_per_gpu=1", f"train.train_batch_size={settings.micro_batches}",
        "train.gradient_accumulation_steps=null", f"model.seq_length={settings.tokens}", "train.fused_optimizer=false",
        "train.compile=false"])
    torch.manual_seed(0)
    model = GPT(config.model)
    parameters = sum(parameter.numel() for parameter in model.parameters())
    with contextlib.redirect_stdout(io.StringIO()):  # BF16_Optimizer's memory prints
        engine, *_ = deepspeed.initialize(model=model, optimizer=build_optimizer(model, config.train),
                                          config=deepspeed_config(config, resolve_batch_sizes(config, 1)))
    ids_BT1 = torch.randint(0, config.model.vocab_size, (1, settings.tokens + 1),  # (1, T + 1)
                            generator=torch.Generator().manual_seed(0))
    micro: list[tuple[int, int]] = []
    boundary = (0, 0)
    for index in range(2 * settings.micro_batches):  # the first step warms up (Adam's state, lazy buffers)
        counted = index >= settings.micro_batches
        loss = engine(ids_BT1[:, :-1], labels=ids_BT1[:, 1:])
        census = CensusMode(torch.device("cpu"))
        with census:
            engine.backward(loss)
        last = index % settings.micro_batches == settings.micro_batches - 1
        if counted and not last:
            micro.append(_count(census))
        census = CensusMode(torch.device("cpu"))
        with census:
            engine.step()
        if counted and last:
            boundary = _count(census)
    optimizer = type(engine.optimizer).__name__
    engine.destroy()
    del engine, model
    gc.collect()
    micro.sort()
    micro_bytes, micro_ops = micro[len(micro) // 2]
    return {"mode": mode, "optimizer": optimizer, "parameters": parameters, "micro_bytes": micro_bytes,
            "micro_ops": micro_ops, "step_bytes": boundary[0], "step_ops": boundary[1]}


def run_grad_sums(settings: GradSumsSettings, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    from megatron_lite.training.distributed import init_distributed

    if not torch.distributed.is_initialized():
        init_distributed()  # a one-rank world of its own (distributed.single_process_env)
    rows = []
    for mode in MODES:
        progress(f"grad sums: train.grad_accum_dtype={mode} ...")
        rows.append(measure_mode(settings, mode))
    return rows


def per_step_bytes(row: dict[str, Any], accumulation: int) -> int:
    """Bytes of one optimizer step of ``accumulation`` micro batches (every micro batch counted as a middle one)."""
    return accumulation * row["micro_bytes"] + row["step_bytes"]


def format_grad_sums(rows: list[dict[str, Any]], settings: GradSumsSettings) -> str:
    gb = lambda value: f"{value / 1e9:.2f}"  # noqa: E731
    header = ["train.grad_accum_dtype", "DeepSpeed optimizer", "GB per micro batch", "operators per micro batch",
              "GB per optimizer step", "operators per optimizer step",
              f"GB per step of {settings.accumulation} micro batches"]
    body = [[row["mode"], row["optimizer"], gb(row["micro_bytes"]), f"{row['micro_ops']:,}", gb(row["step_bytes"]),
             f"{row['step_ops']:,}", gb(per_step_bytes(row, settings.accumulation))] for row in rows]
    by_mode = {row["mode"]: row for row in rows}
    lines = [f"# Gradient sums: {settings.config_path}, bf16, ZeRO 1, one rank, {settings.tokens} tokens per micro "
             f"batch, {by_mode['model']['parameters']:,} parameters (memory traffic of non-GEMM operators)", "",
             markdown_table(header, body)]
    if {"model", "fp32"} <= by_mode.keys():
        fp32, bf16 = by_mode["fp32"], by_mode["model"]
        extra = per_step_bytes(fp32, settings.accumulation) - per_step_bytes(bf16, settings.accumulation)
        lines += ["", f"float32 sums add {(fp32['micro_bytes'] - bf16['micro_bytes']) / fp32['parameters']:.1f} bytes "
                  f"per parameter per micro batch and {gb(extra)} GB per step of {settings.accumulation} micro "
                  f"batches: {extra / 3.3e12 * 1e3:.1f} ms at 3.3 TB/s (an H200's measured rate at the margin)"]
    return "\n".join(lines) + "\n"
