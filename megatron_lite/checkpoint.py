"""Where a run keeps its checkpoints, and loading a model from any of them.

Layout written by the training loop (``megatron_lite.training``)::

    <run-dir>/
      config.yml                         the resolved config of the run
      checkpoints/
        latest                           tag of the newest COMPLETE checkpoint (written last)
        step_00000100/                   one DeepSpeed ``save_checkpoint`` tag directory:
          mp_rank_00_model_states.pt       DeepSpeed files (model / ZeRO optimizer partitions)
          *_optim_states.pt
          config.yml                       the config that produced it
          tokenizer.model                  the SentencePiece model the data was tokenised with
          COMPLETE                         marker: every rank finished writing (JSON summary)

A *consolidated* directory holds ``config.yml`` + ``model.safetensors`` (+ ``tokenizer.model``),
fp32 weights named as ``GPT.state_dict()``; ``save_consolidated`` writes one.

``load_model(path)`` accepts a run dir, a step dir or a consolidated dir.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_lite import config as config_lib
from megatron_lite.config import Config, ModelConfig

CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
COMPLETE_MARKER = "COMPLETE"
CONFIG_FILE = "config.yml"
TOKENIZER_FILE = "tokenizer.model"
WEIGHTS_FILE = "model.safetensors"
_STEP_TAG = re.compile(r"^step_(\d+)$")


def step_tag(step: int) -> str:
    return f"step_{step:08d}"


def tag_step(tag: str) -> int | None:
    match = _STEP_TAG.match(tag)
    return int(match.group(1)) if match else None


def is_complete(step_dir: Path) -> bool:
    return (step_dir / COMPLETE_MARKER).is_file()


def complete_checkpoints(checkpoints_dir: Path) -> list[Path]:
    """Complete step directories, oldest first."""
    if not checkpoints_dir.is_dir():
        return []
    found = [(tag_step(p.name), p) for p in checkpoints_dir.iterdir() if p.is_dir() and tag_step(p.name) is not None]
    return [p for _, p in sorted(found) if is_complete(p)]


def latest_complete(checkpoints_dir: Path) -> Path | None:
    """The step dir named by ``latest`` if complete; otherwise the newest complete one (or None)."""
    latest = checkpoints_dir / LATEST_FILE
    if latest.is_file():
        candidate = checkpoints_dir / latest.read_text().strip()
        if candidate.is_dir() and is_complete(candidate):
            return candidate
    complete = complete_checkpoints(checkpoints_dir)
    return complete[-1] if complete else None


def write_text_atomic(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp{os.getpid()}")
    temporary.write_text(text)
    os.replace(temporary, path)


def checkpoint_kind(path: Path) -> str:
    """'run' | 'step' | 'consolidated' | 'hf'; ValueError naming the path otherwise."""
    if (path / CHECKPOINTS_DIR).is_dir():
        return "run"
    if (path / WEIGHTS_FILE).is_file() and (path / CONFIG_FILE).is_file():
        return "consolidated"
    if list(path.glob("*model_states.pt")):
        return "step"
    if (path / "config.json").is_file():
        return "hf"
    raise ValueError(f"{path}: not a run dir ({CHECKPOINTS_DIR}/), a step dir (*model_states.pt), "
                     f"a consolidated dir ({CONFIG_FILE} + {WEIGHTS_FILE}) or a Hugging Face dir (config.json)")


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """A run dir becomes its latest complete step dir; step and consolidated dirs are returned as is."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"checkpoint {path} does not exist or is not a directory")
    if checkpoint_kind(path) == "run":
        found = latest_complete(path / CHECKPOINTS_DIR)
        if found is None:
            raise ValueError(f"run {path} has no complete checkpoint in {path / CHECKPOINTS_DIR}")
        return found
    return path


def _step_dir_config(step_dir: Path) -> Path:
    for candidate in (step_dir / CONFIG_FILE, step_dir.parent.parent / CONFIG_FILE):
        if candidate.is_file():
            return candidate
    raise ValueError(f"{step_dir}: no {CONFIG_FILE} beside the checkpoint or in its run dir")


def _zero_stage(step_dir: Path) -> int:
    """The stage from the ds_config DeepSpeed stores in every model-states file (tensors and plain
    values only, so weights_only=True loads it; the optimizer files pickle DeepSpeed classes)."""
    files = sorted(step_dir.glob("*model_states.pt"))
    if not files:
        raise ValueError(f"{step_dir}: no *model_states.pt")
    state = torch.load(files[0], map_location="cpu", weights_only=True, mmap=True)
    return int((state.get("ds_config") or {}).get("zero_optimization", {}).get("stage", 0))


def load_step_state_dict(step_dir: Path) -> dict[str, torch.Tensor]:
    """fp32 weights of one DeepSpeed tag dir, any ZeRO stage and world size (DeepSpeed's own utilities)."""
    if _zero_stage(step_dir) > 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(step_dir.parent), tag=step_dir.name)
    else:
        files = sorted(step_dir.glob("mp_rank_*_model_states.pt"))
        if not files:
            raise ValueError(f"{step_dir}: no mp_rank_*_model_states.pt")
        # zero_to_fp32 (above) unpickles with weights_only=False inside DeepSpeed; here we need not.
        state = torch.load(files[0], map_location="cpu", weights_only=True)["module"]
    return {name: tensor.float() if tensor.is_floating_point() else tensor for name, tensor in state.items()}


def load_state_dict(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], Config, Path | None]:
    """(fp32 state dict, config, tokenizer path or None) of a run, step or consolidated dir."""
    resolved = resolve_checkpoint(path)
    kind = checkpoint_kind(resolved)
    if kind == "consolidated":
        from safetensors.torch import load_file

        state = load_file(str(resolved / WEIGHTS_FILE))
        config = config_lib.load(resolved / CONFIG_FILE)
    elif kind == "step":
        state = load_step_state_dict(resolved)
        config = config_lib.load(_step_dir_config(resolved))
    else:
        raise ValueError(f"{resolved}: a Hugging Face dir; convert it first with tools/convert_checkpoint.py --to megatron_lite")
    tokenizer = resolved / TOKENIZER_FILE
    return state, config, tokenizer if tokenizer.is_file() else None


def expected_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in ``GPT(model).state_dict()`` (built on the meta device, no memory)."""
    from megatron_lite.model import GPT

    with torch.device("meta"):
        instance = GPT(model)
    return {name: tuple(tensor.shape) for name, tensor in instance.state_dict().items()}


def check_tensors(state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], source: str) -> None:
    """One ValueError listing every missing, unexpected and mis-shaped tensor (nothing when all match)."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    misshaped = sorted(
        f"{name} {tuple(state[name].shape)} (expected {expected[name]})"
        for name in set(state) & set(expected)
        if tuple(state[name].shape) != expected[name]
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
        warnings.warn(f"{path}: saved with model.attention.backend=flash, which needs flash-attn, CUDA and bf16/fp16 "
                      f"(here: {torch.device(device).type}, {dtype}); using sdpa", stacklevel=2)
        overrides.append("model.attention.backend=sdpa")
    if overrides:
        config = config_lib.with_overrides(config, overrides)
    with torch.device(device):
        model = GPT(config.model)
    load_weights(model, state, str(path))
    model = model.to(dtype).eval()
    return LoadedModel(model, config, tokenizer, resolve_checkpoint(path))


def save_consolidated(state: dict[str, torch.Tensor], config: Config, out_dir: str | os.PathLike[str],
                      tokenizer_path: str | os.PathLike[str] | None = None) -> Path:
    """Write config.yml + model.safetensors (+ tokenizer.model): what ``load_model`` reads back."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.detach().contiguous().cpu() for name, tensor in state.items()}, str(out / WEIGHTS_FILE))
    config_lib.save(config, out / CONFIG_FILE)
    if tokenizer_path is not None:
        shutil.copyfile(tokenizer_path, out / TOKENIZER_FILE)
    return out


def read_complete_marker(step_dir: Path) -> dict[str, Any]:
    return json.loads((step_dir / COMPLETE_MARKER).read_text())
