"""Where a training step's GPU time goes: ``torch.profiler`` over a few steps of one model, as a table.

The step is the one the throughput benchmarks time (forward with labels through the fused loss, backward,
AdamW), at the 350M config by default, eager or compiled (``megatron_lite.model.compile``), after warm-up
steps that compile and settle the allocator. The table is sorted by self CUDA time; kernel rows name what ran
(``nvjet``/``sm90`` GEMMs on tensor cores, ``sgemm``/``f32`` ones off them).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_lite import config as config_lib
from megatron_lite.model import GPT
from megatron_lite.model.compile import compile_model
from megatron_lite.model.variants import variant_named

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

    def __post_init__(self) -> None:
        for name in ("micro_batch", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be >= 1")


def profile_step(settings: ProfileSettings) -> str:
    """The profiler's table of ``settings.steps`` training steps on the current CUDA device."""
    if not torch.cuda.is_available():
        raise ValueError("profile_step needs a CUDA device")
    device = torch.device("cuda")
    config = config_lib.load(REPO / settings.config_path, [*variant_named(settings.label).overrides, "precision=bf16"])
    torch.manual_seed(config.seed)
    with device:
        model = GPT(config.model).to(torch.bfloat16).train()
    model.lm_head.gemm = settings.loss_gemm
    if settings.compile_mode is not None:
        compile_model(model, settings.compile_mode)  # type: ignore[arg-type]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    shape = (settings.micro_batch, config.model.seq_length + 1)
    batch = torch.randint(0, config.model.vocab_size, shape, device=device)

    def step() -> None:
        model(batch[:, :-1], labels=batch[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(settings.warmup_steps):
        step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(settings.steps):
            step()
        torch.cuda.synchronize()
    mode = settings.compile_mode or "eager"
    title = (f"{settings.label}, {mode}, loss gemm {settings.loss_gemm}, micro batch {settings.micro_batch} x "
             f"{config.model.seq_length}, bf16, {settings.steps} steps on {torch.cuda.get_device_name()}")
    return title + "\n" + profiler.key_averages().table(sort_by="self_cuda_time_total", row_limit=settings.row_limit,
                                                        max_name_column_width=70)
