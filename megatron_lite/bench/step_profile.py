"""Where a training step's GPU time goes: ``torch.profiler`` over a few steps of one model, as a table.

The step is the one the GPU check's throughput rows time (``gpu_check.throughput_step``: forward with labels
through the fused loss, backward, AdamW), at the 350M config by default, eager or compiled, after warm-up steps
that compile and settle the allocator; or the Hugging Face twin's (``model="hf_twin"``: its bf16 logits into a
float32 cross entropy, compiled by its own ``model.compile()``). The table is sorted by self CUDA time; kernel
rows name what ran (``nvjet``/``sm90`` GEMMs on tensor cores, ``sgemm``/``f32`` ones off them). Above it, the
GPU's busy share and kernel time by kind (``train.profile``'s summary line), to set two models' tables side by
side; below it, the GEMMs by shape with the TFLOP/s each ran at (``training/gemm_shapes.py``).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_lite import config as config_lib
from megatron_lite.bench.gpu_check import build_for_throughput, throughput_step
from megatron_lite.config import Config
from megatron_lite.model.variants import variant_named
from megatron_lite.training.gemm_shapes import trace_gemm_text
from megatron_lite.training.profiling import summarise

MODELS = ("ours", "hf_twin")
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ProfileSettings:
    label: str = "coca_slack"
    micro_batch: int = 64
    compile_mode: str | None = None  # None: eager; "regional" or "whole"
    loss_gemm: str = "mixed"
    config_path: str = "configs/coca_350m.yml"
    warmup_steps: int = 3
    steps: int = 2
    row_limit: int = 30
    model: str = "ours"  # MODELS: ours (label's scheme) or the Hugging Face twin (GPT-NeoX with RoPE)
    trace_path: Path | None = None  # where to keep the profiler's trace (.json or .json.gz); None: not kept

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"--model {self.model}: must be one of {', '.join(MODELS)}")
        for name in ("micro_batch", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be >= 1")


def training_step(settings: ProfileSettings, device: torch.device) -> tuple[Callable[[], None], Config]:
    """The step to profile on ``device`` (a GPU; a CPU runs it too, uncompiled) and the config it was built from:
    the GPU check's throughput step (``gpu_check.throughput_step``), ours or the twin, built and compiled as there."""
    config = config_lib.load(REPO / settings.config_path, [*variant_named(settings.label).overrides, "precision=bf16"])
    twin = settings.model == "hf_twin"
    model = build_for_throughput(config, twin, device, settings.compile_mode is not None,
                                 settings.compile_mode or "regional", None if twin else settings.loss_gemm)
    batch = torch.randint(0, config.model.vocab_size, (settings.micro_batch, config.model.seq_length + 1),
                          device=device)
    return throughput_step(model, twin, batch), config


def profile_step(settings: ProfileSettings) -> str:
    """The profiler's table of ``settings.steps`` training steps on the current CUDA device."""
    if not torch.cuda.is_available():
        raise ValueError("profile_step needs a CUDA device")
    step, config = training_step(settings, torch.device("cuda"))
    twin = settings.model == "hf_twin"
    for _ in range(settings.warmup_steps):
        step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities, record_shapes=True) as profiler:
        for _ in range(settings.steps):
            step()
        torch.cuda.synchronize()
    wall_s = time.perf_counter() - start
    mode = settings.compile_mode or "eager"
    what = ("hf_twin (model.compile())" if settings.compile_mode else "hf_twin, eager") if twin else (
        f"{settings.label}, {mode}, loss gemm {settings.loss_gemm}")
    title = (f"{what}, micro batch {settings.micro_batch} x {config.model.seq_length}, bf16, {settings.steps} "
             f"steps on {torch.cuda.get_device_name()}")
    summary = summarise(list(profiler.events()), "cuda", wall_s, 1, settings.steps, rank=0)
    kernels_s = sum(summary.by_kind_s.values())
    per_step = ", ".join(f"{kind} {seconds / settings.steps * 1e3:.1f} ms"
                         for kind, seconds in sorted(summary.by_kind_s.items(), key=lambda item: -item[1]))
    title += (f"\n{summary.line()}\nkernel time per step: {kernels_s / settings.steps * 1e3:.1f} ms ({per_step}); "
              f"wall per step {wall_s / settings.steps * 1e3:.1f} ms (profiled)")
    table = profiler.key_averages().table(sort_by="self_cuda_time_total", row_limit=settings.row_limit,
                                          max_name_column_width=70)
    return f"{title}\n{table}\n{gemm_section(profiler, settings.steps, settings.trace_path)}"


def gemm_section(profiler: torch.profiler.profile, steps: int, trace_path: Path | None = None) -> str:
    """The GEMMs-by-shape table of a finished profile recorded with shapes, per step, read from its trace: written
    to ``trace_path`` (kept for later reading, e.g. by tools/gemm_table.py), or to a temporary file."""
    with tempfile.TemporaryDirectory() as directory:
        path = trace_path if trace_path is not None else Path(directory) / "trace.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(path))
        return trace_gemm_text(path, steps, "per step")
