"""What a checkpoint file may contain, and whether a step directory is intact.

**Safe unpickling.** A ``.pt`` file is a pickle, and a pickle can run any code when loaded:
DeepSpeed's own loader and ``zero_to_fp32`` use ``weights_only=False``, so a crafted file in a
shared run directory or a downloaded checkpoint would own the machine. Every ``.pt`` that a resume,
``load_model`` or the converter reads is therefore first loaded with ``torch.load(weights_only=True)``
and an allow-list of exactly the DeepSpeed classes its optimizer states pickle
(``ALLOWED_GLOBALS``); anything else is refused with one line naming the file and the global.
A training run's DeepSpeed engine also loads through ``safe_load`` itself
(``megatron_lite.training.checkpoint_engine``).

**Manifest.** ``<step dir>/MANIFEST.json`` lists every file of the checkpoint, by its path relative
to the step dir, with its size, sha256 and the rank that wrote it (each rank hashes its files while
writing them; rank 0 gathers the lists and writes the manifest before ``COMPLETE``)::

    {"version": 2, "files": {"mp_rank_00_model_states.pt": {"bytes": 1234, "sha256": "...", "rank": 0}, ...}}

A subfolder added after the save (``universal/``, DeepSpeed's universal checkpoint made when a run
continues on another number of ranks) carries its own ``MANIFEST.json``, written before the folder is
renamed into place, and is checked against it. Version 1 manifests (top-level names only) still read.
Such a derived folder (``DERIVED_DIRS``) is left out when a resume asks whether the step is usable
(``derived=False``): only the step dir's own files decide that; the folder is checked when it is read,
and rebuilt when damaged (megatron_lite/training/checkpointing.py).

``verify_checkpoint`` checks a rank's share of every file under the step dir, recursively (sizes
first, then hashes, then the pickles), and rank 0 refuses any file that no manifest lists, so a
truncated, bit-flipped or planted file is found before DeepSpeed reads anything. Hidden staging
folders of an interrupted conversion (``.<name>.partial-<pid>``) are never read and are skipped (the next
resume from the step removes them: ``convert.universal.remove_interrupted_conversions``).
Checkpoints written before manifests existed have none: their pickles are still checked, their bytes
cannot be.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import pickle
import re
import warnings
import zipfile
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, BinaryIO

from megatron_lite.files import write_json_atomic

MANIFEST_FILE = "MANIFEST.json"
MANIFEST_VERSION = 2  # 2: paths relative to the manifest's folder, subfolders included; 1: top-level names
READABLE_MANIFEST_VERSIONS = (1, 2)
UNLISTED_ALLOWED = (MANIFEST_FILE, "COMPLETE")  # written after the manifest (checkpoint_dirs.COMPLETE_MARKER)
DERIVED_DIRS = ("universal",)  # made from a step dir after its save (checkpoint_dirs.UNIVERSAL_DIR), rebuilt when stale
_STAGING_DIR = re.compile(r"^\..+\.partial-\d+$")  # an atomic write's hidden staging folder

# What DeepSpeed 0.19's checkpoints pickle besides tensors and plain containers (found with
# torch.serialization.get_unsafe_globals_in_checkpoint on ZeRO 0-3 x fp32/bf16 checkpoints; fp16
# adds the dynamic loss scaler). Nothing here runs code when rebuilt: plain classes, a dataclass, an enum.
ALLOWED_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
)
_GLOBAL_IN_ERROR = re.compile(r"GLOBAL ([\w.]+)")


class UnsafeCheckpointError(ValueError):
    """A checkpoint file whose pickle names something outside the allow-list (or is not a pickle at all)."""


class CheckpointIntegrityError(ValueError):
    """A checkpoint whose files differ from its manifest."""


@cache
def _allowed_globals() -> tuple[Any, ...]:
    objects = []
    for name in ALLOWED_GLOBALS:
        module, attribute = name.rsplit(".", 1)
        try:
            objects.append(getattr(importlib.import_module(module), attribute))
        except (ImportError, AttributeError):  # another DeepSpeed version: its files cannot hold it either
            continue
    return tuple(objects)


def offending_global(path: Path, error: Exception) -> str:
    """The refused global as torch's message names it (its wording varies by case and version)."""
    message = str(error)
    match = _GLOBAL_IN_ERROR.search(message)
    if match:
        return match.group(1)
    if zipfile.is_zipfile(path):
        import torch

        found = [name for name in torch.serialization.get_unsafe_globals_in_checkpoint(path)
                 if name not in ALLOWED_GLOBALS]
        if found:
            return ", ".join(found)
    detail = next((line.strip() for line in message.splitlines() if line.strip().startswith("Unsupported")), "")
    return f"an unsupported pickle instruction ({detail or type(error).__name__})"


def safe_load(path: str | os.PathLike[str], map_location: Any = "cpu", mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` with ``ALLOWED_GLOBALS``; UnsafeCheckpointError naming the
    file and the refused global, CheckpointIntegrityError for a file torch cannot read (truncated, not
    a checkpoint). ``mmap`` maps tensors instead of reading them (new zip format only)."""
    import torch

    path = Path(path)
    use_mmap = mmap and zipfile.is_zipfile(path)
    try:
        with torch.serialization.safe_globals(list(_allowed_globals())), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "Detected pickle protocol 4": the refusal says what matters
            return torch.load(path, map_location=map_location, weights_only=True, mmap=use_mmap)
    except pickle.UnpicklingError as error:
        raise UnsafeCheckpointError(
            f"{path}: refused to unpickle {offending_global(path, error)} (not a type megatron_lite checkpoints "
            "contain; the file may be malicious or from another program): not loaded") from None
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as error:
        first = str(error).strip().splitlines()
        raise CheckpointIntegrityError(f"{path}: unreadable ({type(error).__name__}: "
                                       f"{first[0] if first else ''})") from None


# ----------------------------------------------------------------------------------------------
# Hashing while writing


@dataclass
class FileRecord:
    name: str  # path relative to the manifest's folder (posix separators)
    bytes: int
    sha256: str
    rank: int


class HashingWriter:
    """A write-only binary stream that hashes and counts what passes through it to ``handle``."""

    def __init__(self, handle: BinaryIO) -> None:
        self._handle = handle
        self._digest = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self._digest.update(data)
        self.size += len(data)
        return self._handle.write(data)

    def flush(self) -> None:
        self._handle.flush()

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


def is_staging_dir(name: str) -> bool:
    """A hidden ``.<name>.partial-<pid>`` folder: an atomic write in progress, or left by a crash; never read."""
    return _STAGING_DIR.match(name) is not None


def save_hashed(obj: Any, path: Path, rank: int, zipfile_serialization: bool = True,
                fsync: bool = False) -> FileRecord:
    """``torch.save(obj, path)``, hashing the bytes as they are written (no second read); ``fsync``: on disk
    before returning (a background write, whose file the step loop no longer waits for)."""
    import torch

    with open(path, "wb") as handle:
        writer = HashingWriter(handle)
        torch.save(obj, writer, _use_new_zipfile_serialization=zipfile_serialization)  # type: ignore[arg-type]
        if fsync:
            handle.flush()
            os.fsync(handle.fileno())
    return FileRecord(path.name, writer.size, writer.hexdigest(), rank)


def record_file(path: Path, rank: int, root: Path | None = None) -> FileRecord:
    """A file written by other means (config, tokenizer, a conversion): hashed after the write; named
    relative to ``root`` (default: its own folder)."""
    with open(path, "rb") as handle:
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
    name = path.relative_to(root).as_posix() if root is not None else path.name
    return FileRecord(name, path.stat().st_size, digest, rank)


def record_tree(root: Path, rank: int = 0) -> list[FileRecord]:
    """Every file under ``root`` (a conversion's output, written by one process), hashed."""
    return [record_file(path, rank, root) for path in sorted(root.rglob("*")) if path.is_file()]


# ----------------------------------------------------------------------------------------------
# Manifest


def write_manifest(step_dir: Path, records: list[FileRecord]) -> None:
    files = {record.name: {"bytes": record.bytes, "sha256": record.sha256, "rank": record.rank}
             for record in sorted(records, key=lambda r: r.name)}
    write_json_atomic(step_dir / MANIFEST_FILE, {"version": MANIFEST_VERSION, "files": files}, indent=1)


def read_manifest(step_dir: Path) -> dict[str, FileRecord] | None:
    """relative path -> record; None when the checkpoint has no manifest (written by an older version)."""
    path = step_dir / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("version") not in READABLE_MANIFEST_VERSIONS:
            raise ValueError(f"version {data.get('version')!r}, expected one of {READABLE_MANIFEST_VERSIONS}")
        records = {name: FileRecord(name, int(entry["bytes"]), str(entry["sha256"]), int(entry["rank"]))
                   for name, entry in data["files"].items()}
        escaping = [name for name in records if name.startswith("/") or ".." in Path(name).parts]
        if escaping:
            raise ValueError(f"path {escaping[0]!r} leaves the checkpoint")
        return records
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointIntegrityError(f"{path}: unreadable manifest ({error})") from None


@dataclass
class Verification:
    problems: list[str] = field(default_factory=list)  # one line each, naming the file
    has_manifest: bool = True
    files_checked: int = 0

    unsafe: bool = False  # a problem is a refused pickle (UnsafeCheckpointError), not damage
    unlisted: bool = False  # a problem is a file no manifest lists (added after the save)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        """The first problem, and how many more there are."""
        more = len(self.problems) - 1
        return self.problems[0] + (f" (and {more} more problem(s))" if more > 0 else "")


def _check_file(step_dir: Path, record: FileRecord) -> str | None:
    path = step_dir / record.name
    if not path.is_file():
        return f"{path}: missing (listed in {MANIFEST_FILE})"
    size = path.stat().st_size
    if size != record.bytes:
        return f"{path}: {size} bytes, the manifest says {record.bytes} (truncated or changed)"
    with open(path, "rb") as handle:
        if hashlib.file_digest(handle, "sha256").hexdigest() != record.sha256:
            return f"{path}: sha256 differs from {MANIFEST_FILE} (corrupted or changed since it was saved)"
    return None


def _walk(step_dir: Path, skip: tuple[str, ...] = ()) -> tuple[list[Path], dict[Path, list[Path]]]:
    """(folders holding a manifest: ``step_dir`` first, then subfolders that carry their own; each one's
    files, relative to it, excluding those of a nested manifest folder). Staging folders are skipped, and so
    are the top-level folders named in ``skip``."""
    parts: list[Path] = [step_dir]
    files: dict[Path, list[Path]] = {step_dir: []}
    owners: dict[Path, Path] = {step_dir: step_dir}
    for folder, subfolders, names in os.walk(step_dir):
        here = Path(folder)
        subfolders[:] = sorted(name for name in subfolders if not is_staging_dir(name)
                               and not (here == step_dir and name in skip))
        if here != step_dir and MANIFEST_FILE in names:
            parts.append(here)
            files[here] = []
            owners[here] = here
        owner = owners[here]
        for name in subfolders:
            owners[here / name] = owner
        files[owner] += [(here / name).relative_to(owner) for name in sorted(names)]
    return parts, files


def verify_checkpoint(step_dir: Path, rank: int = 0, world_size: int = 1, round_robin: bool = False,
                      derived: bool = True) -> Verification:
    """This rank's share of the checks of every file under ``step_dir`` (all of them for one process): files
    that rank r wrote are checked by rank r % world_size, those of a nested manifest (a conversion) round robin;
    rank 0 also refuses files that no manifest lists. Every ``.pt`` in the share is safe-loaded (memory-mapped,
    so tensors are not read); a checkpoint without a manifest gets only that. ``round_robin``: share the
    top folder's files round robin too (a conversion's output, all written by one process). ``derived=False``:
    leave out the folders derived from the step dir after its save (``DERIVED_DIRS``: ``universal/``), so that
    only the step dir's own files decide whether the step is usable; a derived folder is verified on its own
    when it is to be read, and rebuilt when damaged."""
    result = Verification()
    parts, files = _walk(step_dir, () if derived else DERIVED_DIRS)
    mine: list[Path] = []
    for part in parts:
        try:
            manifest = read_manifest(part)
        except CheckpointIntegrityError as error:
            result.problems.append(str(error))
            continue
        pickles = [name for name in files[part] if name.suffix == ".pt"]
        if manifest is None:  # only the step dir itself can lack one: a subfolder counts as a part by its manifest
            result.has_manifest = False
            mine += [part / name for index, name in enumerate(pickles) if index % world_size == rank]
            continue
        records = sorted(manifest.values(), key=lambda record: record.name)
        share = [record for index, record in enumerate(records)
                 if (record.rank if part == step_dir and not round_robin else index) % world_size == rank]
        failed = set()
        for record in share:
            problem = _check_file(part, record)
            result.files_checked += 1
            if problem:
                result.problems.append(problem)
                failed.add(record.name)
        if rank == 0:
            unlisted = [f"{part / name}: not listed in {part / MANIFEST_FILE} (added after the save?)"
                        for name in files[part] if name.as_posix() not in manifest
                        and name.as_posix() not in UNLISTED_ALLOWED]
            result.problems += unlisted
            result.unlisted = result.unlisted or bool(unlisted)
        mine += [part / record.name for record in share if record.name.endswith(".pt") and record.name not in failed]
    for path in mine:
        try:
            safe_load(path, mmap=True)
        except (UnsafeCheckpointError, CheckpointIntegrityError) as error:
            result.problems.append(str(error))
            result.unsafe = result.unsafe or isinstance(error, UnsafeCheckpointError)
    return result


def verify_or_raise(step_dir: Path) -> Verification:
    """Every check of ``step_dir`` in this process; CheckpointIntegrityError (or UnsafeCheckpointError)
    with the first problem, and how many more there are."""
    result = verify_checkpoint(step_dir)
    if result.problems:
        raise (UnsafeCheckpointError if result.unsafe else CheckpointIntegrityError)(result.summary())
    return result

