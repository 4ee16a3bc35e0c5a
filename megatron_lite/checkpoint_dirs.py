"""Where a run keeps its checkpoints: the run, step and consolidated directories and their files.

Layout written by the training loop (``megatron_lite.training``)::

    <run-dir>/
      config.yml                         the resolved config of the run
      checkpoints/
        latest                           tag of the newest COMPLETE checkpoint (written last)
        step_00000100/                   one DeepSpeed ``save_checkpoint`` tag directory:
          mp_rank_00_model_states.pt       DeepSpeed files (model / ZeRO optimizer partitions)
          *_optim_states.pt
          config.yml                       the config that produced it
          tokenizer.model | tokenizer.json   the run's tokenizer (SentencePiece | Hugging Face, the latter
                                           with its tokenizer_config.json when it had one)
          rng_state_rank00000.pt           each rank's RNG state
          MANIFEST.json                    every file's size, sha256 and writing rank (checkpoint_integrity)
          COMPLETE                         marker: every rank finished writing (JSON summary)
          universal/                       added by a resume on another number of ranks (ZeRO 1-3): DeepSpeed's
                                           universal checkpoint of this step, with its own MANIFEST.json and
                                           derived_from.json (the sha256 of the step's MANIFEST.json); rebuilt
                                           when stale or damaged (megatron_lite/convert/universal.py)

A save of a step that already has a step dir deletes it first (COMPLETE first), so a step dir always holds
one save's files (megatron_lite/training/checkpointing.py).

A *consolidated* directory holds ``config.yml`` + ``model.safetensors`` (+ the tokenizer, as above);
``megatron_lite.weights`` reads and writes one. ``find_tokenizer`` / ``copy_tokenizer`` are the one
place that knows the tokenizer's file names.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
COMPLETE_MARKER = "COMPLETE"
UNIVERSAL_DIR = "universal"
CONFIG_FILE = "config.yml"
TOKENIZER_FILE = "tokenizer.model"  # SentencePiece
HF_TOKENIZER_FILE = "tokenizer.json"  # Hugging Face tokenizers
HF_TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # beside tokenizer.json: its eos/bos/pad token names
# What a directory may carry, in lookup order: an HF model dir with both files (Llama-2, Mistral) means
# its tokenizer.json, the tokenizer transformers itself loads.
TOKENIZER_FILES = (HF_TOKENIZER_FILE, TOKENIZER_FILE)
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"  # sharded weights (HF's index format)
_STEP_TAG = re.compile(r"^step_(\d+)$")


def step_tag(step: int) -> str:
    return f"step_{step:08d}"


def tag_step(tag: str) -> int | None:
    match = _STEP_TAG.match(tag)
    return int(match.group(1)) if match else None


def is_complete(step_dir: Path) -> bool:
    return (step_dir / COMPLETE_MARKER).is_file()


def read_complete_marker(step_dir: Path) -> dict[str, Any]:
    return json.loads((step_dir / COMPLETE_MARKER).read_text())


def checkpoint_step(step_dir: Path) -> int | None:
    """The optimizer step a step dir holds (its COMPLETE marker, else its tag); None for other dirs."""
    if is_complete(step_dir):
        return int(read_complete_marker(step_dir)["step"])
    return tag_step(step_dir.name)


def step_dirs(checkpoints_dir: Path) -> list[Path]:
    """Every step directory (complete or not), oldest first."""
    if not checkpoints_dir.is_dir():
        return []
    found = [(tag_step(p.name), p) for p in checkpoints_dir.iterdir() if p.is_dir() and tag_step(p.name) is not None]
    return [p for _, p in sorted(found)]


def complete_checkpoints(checkpoints_dir: Path) -> list[Path]:
    """Complete step directories, oldest first."""
    return [p for p in step_dirs(checkpoints_dir) if is_complete(p)]


def latest_complete(checkpoints_dir: Path) -> Path | None:
    """The step dir named by ``latest`` if complete; otherwise the newest complete one (or None)."""
    latest = checkpoints_dir / LATEST_FILE
    if latest.is_file():
        candidate = checkpoints_dir / latest.read_text().strip()
        if candidate.is_dir() and is_complete(candidate):
            return candidate
    complete = complete_checkpoints(checkpoints_dir)
    return complete[-1] if complete else None


def dir_size(path: Path) -> int:
    """Bytes of the files under ``path`` (files that vanish meanwhile count 0)."""
    total = 0
    for child in path.rglob("*"):
        try:
            total += child.stat().st_size if child.is_file() else 0
        except FileNotFoundError:
            pass
    return total


def incomplete_step_dirs(checkpoints_dir: Path) -> list[Path]:
    """Step dirs without a COMPLETE marker: a save killed midway (SIGKILL after a scheduler's grace period, a
    launcher's shutdown timeout), or one still being written by a live run."""
    return [p for p in step_dirs(checkpoints_dir) if not is_complete(p)]


def remove_abandoned_saves(checkpoints_dir: Path) -> list[Path]:
    """Remove the incomplete step dirs in ``checkpoints_dir``, with one notice naming them and their size; the
    caller makes sure no live writer is at them (a run holding its run dir's lock, or
    ``run_lock.live_run_holds`` false).
    Left in place, each would cost its size on disk forever (GBs at 350M): no resume or conversion reads one."""
    from megatron_lite.console import notice

    removed = []
    for step_dir in incomplete_step_dirs(checkpoints_dir):
        size = dir_size(step_dir)
        shutil.rmtree(step_dir, ignore_errors=True)
        removed.append((step_dir, size))
    if removed:
        names = ", ".join(f"{step_dir.name} ({size / 1e6:.1f} MB)" for step_dir, size in removed)
        notice(f"removed {len(removed)} incomplete checkpoint dir(s) in {checkpoints_dir}, a save that never "
               f"finished (no {COMPLETE_MARKER} marker): {names}")
    return [step_dir for step_dir, _ in removed]


def checkpoint_kind(path: Path) -> str:
    """'run' | 'step' | 'consolidated' | 'hf'; ValueError naming the path otherwise."""
    if (path / CHECKPOINTS_DIR).is_dir():
        return "run"
    if ((path / WEIGHTS_FILE).is_file() or (path / WEIGHTS_INDEX_FILE).is_file()) and (path / CONFIG_FILE).is_file():
        return "consolidated"
    if list(path.glob("*model_states.pt")):
        if (path / "zero").is_dir() and not list(path.glob("*_optim_states.pt")):
            made_from = f" ({path.parent})" if path.name == UNIVERSAL_DIR else ""
            raise ValueError(f"{path}: DeepSpeed's universal checkpoint of a step dir, which only a resume on another "
                             f"number of ranks reads; give the step dir it was made from{made_from} instead")
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


def step_config_file(step_dir: Path) -> Path:
    """The config.yml beside a step dir's DeepSpeed files, else the one of its run dir."""
    for candidate in (step_dir / CONFIG_FILE, step_dir.parent.parent / CONFIG_FILE):
        if candidate.is_file():
            return candidate
    raise ValueError(f"{step_dir}: no {CONFIG_FILE} beside the checkpoint or in its run dir")


def tokenizer_file_name(tokenizer: str | os.PathLike[str]) -> str:
    """The name a tokenizer file has inside a checkpoint or cache: tokenizer.json for any ``*.json``
    (Hugging Face), tokenizer.model otherwise (SentencePiece)."""
    return HF_TOKENIZER_FILE if Path(tokenizer).suffix == ".json" else TOKENIZER_FILE


def tokenizer_companions(tokenizer: str | os.PathLike[str]) -> list[Path]:
    """The files a tokenizer consists of: itself, plus the tokenizer_config.json beside a tokenizer.json
    (it names the EOS that becomes EOD, so it travels with it)."""
    path = Path(tokenizer)
    config = path.with_name(HF_TOKENIZER_CONFIG_FILE)
    return [path, config] if path.suffix == ".json" and config.is_file() else [path]


def copy_tokenizer(tokenizer: str | os.PathLike[str], directory: str | os.PathLike[str]) -> list[Path]:
    """Copy a tokenizer (and its companion) into ``directory`` under the checkpoint names; the written paths."""
    directory = Path(directory)
    written = []
    for index, source in enumerate(tokenizer_companions(tokenizer)):
        target = directory / (tokenizer_file_name(source) if index == 0 else HF_TOKENIZER_CONFIG_FILE)
        if source.resolve() != target.resolve():
            shutil.copyfile(source, target)
        written.append(target)
    return written


def find_tokenizer(directory: str | os.PathLike[str]) -> Path | None:
    """The tokenizer a step, consolidated, cache or HF dir carries (tokenizer.json, else tokenizer.model), or None."""
    for name in TOKENIZER_FILES:
        candidate = Path(directory) / name
        if candidate.is_file():
            return candidate
    return None
