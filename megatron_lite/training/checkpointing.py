"""Resuming training checkpoints (their directories: megatron_lite/checkpoint_dirs.py; writing them:
megatron_lite/training/checkpointer.py).

A checkpoint counts only once it is complete: every rank's files written and hashed, all ranks agreed, then rank 0
wrote the manifest of every file's size and sha256 (``megatron_lite.checkpoint_integrity``), the COMPLETE marker,
and only then flipped ``latest``. A resume first verifies the checkpoint against its manifest (each rank its
share) and ``auto`` falls back to an older one when that fails.

A run continues on another number of ranks (``plan_resume``): a ZeRO 1-3 checkpoint is converted once
into DeepSpeed's universal checkpoint inside its step dir (rank 0, under a lock; the other ranks wait),
verified like the rest, and loaded with ``checkpoint.load_universal``; ZeRO 0 needs no conversion.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_lite import checkpoint_dirs
from megatron_lite import config as config_lib
from megatron_lite.checkpoint_integrity import MANIFEST_FILE, Verification, safe_load, verify_checkpoint
from megatron_lite.convert import universal
from megatron_lite.config import Config
from megatron_lite.console import notice
from megatron_lite.training import identity, rng
from megatron_lite.training.distributed import DistributedInfo, all_gather_objects, all_reduce_sum
from megatron_lite.training.optim import set_fused
from megatron_lite.weights import expected_shapes

UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"  # deepspeed.checkpoint.constants: ds_to_universal needs it

# Keys whose change on resume is allowed (with a warning): they do not change tensor shapes.
SCHEDULE_KEYS = ("train_iters", "train_epochs", "lr", "min_lr", "warmup", "warmup_start_lr", "lr_decay_style",
                 "stages", "stage_schedule")


@dataclass
class TrainingState:
    """What a checkpoint adds to DeepSpeed's model/optimizer state."""

    step: int = 0  # optimizer steps done
    consumed_samples: int = 0  # global samples trained on
    skipped_steps: int = 0  # updates skipped for a non-finite loss
    total_steps: int = 0  # train_iters when saved
    stage: int = 0  # train.stages index (0-based) of the engine that wrote the checkpoint; 0 without stages

    def to_client_state(self) -> dict[str, Any]:
        return {"megatron_lite": dict(self.__dict__)}

    @classmethod
    def from_client_state(cls, client_state: dict[str, Any]) -> TrainingState:
        return cls(**client_state["megatron_lite"])


def rng_state_file(step_dir: Path, rank: int) -> Path:
    return step_dir / f"rng_state_rank{rank:05d}.pt"


def this_history(complete: list[Path], step: int) -> list[Path]:
    """The complete checkpoints (oldest first) up to ``step``, the newest save's: after a step is redone
    (``--resume none`` in the same run dir, a rollback), higher ones are another history's, which pruning must
    not count (it would delete the new save) and ``--resume auto``'s fallback must not pick."""
    return [path for path in complete if (checkpoint_dirs.checkpoint_step(path) or 0) <= step]


def _verify_everywhere(step_dir: Path, dist_info: DistributedInfo, round_robin: bool = False,
                       derived: bool = True) -> Verification:
    """Each rank checks its share of ``step_dir`` (the files it would have written, or ``round_robin``); all ranks
    get every problem. ``derived=False``: the step dir's own files only, not its ``universal/`` conversion."""
    mine = verify_checkpoint(step_dir, dist_info.rank, dist_info.world_size, round_robin, derived)
    everyone = all_gather_objects(mine)
    return Verification([problem for result in everyone for problem in result.problems], mine.has_manifest,
                        sum(result.files_checked for result in everyone), any(result.unsafe for result in everyone),
                        any(result.unlisted for result in everyone))


def find_resume_checkpoint(resume: str, run_dir: Path, dist_info: DistributedInfo) -> Path | None:
    """The verified checkpoint to resume from. ``auto``: the run dir's newest complete checkpoint that passes
    verification (one that fails is skipped with a notice naming it; None when there is none at all);
    ``none``; or a path, which must pass verification (ValueError otherwise)."""
    if resume == "none":
        return None
    if resume == "auto":
        checkpoints = run_dir / checkpoint_dirs.CHECKPOINTS_DIR
        latest = checkpoint_dirs.latest_complete(checkpoints)
        if latest is None:
            return None
        older = this_history(checkpoint_dirs.complete_checkpoints(checkpoints),
                              checkpoint_dirs.checkpoint_step(latest) or 0)
        candidates = [latest] + [p for p in reversed(older) if p != latest]
        for step_dir in candidates:
            result = _verify_everywhere(step_dir, dist_info, derived=False)
            if result.ok:
                _note_unverified(step_dir, result, dist_info)
                return step_dir
            if dist_info.is_main:
                notice(f"--resume auto: skipping {step_dir}: {result.summary()}; trying the previous "
                       "complete checkpoint")
        raise ValueError(f"--resume auto: none of the {len(candidates)} complete checkpoint(s) in {checkpoints} passes "
                         "verification (see the warnings above); restore or remove them, or start over with "
                         "--resume none")
    step_dir = checkpoint_dirs.resolve_checkpoint(resume)
    if not checkpoint_dirs.is_complete(step_dir):
        raise ValueError(f"--resume {resume}: {step_dir} is not a complete checkpoint "
                         f"(no {checkpoint_dirs.COMPLETE_MARKER})")
    result = _verify_everywhere(step_dir, dist_info, derived=False)
    if not result.ok:
        raise ValueError(f"--resume {resume}: {step_dir} fails verification: {result.summary()}")
    _note_unverified(step_dir, result, dist_info)
    return step_dir


def _note_unverified(step_dir: Path, result: Verification, dist_info: DistributedInfo) -> None:
    if not result.has_manifest and dist_info.is_main:
        notice(f"{step_dir}: no {MANIFEST_FILE} (not saved by megatron_lite's training loop, or by an older version): file sizes and checksums not "
               "verified, only that its pickles hold checkpoint types")


def check_resume_compatible(step_dir: Path, config: Config) -> None:
    """ValueError naming (one short line) each change of the model's identity (identity.IDENTITY_KEYS), else
    every tensor whose shape differs; notices for other position settings and schedule changes."""
    saved = config_lib.load(step_dir / checkpoint_dirs.CONFIG_FILE)
    changes = identity.model_changes(saved.model, config.model)
    refused = identity.identity_changes(changes)
    if refused:
        raise ValueError(f"cannot resume: {'; '.join(refused)} (a run keeps its model; start a new run dir from "
                         "its weights with train.init_from)")
    old, new = expected_shapes(saved.model), expected_shapes(config.model)
    names = list(new) + [name for name in old if name not in new]  # model order: embed_in first
    problems = [f"{name}: checkpoint {old.get(name)} vs config {new.get(name)}"
                for name in names if old.get(name) != new.get(name)]
    if problems:
        raise ValueError(f"cannot resume from {step_dir}: model shape differs from the config "
                         f"({len(problems)} tensors): " + "; ".join(problems[:5]) + (" ..." if len(problems) > 5 else ""))
    for key, before, after in changes:
        if key.startswith("model.position."):
            notice(f"resuming with {key} changed from {before!r} to {after!r}")
    for key in SCHEDULE_KEYS:
        before, after = getattr(saved.train, key), getattr(config.train, key)
        if before != after:
            notice(f"resuming with train.{key} changed from {before} to {after}; the schedule follows the new value")


@dataclass(frozen=True)
class ResumePlan:
    """How a verified checkpoint loads on this run's ranks."""

    step_dir: Path
    universal: bool  # DeepSpeed loads <step_dir>/universal with checkpoint.load_universal (decided before initialize)
    saved_world_size: int


def plan_resume(step_dir: Path, marker: dict[str, Any], config: Config, dist_info: DistributedInfo) -> ResumePlan:
    """The same world size loads the step dir as saved (also into the other of ZeRO 1 and 2; other changes of
    the ZeRO stage are refused in one line, before DeepSpeed starts). Another one: ZeRO 0 loads as saved too (its
    optimizer state is whole on every rank); ZeRO 1-3 loads the step's universal conversion, made now by rank 0
    unless a current one is there, then verified by all ranks. One notice line says which."""
    if dist_info.is_main:  # any resume, on any number of ranks, converting or not
        universal.remove_interrupted_conversions(step_dir)
    saved_world = int(marker.get("world_size", dist_info.world_size))
    saved_zero, zero = int(marker.get("zero_stage", config.train.zero_stage)), config.train.zero_stage
    moved = f"resuming {step_dir} (saved by {saved_world} rank(s)) on {dist_info.world_size} rank(s)"
    if saved_zero != zero and saved_world != dist_info.world_size:  # each stage names and partitions its files
        raise ValueError(f"{moved}: train.zero_stage={zero} but the checkpoint is ZeRO {saved_zero}; on another "
                         "number of ranks a run keeps its ZeRO stage (change it in a resume on the old number)")
    if saved_zero != zero and {saved_zero, zero} != {1, 2}:  # before DeepSpeed fails on it with a traceback
        raise ValueError(f"cannot resume {step_dir} at ZeRO {zero}: it was saved at ZeRO {saved_zero}, and a "
                         "checkpoint changes its ZeRO stage only between 1 and 2 (ZeRO 0 keeps a plain optimizer's state, ZeRO 3 "
                         f"files of its own); keep train.zero_stage={saved_zero}, or start a new run dir from its "
                         "weights with train.init_from")
    if saved_world == dist_info.world_size:  # ZeRO 1 and 2 write the same files: either loads the other's
        return ResumePlan(step_dir, False, saved_world)
    rng_note = _rng_note(saved_world, dist_info.world_size)
    if zero == 0:
        if dist_info.is_main:
            notice(f"{moved}: ZeRO 0 loads as saved; {rng_note}")
        return ResumePlan(step_dir, False, saved_world)
    started = time.perf_counter()
    converted = _universal_on_rank0(step_dir, dist_info)
    result = _verify_everywhere(universal.universal_dir(step_dir), dist_info, round_robin=True)
    if not result.ok and not (result.unsafe or result.unlisted):  # damage (truncated, changed, unreadable): rebuilt
        if dist_info.is_main:
            notice(f"{universal.universal_dir(step_dir)}: fails verification ({result.summary()}); deleting it and "
                   "converting the step dir again")
        converted = _universal_on_rank0(step_dir, dist_info, rebuild=True)
        result = _verify_everywhere(universal.universal_dir(step_dir), dist_info, round_robin=True)
    if not result.ok:  # a refused pickle or a planted file: files added after the conversion, named, not removed
        raise ValueError(f"{moved}: its universal checkpoint fails verification: {result.summary()}")
    if dist_info.is_main:
        how = f"converted it in {time.perf_counter() - started:.1f} s" if converted else "reusing the conversion"
        notice(f"{moved}: loading DeepSpeed's universal checkpoint {universal.universal_dir(step_dir)} ({how}); "
               f"{rng_note}")
    return ResumePlan(step_dir, True, saved_world)


def _rng_note(saved_world: int, world_size: int) -> str:
    if world_size > saved_world:
        return (f"ranks {saved_world}-{world_size - 1} seed their RNG from (seed, rank, step), the others continue "
                "their streams")
    if world_size == 1:
        return "rank 0 continues its RNG stream"
    return f"ranks 0-{world_size - 1} continue their RNG streams"


def _universal_on_rank0(step_dir: Path, dist_info: DistributedInfo, rebuild: bool = False) -> bool:
    """Rank 0 converts ``step_dir`` unless a current conversion is there (under the step dir's lock, so a
    second resume of the same checkpoint waits and then reuses it); a stale one (made from another save of the
    step, or without its manifest) or, with ``rebuild``, any one is deleted first. Every rank learns the outcome.
    Whether this call converted."""
    error: Exception | None = None
    converted = False
    if dist_info.is_main:
        try:
            with universal.conversion_lock(step_dir):
                state = universal.universal_state(step_dir)
                if state != "current" or rebuild:
                    if state not in ("current", "absent"):
                        notice(f"{universal.universal_dir(step_dir)}: stale ({state}); deleting it and converting "
                               "the step dir again")
                    universal.remove_universal(step_dir)
                    universal.convert_to_universal(step_dir, universal.universal_dir(step_dir))
                    converted = True
        except (ValueError, OSError) as caught:
            error = caught
    failed = all_reduce_sum([0.0 if error is None else 1.0], dist_info.device)[0]
    if error is not None:
        raise ValueError(f"cannot convert {step_dir} to a universal checkpoint: {error}") from error
    if failed:
        raise ValueError(f"cannot convert {step_dir} to a universal checkpoint (see rank 0's message)")
    return converted


def load_training_state(engine: Any, plan: ResumePlan, optimizer: Any) -> TrainingState:
    """Model, optimizer and counters from a complete checkpoint (its RNG state: ``restore_rng_state``)."""
    step_dir = plan.step_dir
    tag = checkpoint_dirs.UNIVERSAL_DIR if plan.universal else step_dir.name
    path, client_state = engine.load_checkpoint(str(step_dir if plan.universal else step_dir.parent), tag=tag,
                                                load_optimizer_states=True, load_lr_scheduler_states=False)
    if path is None or client_state is None:
        raise ValueError(f"DeepSpeed could not load the checkpoint {step_dir}")
    if plan.universal:
        _restore_param_groups(optimizer, universal.universal_dir(step_dir))
    set_fused(optimizer, optimizer.fused_wanted)  # the load took the checkpoint's flag; the run's config decides
    return TrainingState.from_client_state(client_state)


def _restore_param_groups(optimizer: Any, universal_dir: Path) -> None:
    """Each param group's saved settings (lr, betas, eps, weight decay, ...) and its own Adam step counter.
    DeepSpeed's ZeRO-3 universal load copies group 0's settings into every group (the no-decay group would get
    weight decay) and gives every group one shared ``step`` tensor, which each group's update then advances."""
    saved = safe_load(universal_dir / "zero" / "optimizer_state.pt")["param_groups"]  # verified already
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(f"{universal_dir}: {len(saved)} optimizer param groups saved, the run has "
                         f"{len(optimizer.param_groups)}")
    for group, saved_group in zip(optimizer.param_groups, saved):
        group.update({key: value for key, value in saved_group.items() if key != "params"})
    for state in optimizer.state.values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].clone()


def load_counters(step_dir: Path) -> TrainingState:
    """Counters (from the COMPLETE marker), without DeepSpeed's model/optimizer state: a stage that starts
    from the checkpoint of the previous stage's last step takes only these (and the RNG state)."""
    marker = checkpoint_dirs.read_complete_marker(step_dir)
    fields = {name: marker[name] for name in TrainingState.__dataclass_fields__ if name in marker}
    return TrainingState(**fields)


def restore_rng_state(step_dir: Path, dist_info: DistributedInfo, seed: int, step: int) -> None:
    """This rank's RNG state as saved at the checkpoint's step boundary; called last before the first step,
    so nothing set-up draws (engine, data, wandb) moves the streams that step draws from. A rank the checkpoint
    has no state for (a resume on more ranks) seeds from (seed, rank, step)."""
    rng_file = rng_state_file(step_dir, dist_info.rank)
    if rng_file.is_file():
        rng.restore(safe_load(rng_file), dist_info.device)
    else:
        rng.seed_new_rank(seed, dist_info.rank, step)
    saved_world = int(checkpoint_dirs.read_complete_marker(step_dir).get("world_size", dist_info.world_size))
    lost = not rng_file.is_file() and dist_info.rank < saved_world  # a rank that saved, yet its file is absent
    missing = all_reduce_sum([1.0 if lost else 0.0], dist_info.device)[0]
    if missing and dist_info.is_main:  # counted over ranks: notices print on rank 0 only
        notice(f"{step_dir}: no RNG state for {int(missing)} of {dist_info.world_size} rank(s) (saved by an older "
               "version?): they seed from (seed, rank, step)")
