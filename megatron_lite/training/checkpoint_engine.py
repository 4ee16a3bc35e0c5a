"""DeepSpeed's checkpoint engine, made safe to load from and able to say what it wrote.

``TorchCheckpointEngine`` loads with ``weights_only=False`` (code in a crafted file runs) and lets a
failed write raise out of ``engine.save_checkpoint`` on one rank while the others wait in its
closing barrier. This subclass (installed by ``install``) loads through
``checkpoint_integrity.safe_load``, hashes every file while writing it, and keeps a failed write
for the caller's all-rank agreement instead of raising, so every rank still reaches DeepSpeed's
barrier and no rank waits on another. For an asynchronous save (``begin(capture=True)``) it keeps a host
copy of each file's state dict instead (``host_snapshot.host_copy``), which a background thread writes later.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from megatron_lite.checkpoint_integrity import FileRecord, safe_load, save_hashed
from megatron_lite.training.host_snapshot import Buffers, host_copy


class VerifiedCheckpointEngine(TorchCheckpointEngine):
    def __init__(self, zipfile_serialization: bool, rank: int) -> None:
        super().__init__(config_params=None)
        self.zipfile_serialization = zipfile_serialization
        self.rank = rank
        self.written: list[FileRecord] = []
        self.error: Exception | None = None  # the first failed write since begin()
        self.capture = False
        self.captured: list[tuple[Any, Path]] = []  # (host copy of a state dict, its file) since begin(capture=True)
        self._buffers: Buffers = {}  # the host copies of the last snapshot's storages, reused by the next one
        self._reusable: Buffers = {}

    def begin(self, capture: bool = False) -> None:
        """Forget the records, captures and failure of the previous save; ``capture``: keep host copies of the
        state dicts DeepSpeed saves, with their paths, instead of writing them, in the previous snapshot's buffers
        (the caller makes sure its write has ended)."""
        self.written, self.error, self.capture, self.captured = [], None, capture, []
        if capture:
            self._reusable, self._buffers = self._buffers, {}

    def end_capture(self) -> list[tuple[Any, Path]]:
        """The host copies taken since ``begin(capture=True)``; buffers no storage reused are freed."""
        captured, self.captured, self.capture, self._reusable = self.captured, [], False, {}
        return captured

    def drop_buffers(self) -> None:
        """Never reuse the current buffers (a write still reading them was abandoned)."""
        self._buffers, self._reusable = {}, {}

    def save(self, state_dict: Any, path: str) -> None:
        if self.error is not None:  # the checkpoint is lost already: do not fill the disk further
            return
        try:
            if self.capture:
                copies: Buffers = {}  # per file: a storage freed after one file may be reallocated at its address
                self.captured.append((host_copy(state_dict, copies, self._reusable), Path(path)))
                self._buffers.update(copies)  # reused by the next snapshot
            else:
                self.written.append(save_hashed(state_dict, Path(path), self.rank, self.zipfile_serialization))
        except Exception as error:  # torch.save raises RuntimeError on a full disk, not only OSError
            self.error = error

    def load(self, path: str, map_location: Any = None) -> Any:
        return safe_load(path, map_location=map_location)


def install(engine: Any, rank: int) -> VerifiedCheckpointEngine:
    """Replace ``engine.checkpoint_engine`` (a plain TorchCheckpointEngine: the only kind our DeepSpeed
    config selects) by a VerifiedCheckpointEngine with the same serialization."""
    current = engine.checkpoint_engine
    if type(current) is not TorchCheckpointEngine:
        raise ValueError(f"unexpected DeepSpeed checkpoint engine {type(current).__name__}: megatron_lite "
                         "verifies checkpoints through TorchCheckpointEngine only")
    engine.checkpoint_engine = VerifiedCheckpointEngine(current.zipfile_serialization, rank)
    return engine.checkpoint_engine
