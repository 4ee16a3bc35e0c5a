"""Model weights: reading them from any checkpoint directory, checking them against a config, and
the consolidated format (``config.yml`` + ``model.safetensors`` (+ ``tokenizer.model`` or ``tokenizer.json``), fp32
tensors named as ``GPT.state_dict()``) that ``save_consolidated`` writes.

``load_model(path)`` accepts a run dir, a step dir or a consolidated dir (``megatron_lite.checkpoint_dirs``).
"""

from __future__ import annotations

import json
import os
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_lite import checkpoint_dirs
from megatron_lite.checkpoint_integrity import (MANIFEST_FILE, CheckpointIntegrityError, UnsafeCheckpointError,
                                                offending_global, safe_load, verify_or_raise)
from megatron_lite import config as config_lib
from megatron_lite.config import Config, ModelConfig
from megatron_lite.console import notice
from megatron_lite.files import apply_umask

WEIGHTS_INDEX_FILE = checkpoint_dirs.WEIGHTS_INDEX_FILE


def _zero_stage(step_dir: Path) -> int:
    """The stage from the ds_config DeepSpeed stores in every model-states file."""
    files = sorted(step_dir.glob("*model_states.pt"))
    if not files:
        raise ValueError(f"{step_dir}: no *model_states.pt")
    state = safe_load(files[0], mmap=True)
    return int((state.get("ds_config") or {}).get("zero_optimization", {}).get("stage", 0))


def load_step_state_dict(step_dir: Path) -> dict[str, torch.Tensor]:
    """fp32 weights of one DeepSpeed tag dir, any ZeRO stage and world size (DeepSpeed's own utilities).

    The step dir is verified first (``checkpoint_integrity``): every file against its manifest, every
    pickle loaded with weights_only=True and the allow-list, so DeepSpeed's ``zero_to_fp32`` (which
    unpickles with weights_only=False) only ever sees files that hold checkpoint types.
    """
    result = verify_or_raise(step_dir)
    if not result.has_manifest:
        notice(f"{step_dir}: no {MANIFEST_FILE} (not saved by megatron_lite's training loop, or by an older version): file checksums not verified",
               stacklevel=3)
    bf16_optimizer_partitions = bf16_optimizer_files(step_dir)
    if bf16_optimizer_partitions:
        module = safe_load(sorted(step_dir.glob("*model_states.pt"))[0], mmap=True)["module"]
        state = complete_zero_state(bf16_optimizer_state_dict(bf16_optimizer_partitions, module), module)
    elif _zero_stage(step_dir) > 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(step_dir.parent), tag=step_dir.name)
        # a train.stages stage's QKV slots fused back; frozen tensors ZeRO-1 leaves out from the module copy
        module = safe_load(sorted(step_dir.glob("*model_states.pt"))[0], mmap=True)["module"]
        state = complete_zero_state(state, module)
    else:
        files = sorted(step_dir.glob("mp_rank_*_model_states.pt"))
        if not files:
            raise ValueError(f"{step_dir}: no mp_rank_*_model_states.pt")
        state = safe_load(files[0])["module"]
    # detached: DeepSpeed's ZeRO consolidation can hand back tensors that require grad
    return {name: (tensor.float() if tensor.is_floating_point() else tensor).detach() for name, tensor in state.items()}


def bf16_optimizer_files(step_dir: Path) -> list[Path]:
    """The per-rank files of DeepSpeed's BF16_Optimizer (bf16 at ZeRO 1 with float32 gradient accumulation), by
    data-parallel rank; empty for any other checkpoint. Every bf16 ZeRO checkpoint names its files ``bf16_zero_*``;
    BF16_Optimizer's state is told apart by its fragment map and the absence of a ZeRO stage."""
    files = sorted(step_dir.glob("bf16_zero_pp_rank_*_mp_rank_00_optim_states.pt"),
                   key=lambda path: int(path.name.split("_")[4]))
    if not files:
        return []
    saved = safe_load(files[0], mmap=True)["optimizer_state_dict"]
    return files if "param_slice_mappings" in saved and "zero_stage" not in saved else []


def bf16_optimizer_state_dict(files: list[Path], module_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fp32 master weights of a BF16_Optimizer checkpoint (``files``: ``bf16_optimizer_files``), which DeepSpeed's
    ``zero_to_fp32`` does not read.

    Each rank's file holds, per parameter group, its contiguous slice of the group's flat float32 parameters
    (``single_partition_of_fp32_groups``) and where each parameter's fragment lies in it (``param_slice_mappings``:
    name -> (numel, start)); a parameter cut by a partition boundary continues at the start of the next rank's
    slice, so its fragments in rank order make it whole. Shapes come from the module's own state dict."""
    fragments: dict[str, list[torch.Tensor]] = {}
    for file in files:
        saved = safe_load(file, mmap=True)["optimizer_state_dict"]  # mapped: the Adam moments are never read
        for partition, mapping in zip(saved["single_partition_of_fp32_groups"], saved["param_slice_mappings"],
                                      strict=True):
            for name, address in mapping.items():
                fragments.setdefault(name, []).append(partition.narrow(0, address.start, address.numel))
    state = {}
    for name, pieces in fragments.items():
        flat = torch.cat(pieces)
        if name not in module_state or flat.numel() != module_state[name].numel():
            raise CheckpointIntegrityError(f"{files[0].parent}: the optimizer's fp32 {name} ({flat.numel()} elements) "
                                           "does not match the module's")
        state[name] = flat.view(module_state[name].shape)
    return state


def complete_zero_state(state: dict[str, torch.Tensor], module_state: dict[str, torch.Tensor]
                        ) -> dict[str, torch.Tensor]:
    """DeepSpeed's ZeRO consolidation of a checkpoint made model-shaped: QKV slots joined, and tensors it
    leaves out (ZeRO-1 keeps no copy of parameters outside the optimizer) taken from the module's own
    state_dict, which ZeRO-1/2 save whole (ZeRO-3 saves frozen fragments, which DeepSpeed consolidates)."""
    from megatron_lite.model.qkv_slots import join_qkv_slots

    joined = join_qkv_slots(state, module_state)
    for name, tensor in module_state.items():
        if name not in joined and tensor.numel() > 0:
            joined[name] = tensor
    return joined


def load_state_dict(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], Config, Path | None]:
    """(fp32 state dict, config, tokenizer path or None) of a run, step or consolidated dir."""
    resolved = checkpoint_dirs.resolve_checkpoint(path)
    kind = checkpoint_dirs.checkpoint_kind(resolved)
    if kind == "consolidated":
        state = {}
        for file in weight_files(resolved):
            state.update(read_weight_file(file))
        config = config_lib.load(resolved / checkpoint_dirs.CONFIG_FILE)
    elif kind == "step":
        state = load_step_state_dict(resolved)
        config = config_lib.load(checkpoint_dirs.step_config_file(resolved))
    else:
        raise ValueError(f"{resolved}: a Hugging Face dir; convert it first with tools/convert_checkpoint.py --to megatron_lite")
    return state, config, checkpoint_dirs.find_tokenizer(resolved)


def read_weight_file(path: Path) -> dict[str, torch.Tensor]:
    """One safetensors file, or a legacy .bin through ``torch.load(weights_only=True)`` (no arbitrary pickles):
    a pickle naming anything but tensors is refused in one line (UnsafeCheckpointError), as is an unreadable file."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise UnsafeCheckpointError(
            f"{path}: a pickled checkpoint that may run code (it names {offending_global(path, error)}, not only "
            "tensors): not loaded; where you trust it, convert it to safetensors first (transformers: "
            "from_pretrained(dir).save_pretrained(dir, safe_serialization=True))") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile) as error:
        first = str(error).strip().splitlines()
        raise CheckpointIntegrityError(f"{path}: unreadable ({type(error).__name__}: "
                                       f"{first[0] if first else ''})") from None


def weight_files(consolidated_dir: Path) -> list[Path]:
    """The safetensors files of a consolidated dir: model.safetensors, or the shards its index names."""
    index = consolidated_dir / WEIGHTS_INDEX_FILE
    if index.is_file():
        return [consolidated_dir / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [consolidated_dir / checkpoint_dirs.WEIGHTS_FILE]


def expected_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in ``GPT(model).state_dict()`` (built on the meta device, no memory)."""
    from megatron_lite.model import GPT

    with torch.device("meta"):
        instance = GPT(model)
    return {name: tuple(tensor.shape) for name, tensor in instance.state_dict().items()}


def check_tensors(state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], source: str) -> None:
    """One ValueError listing every missing, unexpected and mis-shaped tensor (nothing when all match)."""
    check_shapes({name: tuple(tensor.shape) for name, tensor in state.items()}, expected, source)


def check_shapes(shapes: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], source: str) -> None:
    """``check_tensors`` on names and shapes alone (a checkpoint read shard by shard)."""
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    misshaped = sorted(
        f"{name} {shapes[name]} (expected {expected[name]})"
        for name in set(shapes) & set(expected)
        if shapes[name] != expected[name]
    )
    problems = [f"missing: {', '.join(missing)}"] if missing else []
    problems += [f"unexpected: {', '.join(unexpected)}"] if unexpected else []
    problems += [f"wrong shape: {', '.join(misshaped)}"] if misshaped else []
    if problems:
        raise ValueError(f"{source}: tensors do not match the model config — " + "; ".join(problems))


def load_weights(model: torch.nn.Module, state: dict[str, torch.Tensor], context: str) -> None:
    """Strict load; one ValueError (prefixed by ``context``) listing missing, unexpected and mis-shaped tensors."""
    check_tensors(state, {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}, context)
    model.load_state_dict(state)


@dataclass
class LoadedModel:
    model: Any  # megatron_lite.model.GPT, in eval mode
    config: Config
    tokenizer_path: Path | None
    source: Path  # the directory the weights came from


def load_model(path: str | os.PathLike[str], device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
               overrides: list[str] | None = None) -> LoadedModel:
    """Build the model a checkpoint describes and load its weights (strict: every tensor must match).

    ``overrides`` are ``--set`` style keys applied to the saved config (e.g. a RoPE scaling or an
    attention backend for evaluation); they must not change the parameter shapes.
    """
    from megatron_lite.model import GPT
    from megatron_lite.model.attention import flash_available

    state, config, tokenizer = load_state_dict(path)
    dtype = dtype or torch.float32
    overrides = list(overrides or [])
    flash_usable = flash_available() and torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16)
    if config.model.attention.backend == "flash" and not flash_usable and not any(
            key.startswith("model.attention.backend=") for key in overrides):
        # The kernel is a run-time choice, not part of the weights: a model trained with flash-attn
        # must still load on a CPU, or in fp32, where sdpa computes the same attention.
        notice(f"{path}: saved with model.attention.backend=flash, which needs flash-attn, CUDA and bf16/fp16 "
               f"(here: {torch.device(device).type}, {dtype}); using sdpa", stacklevel=2)
        overrides.append("model.attention.backend=sdpa")
    if overrides:
        config = config_lib.with_overrides(config, overrides)
    with torch.device(device):
        model = GPT(config.model)
    load_weights(model, state, str(path))
    model = model.to(dtype).eval()
    return LoadedModel(model, config, tokenizer, checkpoint_dirs.resolve_checkpoint(path))


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file``, with the umask's permissions (it creates the file 0600)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    apply_umask(path)


def save_consolidated(state: dict[str, torch.Tensor], config: Config, out_dir: str | os.PathLike[str],
                      tokenizer_path: str | os.PathLike[str] | None = None) -> Path:
    """Write config.yml + model.safetensors (+ the tokenizer under its checkpoint name, tokenizer.model or
    tokenizer.json with its tokenizer_config.json): what ``load_model`` reads back."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors({name: tensor.detach().contiguous().cpu() for name, tensor in state.items()},
                     out / checkpoint_dirs.WEIGHTS_FILE)
    save_consolidated_metadata(config, out, tokenizer_path)
    return out


def save_consolidated_metadata(config: Config, out: Path, tokenizer_path: str | os.PathLike[str] | None = None) -> None:
    """The consolidated dir's config.yml and tokenizer; the weights are written beside them (here, or shard by
    shard by convert/sharded.py)."""
    config_lib.save(config, out / checkpoint_dirs.CONFIG_FILE)
    if tokenizer_path is not None:
        checkpoint_dirs.copy_tokenizer(tokenizer_path, out)
