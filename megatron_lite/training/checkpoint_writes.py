"""The phases of writing one checkpoint; ``checkpointer.Checkpointer`` runs them at once or around a background write.

1. ``prepare_step_dir``: rank 0 removes an earlier save of the same step; all ranks meet.
2. The files: ``write_files`` writes every rank's DeepSpeed files and RNG state now (hashing them as they are
   written); or ``snapshot_files`` takes host copies of them now and ``write_snapshot`` writes, hashes and
   fsyncs them later, in a background thread.
3. ``commit``: all ranks agree on the outcome (one collective); rank 0 writes the config, tokenizer, manifest of
   every file's size and sha256 (``megatron_lite.checkpoint_integrity``), the COMPLETE marker and only then
   ``latest``, and prunes old checkpoints; a failure on any rank removes the step dir, with one line.

A crash at any point leaves the previous complete checkpoint as the one ``--resume auto`` finds.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_lite import checkpoint_dirs
from megatron_lite import config as config_lib
from megatron_lite.checkpoint_integrity import FileRecord, record_file, save_hashed, write_manifest
from megatron_lite.config import Config, FaultInjectionConfig
from megatron_lite.console import notice
from megatron_lite.convert import universal
from megatron_lite.files import write_text_atomic
from megatron_lite.training import rng
from megatron_lite.training.checkpointing import (UNIVERSAL_CHECKPOINT_INFO, TrainingState, rng_state_file,
                                                  this_history)
from megatron_lite.training.distributed import DistributedInfo, all_gather_objects, all_reduce_sum, barrier

# Test hook: seconds a background write sleeps before each file, so that a test can kill or stop the run
# while one is in progress.
WRITE_DELAY_ENV = "MEGATRON_LITE_TEST_CHECKPOINT_WRITE_DELAY"


@dataclass
class StepFiles:
    """One rank's share of a checkpoint: where it goes, what was written (or is to be), the first failure."""

    step_dir: Path
    started: float
    error: Exception | None = None
    records: list[FileRecord] = field(default_factory=list)
    pending: list[tuple[Any, Path]] = field(default_factory=list)  # host copies not yet written (a snapshot)


def prepare_step_dir(run_dir: Path, step: int, dist_info: DistributedInfo) -> StepFiles:
    """Rank 0 clears the step's dir of an earlier save; no rank writes into it before that is done."""
    files = StepFiles(run_dir / checkpoint_dirs.CHECKPOINTS_DIR / checkpoint_dirs.step_tag(step), time.perf_counter())
    if dist_info.is_main:
        try:
            _clear_step_dir(files.step_dir)
        except Exception as caught:
            files.error = caught
    barrier()
    return files


def write_files(files: StepFiles, engine: Any, state: TrainingState, config: Config,
                dist_info: DistributedInfo) -> None:
    """This rank's files of ``state``'s checkpoint, written now; a failure is kept in ``files.error``.

    ``engine.checkpoint_engine`` must be a VerifiedCheckpointEngine (``checkpoint_engine.install``): it hashes
    DeepSpeed's files as they are written and holds a failed write instead of raising it."""
    faults = config.train.fault_injection
    try:
        if files.error is not None:
            raise files.error
        with disk_full(_disk_limit(faults, state.step, dist_info.rank, after_agreement=False)):
            _inject_failure(faults, state.step)
            _deepspeed_save(engine, files.step_dir, state, capture=False)
            rng_file = rng_state_file(files.step_dir, dist_info.rank)
            files.records = [*engine.checkpoint_engine.written,
                             save_hashed(rng.capture(dist_info.device), rng_file, dist_info.rank)]
            _inject_kill(faults, state.step)
    except Exception as caught:  # torch.save raises RuntimeError on a full disk: any failure counts
        files.error = caught


def snapshot_files(files: StepFiles, engine: Any, state: TrainingState, dist_info: DistributedInfo) -> None:
    """Host copies of this rank's files of ``state``'s checkpoint (``host_snapshot``), into ``files.pending``:
    the only part of an asynchronous save the step loop waits for."""
    if files.error is not None:
        return
    try:
        files.pending = [*_deepspeed_save(engine, files.step_dir, state, capture=True),
                         (rng.capture(dist_info.device), rng_state_file(files.step_dir, dist_info.rank))]
    except Exception as caught:
        files.error = caught


def write_snapshot(files: StepFiles, step: int, faults: FaultInjectionConfig, rank: int, zipfile: bool) -> None:
    """Write, hash and fsync ``files.pending`` (in a background thread); each host copy is freed once written."""
    delay = float(os.environ.get(WRITE_DELAY_ENV, "0"))
    try:
        if files.error is not None:
            return
        with disk_full(_disk_limit(faults, step, rank, after_agreement=False)):
            _inject_failure(faults, step)
            while files.pending:
                time.sleep(delay)
                obj, path = files.pending[0]
                files.records.append(save_hashed(obj, path, rank, zipfile, fsync=True))
                files.pending.pop(0)
            _inject_kill(faults, step)
    except Exception as caught:
        files.error = caught
    finally:
        files.pending.clear()


def commit(files: StepFiles, state: TrainingState, config: Config, tokenizer_path: Path | None,
           dist_info: DistributedInfo, ending: dict[str, str] | None = None) -> Path | None:
    """Complete the checkpoint whose files every rank has written (``files``), or remove it: the step dir, or
    None (and the previous checkpoint intact, still ``latest``) if any write on any rank failed. Every rank returns
    after the same two all-rank agreements, so none waits on a failed one. ``ending``: how the run ends at this
    checkpoint (``stopped_by``, ``signal``), added to its COMPLETE marker."""
    step_dir, error = files.step_dir, files.error
    checkpoints = step_dir.parent
    outcomes = all_gather_objects((error is not None, files.records))
    failures: float = sum(failed for failed, _ in outcomes)
    if not failures and dist_info.is_main:  # rank 0's own writes, agreed on below before anyone returns
        try:
            limit = _disk_limit(config.train.fault_injection, state.step, dist_info.rank, after_agreement=True)
            with disk_full(limit):
                _write_completion(step_dir, [record for _, mine in outcomes for record in mine], state, config,
                                  tokenizer_path, dist_info, files.started, ending)
        except Exception as caught:
            error = caught
    if not failures:
        failures = all_reduce_sum([0.0 if error is None else 1.0], dist_info.device)[0]
    if failures:
        if dist_info.is_main:
            (step_dir / checkpoint_dirs.COMPLETE_MARKER).unlink(missing_ok=True)  # first, should removal stop midway
            shutil.rmtree(step_dir, ignore_errors=True)
            previous = checkpoint_dirs.latest_complete(checkpoints)
            notice(f"checkpoint at step {state.step} failed on {int(failures)} rank(s)"
                   f"{f' ({_describe_error(error, checkpoints)})' if error else ''}; removed {step_dir}; the last "
                   f"complete checkpoint is {previous if previous else 'none'}")
        barrier()
        return None
    if dist_info.is_main:  # checkpoints past this step belong to a history the run left (a redone step): not counted
        keep_last = config.train.keep_last_checkpoints
        for old in this_history(checkpoint_dirs.complete_checkpoints(checkpoints), state.step)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return step_dir


def _write_completion(step_dir: Path, records: list[FileRecord], state: TrainingState, config: Config,
                      tokenizer_path: Path | None, dist_info: DistributedInfo, started: float,
                      ending: dict[str, str] | None) -> None:
    """Rank 0: config, tokenizer, manifest, COMPLETE marker, then ``latest`` (the commit point)."""
    config_lib.save(config, step_dir / checkpoint_dirs.CONFIG_FILE)
    records.append(record_file(step_dir / checkpoint_dirs.CONFIG_FILE, dist_info.rank))
    if tokenizer_path is not None:  # tokenizer.model, or tokenizer.json (+ tokenizer_config.json)
        records += [record_file(path, dist_info.rank) for path in checkpoint_dirs.copy_tokenizer(tokenizer_path,
                                                                                               step_dir)]
    write_manifest(step_dir, records)
    marker = {**state.__dict__, "world_size": dist_info.world_size,
              "sequence_parallel_size": dist_info.sequence_parallel_size,
              "zero_stage": config.train.zero_stage, "precision": config.precision,
              "seconds": round(time.perf_counter() - started, 3), **(ending or {})}
    write_text_atomic(step_dir / checkpoint_dirs.COMPLETE_MARKER, json.dumps(marker, indent=2) + "\n")
    write_text_atomic(step_dir.parent / checkpoint_dirs.LATEST_FILE, step_dir.name + "\n")


def _deepspeed_save(engine: Any, step_dir: Path, state: TrainingState, capture: bool) -> list[tuple[Any, Path]]:
    """DeepSpeed's files of the step (every layout: its checkpoint engine sees each one): written, or with
    ``capture`` returned as host copies; a failure raised."""
    writer = engine.checkpoint_engine
    writer.begin(capture)
    try:
        engine.save_checkpoint(str(step_dir.parent), tag=step_dir.name, save_latest=False, client_state={
            **state.to_client_state(), UNIVERSAL_CHECKPOINT_INFO: universal.universal_checkpoint_info()})
        if writer.error is not None:
            raise writer.error
    finally:
        captured = writer.end_capture()
    return captured


def _disk_limit(faults: FaultInjectionConfig, step: int, rank: int, after_agreement: bool) -> int | None:
    applies = (step in faults.disk_full_save_steps and faults.disk_full_rank in (None, rank)
               and faults.disk_full_after_agreement == after_agreement)
    return faults.disk_full_bytes if applies else None


def _inject_failure(faults: FaultInjectionConfig, step: int) -> None:
    if faults.fail_save_step == step:
        raise OSError(28, f"No space left on device (fault injection at step {step})")


def _inject_kill(faults: FaultInjectionConfig, step: int) -> None:
    if faults.kill_during_save_step == step:
        os.kill(os.getpid(), signal.SIGKILL)


@contextmanager
def disk_full(limit: int | None) -> Iterator[None]:
    """Fault injection: a real file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored so writes past it fail with
    EFBIG, as on a full disk) for the body; the previous limit and handler are restored afterwards."""
    if limit is None:
        yield
        return
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN) if _main_thread() else None
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        if previous_handler is not None:
            signal.signal(signal.SIGXFSZ, previous_handler)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _describe_error(error: BaseException, where: Path | None = None) -> str:
    text = str(error).strip().splitlines()
    described = f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")
    if where is not None and universal.is_disk_full(error):  # torch.save says "unexpected pos", not ENOSPC
        return f"{described}: a full disk at {where}"
    return described


def _clear_step_dir(step_dir: Path) -> None:
    """A save writes its step dir as a unit: an earlier save of the same step (a redone step: ``--resume none``
    in the same run dir, a rollback, ``--resume auto``'s fallback, a crash mid-save) is removed first, with every
    file of it (other ranks' files, its ``universal/`` conversion), so none of them survives into the new save.
    Its COMPLETE marker goes first, so a removal cut short leaves an incomplete dir, never a complete mixture."""
    if not step_dir.exists():
        return
    (step_dir / checkpoint_dirs.COMPLETE_MARKER).unlink(missing_ok=True)
    shutil.rmtree(step_dir, ignore_errors=True)
    if step_dir.exists():
        shutil.rmtree(step_dir)  # raises the reason (OSError): the save fails on every rank
