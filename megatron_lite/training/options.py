"""The ``train:`` section of a run config: batch, optimiser, schedule, logging, checkpoints.

Key names follow GPT-NeoX / DeepSpeed where one exists (train_batch_size,
train_micro_batch_size_per_gpu, gradient_accumulation_steps, min_lr, warmup, zero_stage, ...).
Defaults are the paper's (arXiv 2309.08646 section 4).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


def _doc(help_text: str, **kwargs: Any) -> Any:  # same convention as megatron_lite.config
    return field(metadata={"help": help_text}, **kwargs)


@dataclass
class WandbConfig:
    """Weights & Biases logging; never prompts, never blocks."""

    mode: Literal["online", "offline", "disabled"] = _doc(
        "online (needs WANDB_API_KEY or `wandb login`; falls back to offline with a warning when there "
        "is none) | offline (files under <run-dir>/wandb, `wandb sync` later) | disabled.",
        default="offline",
    )
    project: str = _doc("wandb project.", default="megatron_lite")
    entity: str | None = _doc("wandb entity (team or user); null means your default.", default=None)
    name: str | None = _doc("Run name; null means the run directory's name.", default=None)
    tags: list[str] = _doc("Run tags.", default_factory=list)


@dataclass
class FaultInjectionConfig:
    """Test hooks that make failures happen on purpose (used by the robustness tests)."""

    nonfinite_loss_steps: list[int] = _doc(
        "Steps (1-based) whose loss is replaced by NaN on every rank, to exercise the skip logic.",
        default_factory=list,
    )
    kill_during_save_step: int | None = _doc(
        "SIGKILL this process after the DeepSpeed files of this step's checkpoint are written and before "
        "it is marked complete (simulates a crash mid-save).",
        default=None,
    )
    fail_save_step: int | None = _doc(
        "Raise OSError while saving this step's checkpoint (simulates a full disk).", default=None
    )


@dataclass
class TrainConfig:
    """Optimisation and run management (``train.*``)."""

    init_from: str | None = _doc(
        "Start from these weights (a run, step or consolidated dir, e.g. tools/convert_checkpoint.py --to "
        "megatron_lite output); optimizer, step and data position start fresh. Ignored when resuming.",
        default=None,
    )
    train_iters: int | None = _doc(
        "Optimizer steps; null means derived from train_epochs over the data mix.", default=None
    )
    train_epochs: float = _doc(
        "Passes over the mix's training tokens when train_iters is null (paper: 2).", default=2.0
    )
    train_batch_size: int | None = _doc(
        "Global batch in samples (= micro batch x gradient accumulation x data-parallel ranks); "
        "null means derived from the other two.",
        default=None,
    )
    train_micro_batch_size_per_gpu: int = _doc("Samples per rank per forward/backward.", default=16)
    gradient_accumulation_steps: int = _doc(
        "Micro batches per rank per optimizer step.", default=1
    )
    zero_stage: int = _doc("DeepSpeed ZeRO stage 0-3.", default=0)
    lr: float = _doc("Peak learning rate, reached at the end of warm-up (paper: 1e-4).", default=1.0e-4)
    min_lr: float = _doc("Learning rate at the last step (paper: 1e-5).", default=1.0e-5)
    warmup: float = _doc("Warm-up length as a fraction of train_iters (paper: 0.01).", default=0.01)
    warmup_start_lr: float = _doc("Learning rate at step 0 (paper: 1e-7).", default=1.0e-7)
    lr_decay_style: Literal["linear", "cosine", "constant"] = _doc(
        "Decay from lr to min_lr after warm-up (paper: linear).", default="linear"
    )
    adam_beta1: float = _doc("AdamW beta1 (paper: 0.9).", default=0.9)
    adam_beta2: float = _doc("AdamW beta2 (paper: 0.95).", default=0.95)
    adam_eps: float = _doc("AdamW epsilon.", default=1.0e-8)
    weight_decay: float = _doc(
        "Decoupled weight decay on >= 2-D weights (matmuls, embeddings); biases and LayerNorm get none.",
        default=0.1,
    )
    gradient_clipping: float = _doc("Clip the global gradient norm to this; 0 disables.", default=1.0)
    initial_loss_scale_power: int = _doc("fp16 only: dynamic loss scaling starts at 2**this.", default=16)
    log_interval: int = _doc("Steps between console/metrics.jsonl/wandb rows.", default=10)
    eval_interval: int = _doc("Steps between validation runs (and one at the end); 0 disables.", default=1000)
    eval_iters: int = _doc("Micro batches per validation run.", default=10)
    save_interval: int = _doc("Steps between checkpoints (and one at the end); 0 saves only at the end.", default=1000)
    keep_last_checkpoints: int = _doc("Complete checkpoints kept; older ones are deleted.", default=3)
    exit_interval: int | None = _doc(
        "Save a checkpoint and exit when the step is a multiple of this (Megatron's --exit-interval); "
        "for time-limited jobs that resubmit themselves with --resume auto.",
        default=None,
    )
    max_consecutive_nonfinite: int = _doc(
        "Stop after this many optimizer steps in a row whose loss was NaN/inf (each is skipped).", default=5
    )
    peak_tflops: float | None = _doc(
        "Peak TFLOP/s per device for the MFU column; null means known GPUs' bf16/fp16 peaks, else no MFU.",
        default=None,
    )
    num_workers: int = _doc("DataLoader worker processes per rank.", default=1)
    wandb: WandbConfig = _doc("Weights & Biases; see train.wandb.*.", default_factory=WandbConfig)
    deepspeed: dict[str, Any] = _doc(
        "Passthrough: merged last into the generated DeepSpeed config (any DeepSpeed key).", default_factory=dict
    )
    fault_injection: FaultInjectionConfig = _doc(
        "Deliberate failures for tests; see train.fault_injection.*.", default_factory=FaultInjectionConfig
    )
