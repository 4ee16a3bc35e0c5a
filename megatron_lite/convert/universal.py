"""DeepSpeed's universal checkpoint of a step dir: the form in which ZeRO 1-3 state loads on any number of ranks.

A ZeRO checkpoint holds each rank's flat partition of the fp32 weights and Adam moments, so it loads only
on the world size that wrote it. ``deepspeed.checkpoint.ds_to_universal`` rewrites it per parameter
(``zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt`` + ``zero/optimizer_state.pt`` + the model-states
files), which ``checkpoint.load_universal`` repartitions for the current ranks.

``convert_to_universal`` runs that conversion atomically: in a hidden staging folder beside the output
(``.<name>.partial-<pid>``, skipped by verification; one that a killed conversion left in a step dir is removed
by the next resume from that step or conversion of it: ``remove_interrupted_conversions``), reading a
folder of links to the step dir's DeepSpeed files only (ds_to_universal walks its input recursively, so
an existing conversion or a staging folder inside the step dir must not be seen), hashed into the
output's own ``MANIFEST.json``, then renamed into place. A step dir's conversion lives in
``<step dir>/universal`` and goes when ``keep_last_checkpoints`` deletes its step, or when a save of the
same step replaces the step dir. It records the save it derives from (``derived_from.json``, listed in its
manifest: the sha256 of the step dir's ``MANIFEST.json``); ``universal_state`` tells a current conversion
from a stale one (another save of the step, a crash, damage), which ``rebuild`` deletes.

ds_to_universal loads the step dir's files with ``torch.load(weights_only=False)``: callers verify the
step dir first (``checkpoint_integrity.verify_checkpoint``), and DeepSpeed's own reads of the output
are preceded by the same check of the output's manifest and pickles.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import io
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megatron_lite import checkpoint_dirs
from megatron_lite.checkpoint_integrity import MANIFEST_FILE, is_staging_dir, record_tree, write_manifest
from megatron_lite.console import notice
from megatron_lite.files import file_sha256

_DEEPSPEED_FILES = ("*_model_states.pt", "*_optim_states.pt")
DERIVED_FROM_FILE = "derived_from.json"  # in universal/: {"source_manifest_sha256": ...} of the step dir it was made from


def universal_checkpoint_info() -> dict[str, Any]:
    """What a checkpoint must carry for ds_to_universal (it asserts otherwise): the format version. Saved in
    every checkpoint's client state, as Megatron-DeepSpeed does; tensor- or pipeline-parallel layouts would
    add their parameter patterns here (megatron_lite has neither)."""
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_VERSION_KEY, UNIVERSAL_CHECKPOINT_VERSION_VALUE

    return {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}


def universal_dir(step_dir: Path) -> Path:
    return step_dir / checkpoint_dirs.UNIVERSAL_DIR


@contextlib.contextmanager
def conversion_lock(step_dir: Path) -> Iterator[None]:
    """An exclusive flock on the step dir itself (no file added to the checkpoint): two processes resuming
    from the same step dir at once convert it one after the other, the second finding the first's result.
    Every conversion writing into the step dir holds it while its staging folder exists."""
    handle = os.open(step_dir, os.O_RDONLY)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)  # releases the lock


def _tree_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file() and not path.is_symlink())


def remove_interrupted_conversions(step_dir: Path) -> list[Path]:
    """Delete the staging folders (``.<name>.partial-<pid>``) that conversions killed before their rename left
    in ``step_dir`` (about the size of the step's DeepSpeed files each), with a notice naming each; the ones
    removed. Nothing is touched while a conversion of the step dir runs: each holds ``conversion_lock`` as
    long as its staging folder exists, so taking that lock without waiting proves every such folder dead (a pid
    would not: it says nothing on another host sharing the file system, and pids are reused)."""
    try:
        staged = sorted(path for path in step_dir.iterdir() if is_staging_dir(path.name) and path.is_dir())
    except OSError:  # no step dir (yet), or one this process may not list
        return []
    if not staged:
        return []
    handle = os.open(step_dir, os.O_RDONLY)
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a conversion runs now: its folder is live, and it removes its own
            return []
        removed = []
        for path in staged:
            size = _tree_bytes(path)
            shutil.rmtree(path, ignore_errors=True)
            if not path.exists():
                removed.append(path)
                notice(f"{path}: removed ({_mb(size)}), the staging folder of a universal conversion that did "
                       "not finish")
        return removed
    finally:
        os.close(handle)  # releases the lock


def _source_view(step_dir: Path, view: Path) -> None:
    """Links to the step dir's DeepSpeed files, and nothing else, in ``view``."""
    view.mkdir(parents=True)
    found = sorted({path for pattern in _DEEPSPEED_FILES for path in step_dir.glob(pattern)})
    if not found:
        raise ValueError(f"{step_dir}: no DeepSpeed files (*_model_states.pt) to convert to a universal checkpoint")
    for path in found:
        (view / path.name).symlink_to(path.resolve())


SPACE_FACTOR = 1.5  # the conversion's peak staging over its DeepSpeed input: measured 1.43 (46 MB -> 66 MB)


def space_needed(step_dir: Path) -> int:
    """Bytes of free space the conversion of ``step_dir`` needs at its peak (estimate: ``SPACE_FACTOR`` x the
    DeepSpeed files it reads)."""
    source = sum(path.stat().st_size for pattern in _DEEPSPEED_FILES for path in step_dir.glob(pattern))
    return int(SPACE_FACTOR * source)


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


def is_disk_full(error: BaseException | None) -> bool:
    """ENOSPC anywhere in the exception chain, or torch's zip writer's way of saying it ("unexpected pos")."""
    seen = 0
    while error is not None and seen < 10:
        if getattr(error, "errno", None) == errno.ENOSPC or "unexpected pos" in str(error) \
                or "No space left on device" in str(error):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def _has_optimizer_partitions(step_dir: Path) -> bool:
    return any(step_dir.glob("*_optim_states.pt"))


def convert_to_universal(step_dir: Path, output: Path) -> Path:
    """``output`` (absent or empty before) becomes the universal checkpoint of the verified ZeRO step dir
    ``step_dir``, with its own manifest; ValueError (one line) when the conversion fails. The caller holds
    ``conversion_lock(step_dir)``."""
    from deepspeed.checkpoint import ds_to_universal

    if not _has_optimizer_partitions(step_dir):
        raise ValueError(f"{step_dir}: no ZeRO optimizer partitions (*_optim_states.pt): a ZeRO 0 checkpoint loads "
                         "on any number of ranks without conversion")
    if output.exists() and any(output.iterdir()):
        raise ValueError(f"{output}: exists and is not empty")
    needed, free = space_needed(step_dir), shutil.disk_usage(output.parent).free
    if free < needed:
        raise ValueError(f"{output.parent}: not enough free disk space for the universal conversion: it needs "
                         f"about {_mb(needed)} ({SPACE_FACTOR}x the step dir's DeepSpeed files), {_mb(free)} free; "
                         "free space, or convert ahead of time elsewhere (tools/convert_checkpoint.py STEP_DIR "
                         "OUTPUT --to universal)")
    for stale in output.parent.glob(f".{output.name}.partial-*"):  # a conversion that crashed
        if is_staging_dir(stale.name):
            shutil.rmtree(stale, ignore_errors=True)
    staging = output.parent / f".{output.name}.partial-{os.getpid()}"
    staged_output = staging / "universal"  # ds_to_universal also writes ``latest_universal`` beside it
    try:
        _source_view(step_dir, staging / "source")
        args = argparse.Namespace(input_folder=str(staging / "source"), output_folder=str(staged_output),
                                  num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                                  inject_missing_state=True)  # older checkpoints lack universal_checkpoint_info
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                ds_to_universal.main(args)
        except Exception as error:
            if is_disk_full(error):
                raise ValueError(f"{staging}: disk full during the universal conversion ({_mb(needed)} estimated, "
                                 f"{_mb(free)} were free before it); free space and resume again") from error
            raise ValueError(f"{step_dir}: DeepSpeed's ds_to_universal failed ({type(error).__name__}: "
                             f"{str(error).strip().splitlines()[0] if str(error).strip() else ''})") from error
        source = source_manifest_sha256(step_dir)
        (staged_output / DERIVED_FROM_FILE).write_text(json.dumps({"source_manifest_sha256": source}) + "\n")
        write_manifest(staged_output, record_tree(staged_output))
        if output.exists():
            output.rmdir()  # empty (checked above)
        os.rename(staged_output, output)  # the commit point: fails if another process's output is there now
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return output


def has_universal(step_dir: Path) -> bool:
    """Whether the step dir holds a committed conversion (its integrity is ``verify_checkpoint``'s to judge)."""
    return (universal_dir(step_dir) / MANIFEST_FILE).is_file()


def source_manifest_sha256(step_dir: Path) -> str | None:
    """The sha256 of the step dir's ``MANIFEST.json`` (which names every file of one save), None without one."""
    manifest = step_dir / MANIFEST_FILE
    return file_sha256(manifest) if manifest.is_file() else None


def universal_state(step_dir: Path) -> str:
    """'absent' | 'current' (committed, made from this very save of the step) | why it is stale, one phrase:
    no manifest (a crash or damage), or made from another save of the step (a redone step, an older version
    that recorded no source)."""
    output = universal_dir(step_dir)
    if not output.exists():
        return "absent"
    if not has_universal(step_dir):
        return f"it has no {MANIFEST_FILE}"
    try:
        recorded = json.loads((output / DERIVED_FROM_FILE).read_text())["source_manifest_sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"it records no source ({DERIVED_FROM_FILE})"
    if recorded != source_manifest_sha256(step_dir):
        return f"it was made from another save of this step (its {MANIFEST_FILE} differs)"
    return "current"


def remove_universal(step_dir: Path) -> None:
    """Delete the step dir's conversion (the caller holds ``conversion_lock``): its manifest first, so a removal
    cut short leaves a folder that ``universal_state`` calls stale."""
    output = universal_dir(step_dir)
    (output / MANIFEST_FILE).unlink(missing_ok=True)
    shutil.rmtree(output, ignore_errors=True)
    if output.exists():
        shutil.rmtree(output)  # raises the reason (OSError)


def convert_step_to_universal(input_path: str | os.PathLike[str], output: Path, force: bool = False) -> Path:
    """``tools/convert_checkpoint.py INPUT OUTPUT --to universal``: the universal checkpoint of a step dir (a run
    dir: its latest complete one) in ``output``; verified first, as a resume does. ``output`` may be the step
    dir's own ``universal/``, which a later resume on another number of ranks then reuses. The step dir."""
    from megatron_lite.checkpoint_integrity import verify_or_raise

    step_dir = checkpoint_dirs.resolve_checkpoint(input_path)
    if checkpoint_dirs.checkpoint_kind(step_dir) != "step":
        raise ValueError(f"--to universal: {input_path} is not a DeepSpeed run or step dir")
    output = output.resolve()
    if output.exists() and not output.is_dir():
        raise ValueError(f"OUTPUT {output} exists and is not a directory")
    if output.exists() and any(output.iterdir()) and not force:
        raise ValueError(f"OUTPUT {output} is not empty; pass --force to replace its contents")
    if output != universal_dir(step_dir.resolve()) and step_dir.resolve().is_relative_to(output):
        raise ValueError(f"OUTPUT {output} contains INPUT {step_dir}; choose another OUTPUT")
    verify_or_raise(step_dir)  # ds_to_universal unpickles the step dir's files without an allow-list
    remove_interrupted_conversions(step_dir)
    with conversion_lock(step_dir):
        if output.exists():
            shutil.rmtree(output)
        convert_to_universal(step_dir, output)
    return step_dir
