"""The run's DeepSpeed engine: model, the stage's freezing, compile, optimizer; built at the start of a run
(seeded weights, train.init_from's, or a stage boundary's) and rebuilt at each stage boundary."""

from __future__ import annotations

import contextlib
import gc
import io
from pathlib import Path
from typing import Any

import torch

from megatron_lite.config import Config
from megatron_lite.console import console, notice
from megatron_lite.model import GPT
from megatron_lite.model.compile import compile_model
from megatron_lite.model.float8 import apply_float8, float8_problem
from megatron_lite.training.deepspeed_config import (BatchSizes, bf16_accumulation_notice, bf16_zero0_sync_notice,
                                                     deepspeed_config)
from megatron_lite.training.distributed import DistributedInfo
from megatron_lite.training.optim import SkippableAdamW, build_optimizer
from megatron_lite.training.sequence_parallel import sequence_parallel_mpu
from megatron_lite.training.stages import Selection, Stage, apply_selection, select, stage_at, stage_summary
from megatron_lite.weights import load_state_dict, load_step_state_dict, load_weights


class StagedEngine:
    """The engine of the current stage (the whole run when it has no train.stages) and its optimizer.

    ``engine`` and ``optimizer`` change at a stage boundary (``next_stage``): read them from here each step."""

    def __init__(self, config: Config, batch_sizes: BatchSizes, dist_info: DistributedInfo, stages: list[Stage],
                 model: GPT, stage: Stage | None, load_universal: bool = False) -> None:
        self.config, self.batch_sizes, self.dist_info, self.stages = config, batch_sizes, dist_info, stages
        self.stage = stage
        self.engine: Any  # deepspeed.DeepSpeedEngine
        self.optimizer: SkippableAdamW
        self.selection: Selection | None  # the stage's trainable parameters; None without train.stages
        self.compiled: bool
        self.cuda_graphs: bool  # the compiled graphs replay as CUDA graphs (train.cuda_graphs on a CUDA device)
        self._build(model, load_universal)

    @property
    def stage_index(self) -> int:
        """The current stage's train.stages index; 0 without stages (as checkpoints record it)."""
        return self.stage.index if self.stage is not None else 0

    def _build(self, model: GPT, load_universal: bool) -> None:
        """``stage``'s parameters frozen first, so the optimizer and DeepSpeed hold state for its trainable
        elements only. ``load_universal``: the engine's one load will be a universal checkpoint (a resume on
        another number of ranks); DeepSpeed fixes that at initialize, so only the first engine of a run has it."""
        import deepspeed

        from megatron_lite.training import checkpoint_engine, fp32_grad_sums

        self.selection = None
        if self.stage is not None:
            self.selection = select(model, self.stage.trainable, stage_key(self.stage))
            apply_selection(model, self.selection)
        model.use_loss_settings(self.config.train)
        _convert_float8(model, self.config, self.dist_info.is_main)  # after the loss settings, before compile
        mpu = sequence_parallel_mpu(self.config.train.sequence_parallel_size)
        if mpu is not None:
            model.enable_sequence_parallel(mpu.get_sequence_parallel_group())
        self.compiled, self.cuda_graphs = _compile_in_place(model, self.config, self.dist_info)
        self.optimizer = build_optimizer(model, self.config.train)
        ds_config = deepspeed_config(self.config, self.batch_sizes)
        ds_config["checkpoint"] = {**ds_config.get("checkpoint", {}), "load_universal": load_universal}
        # BF16_Optimizer (bf16 at ZeRO 1, train.grad_accum_dtype=fp32) prints 18 lines of memory figures as it starts
        with contextlib.redirect_stdout(io.StringIO()):
            self.engine, *_ = deepspeed.initialize(model=model, optimizer=self.optimizer, mpu=mpu, config=ds_config)
        flat_sums = fp32_grad_sums.install(self.engine.optimizer)  # ZeRO 1's float32 sums: an add_ per group
        problem = cuda_graphs_problem(self.cuda_graphs, self.batch_sizes.gradient_accumulation_steps, flat_sums)
        if problem and self.config.train.cuda_graphs is None:  # flat_sums_expected and fp32_grad_sums disagree
            raise RuntimeError(f"train.cuda_graphs=null chose CUDA graphs, but {problem}; "
                               "set train.cuda_graphs=false")
        if problem:
            raise ValueError(problem)
        checkpoint_engine.install(self.engine, self.dist_info.rank)  # safe loads, hashed writes, no rank left in a barrier

    def evaluating(self) -> contextlib.AbstractContextManager[Any]:
        """The context of an evaluation's forwards: with CUDA graphs, torch.compile's eager stance, so that an
        evaluation's shapes (the extrapolation curve's lengths) and grad mode neither recompile nor record graphs
        beside the training ones; else nothing."""
        return torch.compiler.set_stance("force_eager") if self.cuda_graphs else contextlib.nullcontext()

    def next_stage(self, saved: Path, step: int) -> None:
        """Start the stage holding step ``step`` + 1 exactly as a resume from the boundary checkpoint ``saved``
        does: a new model with its consolidated weights, the stage's freezing, a new optimizer and engine."""
        self.engine.destroy()
        del self.engine, self.optimizer  # the previous stage's model and optimizer state go before the next ones come
        if self.cuda_graphs:  # the graph trees recorded over the old parameters, and their memory pools
            torch._dynamo.reset()
        gc.collect()
        if self.dist_info.device.type == "cuda":
            torch.cuda.empty_cache()
        self.stage = stage_at(self.stages, step)
        cuda = [self.dist_info.device.index or 0] if self.dist_info.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):  # as in a resume, where the checkpoint's RNG state is restored after
            model = new_model(self.config, self.dist_info)
            load_weights(model, consolidated(saved), f"stage start from {saved}")
            self._build(model, load_universal=False)  # a stage starts from weights, never from a universal load
        if self.dist_info.is_main:
            self.log_stage()

    def log_stage(self) -> None:
        if self.stage is not None and self.selection is not None:
            console(stage_summary(self.stage, len(self.stages), self.selection))
        console(self.optimizer.groups_summary)


def resumes_weights_only(stages: list[Stage], resume_dir: Path | None, marker: dict[str, Any]) -> bool:
    """Whether a resume takes the checkpoint's weights only: one written at the end of a stage starts the next
    stage from its weights, with a new engine and fresh optimizer state."""
    stage = stage_at(stages, marker.get("step", 0)) if stages else None
    return stage is not None and resume_dir is not None and marker.get("stage", 0) != stage.index


def start_engine(config: Config, batch_sizes: BatchSizes, dist_info: DistributedInfo, stages: list[Stage],
                 resume_dir: Path | None, marker: dict[str, Any], load_universal: bool = False
                 ) -> tuple[StagedEngine, bool]:
    """The engine a run starts with, and whether its resume takes the checkpoint's weights only.

    A checkpoint holds the optimizer state of the stage that wrote it (0 in older ones); one written at the
    end of a stage starts the next stage from its weights (``resumes_weights_only``). ``load_universal``: the
    resume loads the checkpoint's universal conversion (``checkpointing.plan_resume``)."""
    stage = stage_at(stages, marker.get("step", 0)) if stages else None
    weights_only = resumes_weights_only(stages, resume_dir, marker)
    problem = float8_problem(config.train.fp8, config.train.fused_loss, dist_info.device)
    if problem:  # before the model is built: a run that cannot train in FP8 stops at once
        raise ValueError(problem)
    for line in (bf16_accumulation_notice(config, batch_sizes), bf16_zero0_sync_notice(config, dist_info.device.type)):
        if line and dist_info.is_main:
            notice(line)
    if use_tf32(config, dist_info.device):
        enable_tf32()
    torch.manual_seed(config.seed)
    model = new_model(config, dist_info)
    for each in stages:  # every stage's patterns checked now, not hours later at its start
        select(model, each.trainable, stage_key(each))
    if resume_dir is None and config.train.init_from:
        state, _, _ = load_state_dict(config.train.init_from)  # weights only; every tensor must match the config
        load_weights(model, state, f"train.init_from={config.train.init_from}")
        if dist_info.is_main:
            console(f"initialised weights from {config.train.init_from}")
    elif weights_only:
        assert resume_dir is not None
        load_weights(model, consolidated(resume_dir), f"stage start from {resume_dir}")
    return StagedEngine(config, batch_sizes, dist_info, stages, model, stage, load_universal), weights_only


def new_model(config: Config, dist_info: DistributedInfo) -> GPT:
    with torch.device(dist_info.device):
        return GPT(config.model)  # fp32 master weights; DeepSpeed casts for bf16/fp16


def _convert_float8(model: GPT, config: Config, is_main: bool) -> None:
    """train.fp8's GEMMs in float8 (model/float8.py), in place: each engine's new model, a stage's too."""
    if config.train.fp8 == "none":
        return
    plan = apply_float8(model, config.train.fp8)
    if not is_main:
        return
    console(plan.summary())
    skipped = plan.skipped_notice()
    if skipped:
        notice(skipped)
    if plan.head and config.train.loss_gemm != "mixed":
        notice(f"train.loss_gemm={config.train.loss_gemm}: the LM head's GEMMs run in FP8 "
               f"(train.fp8={config.train.fp8}), the setting does not apply")


def stage_key(stage: Stage) -> str:
    return f"train.stages[{stage.index}].trainable"


def consolidated(step_dir: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's fp32 weights by DeepSpeed's consolidation, whose progress prints are left out of the log."""
    with contextlib.redirect_stdout(io.StringIO()):
        return load_step_state_dict(step_dir)


def use_compile(config: Config, device: torch.device) -> bool:
    """train.compile, where null means on for CUDA and off on CPU (compiling costs more than it saves
    on CPU at the sizes that train there)."""
    return config.train.compile if config.train.compile is not None else device.type == "cuda"


def use_cuda_graphs(config: Config, device: torch.device) -> bool:
    """train.cuda_graphs for a compiled run, where null means on wherever the setup is the one measured to gain
    (one H200: the paper config at micro batch 16, 30.8% -> 43.5% MFU, the same losses; docs/performance.md): regional
    compile on a CUDA device, bf16 with ZeRO 1's flat float32 sums (each micro batch's gradients taken out of the
    graphs' memory at once, whatever the accumulation), no sequence parallelism, no activation checkpointing
    (untried with graphs), no C++ wrapper (which graphs replace); off elsewhere, silently."""
    train = config.train
    if train.cuda_graphs is not None:
        return train.cuda_graphs and device.type == "cuda"
    return (device.type == "cuda" and train.compile_mode == "regional" and config.precision == "bf16"
            and train.sequence_parallel_size == 1 and not config.model.checkpoint_activations
            and not train.compile_cpp_wrapper and flat_sums_expected(config))


def flat_sums_expected(config: Config) -> bool:
    """Whether the engine will sum each micro batch's gradients out of the model in float32
    (``fp32_grad_sums.install``): DeepSpeed's BF16_Optimizer at ZeRO 1 with float32 sums, its per-tensor hooks
    (``bf16.immediate_grad_update``) not asked for in train.deepspeed."""
    train = config.train
    bf16 = train.deepspeed.get("bf16")
    hooks = isinstance(bf16, dict) and bool(bf16.get("immediate_grad_update"))
    return config.precision == "bf16" and train.zero_stage == 1 and train.grad_accum_dtype == "fp32" and not hooks


def use_tf32(config: Config, device: torch.device) -> bool:
    """train.tf32, where null means on for CUDA and off on CPU."""
    return config.train.tf32 if config.train.tf32 is not None else device.type == "cuda"


def enable_tf32() -> None:
    """TensorFloat-32 for float32 matmuls (cuBLAS) and cuDNN. The pair of ``allow_tf32`` flags, not the newer
    ``fp32_precision`` properties: on torch 2.13 setting only ``torch.backends.cuda.matmul.fp32_precision`` makes
    ``torch.get_float32_matmul_precision()`` raise (a "mix of the legacy and new APIs"), which inductor calls,
    while these flags keep both views consistent (``fp32_precision`` "tf32", matmul precision "high"), warn about
    nothing, and leave CPU (mkldnn) matmuls alone, unlike ``set_float32_matmul_precision("high")``. Inductor's
    "TensorFloat32 tensor cores ... not enabled" warning checks ``fp32_precision != "tf32"``."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


# The first compiled step at 350M (24 layers, micro batch 16 x 512, bf16) on one H200, torch 2.11.0+cu130, with
# inductor's caches off: forward + backward of the model alone took 14.1 s regional and 64.6 s whole (2026-11-26,
# whole with train.loss_gemm=input_dtype); the users' command's first step (whole, in DeepSpeed's engine) 67.9 s
# (docs/performance.md). Rough by design: the line tells a user why the first step is slow, it predicts nothing.
COMPILE_FIRST_STEP_SECONDS = {"regional": 15, "whole": 70}
_COMPILE_WHAT = {"regional": "the repeated block once", "whole": "the whole model as one graph"}


def compile_announcement(mode: str, cuda_graphs: bool = False, cpp_wrapper: bool = False,
                         blocks_per_region: int = 1) -> str:
    """The one line a compiled run prints before its first step."""
    what = _COMPILE_WHAT[mode] if blocks_per_region == 1 else f"the repeated group of {blocks_per_region} blocks once"
    # inductor's graph trees run each region eagerly in the first micro batch, record it in the second
    graphs = "; its CUDA graphs recorded in the second micro batch" if cuda_graphs else ""
    # a group's graph is larger than a block's: its compile longer (1.2-1.3x for 4 blocks on a CPU; on a GPU unmeasured)
    groups = f" for single blocks, more for groups of {blocks_per_region}" if blocks_per_region > 1 else ""
    wrapper = ", and more for the C++ wrappers" if cpp_wrapper else ""
    return (f"compiling the model ({mode}: {what}{graphs}; the first step takes about "
            f"{COMPILE_FIRST_STEP_SECONDS[mode]} s at 350M on a GPU{groups}{wrapper})")


def cuda_graphs_problem(cuda_graphs: bool, accumulation: int, flat_sums: bool) -> str | None:
    """Why this engine cannot train with CUDA graphs, or None. A gradient that autograd writes during a replay lives
    in the graphs' memory, which the next micro batch's replay overwrites: accumulating into it across micro batches
    is wrong (inductor poisons it). The flat float32 sums (``fp32_grad_sums``) take each micro batch's gradients
    out and release them at the end of its backward; without them, only one micro batch per step is safe."""
    if not cuda_graphs or accumulation == 1 or flat_sums:
        return None
    return (f"train.cuda_graphs=true with {accumulation} micro batches per step: gradients accumulated across CUDA "
            "graph replays would be overwritten; use precision=bf16, train.zero_stage=1 and "
            "train.grad_accum_dtype=fp32 (each micro batch's gradients summed out of the graphs), or one micro batch "
            "per step")


def _compile_in_place(model: torch.nn.Module, config: Config, dist_info: DistributedInfo) -> tuple[bool, bool]:
    """``compile_model`` as train.compile_mode says (each block, or the model's whole call): in place, so its
    state-dict keys stay as they are (no ``_orig_mod.`` prefix) and checkpoints move freely between compiled
    and eager runs. Returns (compiled, with CUDA graphs)."""
    if not use_compile(config, dist_info.device):
        setting = {None: "null", True: "true", False: "false"}[config.train.compile]
        train = config.train
        for key, is_set, what in (("cuda_graphs", train.cuda_graphs, "CUDA graphs replay"),
                                  ("compile_cpp_wrapper", train.compile_cpp_wrapper, "the C++ wrapper launches"),
                                  ("compile_options", bool(train.compile_options), "inductor's settings shape"),
                                  ("compile_blocks_per_region", train.compile_blocks_per_region != 1,
                                   "block groups are the regions of")):
            if is_set and dist_info.is_main:
                notice(f"train.{key}: {what} compiled graphs, and this run trains eagerly "
                       f"(train.compile={setting} on {dist_info.device.type}); the setting is ignored")
        return False, False
    if config.train.zero_stage == 3:  # ZeRO-3 gathers parameters in module hooks that a compiled graph would trace
        if dist_info.is_main:
            notice("train.compile: not with train.zero_stage=3 (its parameter-gathering hooks do not trace); "
                   "training eagerly")
        return False, False
    cuda_graphs = use_cuda_graphs(config, dist_info.device)
    if config.train.cuda_graphs and not cuda_graphs and dist_info.is_main:
        notice(f"train.cuda_graphs: CUDA graphs need a CUDA device, this run's is {dist_info.device.type}; "
               "compiled without them")
    compile_model(model, config.train.compile_mode, cuda_graphs=cuda_graphs,
                  cpp_wrapper=config.train.compile_cpp_wrapper, inductor=config.train.compile_options,
                  blocks_per_region=config.train.compile_blocks_per_region)
    return True, cuda_graphs
