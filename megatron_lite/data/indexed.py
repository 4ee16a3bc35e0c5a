"""Megatron / GPT-NeoX ``MMIDIDX`` token shards (``.bin`` + ``.idx``), byte-compatible.

Layout (little-endian; Megatron ``MMapIndexedDataset``, Megatron-Core identical)::

    .idx  b"MMIDIDX\\x00\\x00"   9 bytes magic
          u64 version = 1
          u8  dtype code        1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16
          u64 N                 number of sequences
          u64 D                 len(doc_idx) = documents + 1
          int32[N] sizes        tokens per sequence
          int64[N] pointers     byte offsets into .bin = exclusive cumsum(sizes * itemsize)
          int64[D] doc_idx      doc_idx[0] = 0, non-decreasing, doc_idx[-1] = N;
                                document k = sequences doc_idx[k] .. doc_idx[k+1]-1
    .bin  all sequences' tokens concatenated, in that dtype.

Codes 6/7 mean float32/float64 in some Megatron copies and other types in others, so they are
never written and reading them is an error. Sequences of a document are adjacent in ``.bin``,
so a document is one contiguous (zero-copy) slice.

Variants found in the wild: GPT-NeoX ``merge_datasets.py`` writes doc_idx = [0] (D = 1) for N > 0
sequences, readable with ``unindexed_as_sequences=True`` as one document per sequence; Megatron-core
``multimodal=True`` appends ``int8[N] sequence_modes`` after doc_idx, which is refused by name.
"""

from __future__ import annotations

import errno
import os
import shutil
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import numpy.typing as npt

from megatron_lite.files import temporary_sibling

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# magic, u64 version, u8 dtype code, u64 N, u64 D
_HEADER = struct.Struct("<9sQBQQ")
HEADER_SIZE = _HEADER.size  # 34

DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype("<u1"),
    2: np.dtype("<i1"),
    3: np.dtype("<i2"),
    4: np.dtype("<i4"),
    5: np.dtype("<i8"),
    8: np.dtype("<u2"),
}
_CODE_OF: dict[np.dtype, int] = {dt: code for code, dt in DTYPE_CODES.items()}
AMBIGUOUS_CODES = (6, 7)

_INT32_MAX = np.iinfo(np.int32).max
_COPY_CHUNK = 16 << 20  # bytes per read when merging .bin files


class IndexedDatasetError(ValueError):
    """A .bin/.idx pair that is missing, malformed or inconsistent; the message names the file."""


def data_file_path(prefix: str | os.PathLike[str]) -> str:
    """``{prefix}.bin`` (string concatenation: prefixes often contain dots)."""
    return os.fspath(prefix) + ".bin"


def index_file_path(prefix: str | os.PathLike[str]) -> str:
    """``{prefix}.idx``."""
    return os.fspath(prefix) + ".idx"


def neox_prefix(output_prefix: str | os.PathLike[str], json_key: str = "text") -> str:
    """GPT-NeoX ``preprocess_data.py`` naming: ``{output_prefix}_{json_key}_document``."""
    return f"{os.fspath(output_prefix)}_{json_key}_document"


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id fits with margin (vocab < 65,500, Megatron's cut-off), else int32."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return np.dtype("<u2") if vocab_size < 65500 else np.dtype("<i4")


def _dtype_code(dtype: npt.DTypeLike) -> tuple[np.dtype, int]:
    """(little-endian dtype, code); refuses anything without an unambiguous code."""
    dt = np.dtype(dtype).newbyteorder("<")
    if dt not in _CODE_OF:
        names = ", ".join(d.name for d in DTYPE_CODES.values())
        raise ValueError(
            f"unsupported token dtype {np.dtype(dtype).name}: expected one of {names} "
            "(float codes 6/7 are ambiguous across Megatron copies and are never written)"
        )
    return dt, _CODE_OF[dt]


def _as_tokens(tokens: Any, dtype: np.dtype) -> np.ndarray:
    """1-D array of ``dtype``; ValueError naming the first id that does not fit."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
    info = np.iinfo(dtype)
    if arr.dtype.kind == "O":  # python ints beyond int64
        for v in arr:
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or not info.min <= v <= info.max:
                raise ValueError(f"token id {v!r} does not fit {dtype.name} (range {info.min}..{info.max})")
        return arr.astype(dtype)
    if arr.size == 0:
        return arr.astype(dtype)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype.name}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < info.min or hi > info.max:
        bad = lo if lo < info.min else hi
        raise ValueError(f"token id {bad} does not fit {dtype.name} (range {info.min}..{info.max})")
    if arr.size > _INT32_MAX:
        raise ValueError(f"sequence of {arr.size} tokens exceeds the int32 size field")
    return arr.astype(dtype, copy=False)


NO_ROOM_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})  # full disk, file-size limit, quota


def raise_if_no_room(error: OSError, path: str | os.PathLike[str]) -> None:
    """A write that found no room (full file system, quota, RLIMIT_FSIZE) as one ValueError line naming ``path``;
    any other OSError is left to the caller."""
    if error.errno in NO_ROOM_ERRNOS:
        raise ValueError(f"{path}: no room to write ({error.strerror}): the file system is full or a quota or "
                         "file-size limit applies; free space and re-run (no partial file is left)") from error


class IndexedDatasetWriter:
    """Streams sequences into ``{prefix}.bin``; writes ``{prefix}.idx`` on close.

    Both files are written under temporary names in the target directory and renamed into place
    at the end (.bin, then .idx, after removing any stale .idx), so a crash never leaves a pair
    that passes as complete. Leaving the ``with`` block by an exception discards everything.
    Only sizes and doc_idx (O(sequences)) are held in memory, never the tokens.
    """

    def __init__(self, prefix: str | os.PathLike[str], dtype: npt.DTypeLike) -> None:
        self.dtype, self._code = _dtype_code(dtype)
        self.prefix = os.fspath(prefix)
        self._sizes: list[int] = []
        self._doc_idx: list[int] = [0]
        self._closed = False
        # Temporary names beside the targets; open() applies the umask (shards are shared by ranks and users).
        self._bin_tmp = temporary_sibling(os.path.abspath(data_file_path(self.prefix)))
        self._bin = open(self._bin_tmp, "xb")
        self._idx_tmp: Path | None = None

    # -- building -------------------------------------------------------------------------
    def add_item(self, tokens: Any) -> None:
        """Append one sequence to the current document (Megatron builder ``add_item``)."""
        self._check_open()
        arr = _as_tokens(tokens, self.dtype)
        try:
            self._bin.write(memoryview(np.ascontiguousarray(arr)).cast("B"))
        except OSError as error:
            self._fail_write(error, data_file_path(self.prefix))
        self._sizes.append(int(arr.size))

    def end_document(self) -> None:
        """Close the current document: the sequences added since the last boundary."""
        self._check_open()
        self._doc_idx.append(len(self._sizes))

    def add_document(self, tokens: Any) -> None:
        """One document made of one sequence (our normal case)."""
        self.add_item(tokens)
        self.end_document()

    def add_dataset(self, ds: IndexedDataset) -> None:
        """Append every document of an open dataset (same dtype), copying .bin bytes in chunks."""
        self._check_open()
        if ds.dtype != self.dtype:
            raise ValueError(f"cannot merge {ds.prefix} ({ds.dtype.name}) into a {self.dtype.name} dataset")
        if self._doc_idx[-1] != len(self._sizes):
            raise ValueError("add_dataset inside an open document: call end_document() first")
        offset = len(self._sizes)
        with open(ds.bin_path, "rb") as src:
            try:
                shutil.copyfileobj(src, self._bin, _COPY_CHUNK)
            except OSError as error:
                self._fail_write(error, data_file_path(self.prefix))
        self._sizes.extend(ds.sizes.tolist())
        self._doc_idx.extend((ds.doc_idx[1:] + offset).tolist())

    # -- finishing ------------------------------------------------------------------------
    def close(self) -> None:
        """Write .idx and rename both files into place. Idempotent."""
        if self._closed:
            return
        if self._doc_idx[-1] != len(self._sizes):  # trailing add_item()s: close their document
            self._doc_idx.append(len(self._sizes))
        writing = data_file_path(self.prefix)  # the file a failed write names
        try:
            self._bin.flush()
            os.fsync(self._bin.fileno())
            self._bin.close()
            sizes = np.asarray(self._sizes, dtype="<i4")  # (N,)
            pointers = np.zeros(len(self._sizes), dtype="<i8")  # (N,) exclusive cumsum, in bytes
            if len(self._sizes) > 1:
                np.cumsum(sizes[:-1].astype("<i8") * self.dtype.itemsize, out=pointers[1:])
            doc_idx = np.asarray(self._doc_idx, dtype="<i8")  # (D,)
            self._idx_tmp = temporary_sibling(os.path.abspath(index_file_path(self.prefix)))
            writing = index_file_path(self.prefix)
            with open(self._idx_tmp, "xb") as f:
                f.write(_HEADER.pack(MAGIC, VERSION, self._code, len(sizes), len(doc_idx)))
                f.write(sizes.tobytes())
                f.write(pointers.tobytes())
                f.write(doc_idx.tobytes())
                f.flush()
                os.fsync(f.fileno())
            # Old .idx gone before the new .bin lands: never a stale .idx beside a new .bin.
            idx_path, bin_path = index_file_path(self.prefix), data_file_path(self.prefix)
            if os.path.lexists(idx_path):
                os.unlink(idx_path)
            os.replace(self._bin_tmp, bin_path)
            os.replace(self._idx_tmp, idx_path)
        except OSError as error:
            self._fail_write(error, writing)
        except BaseException:
            self.abort()
            raise
        self._closed = True

    def abort(self) -> None:
        """Discard everything written; the target files are left untouched."""
        self._closed = True
        if not self._bin.closed:
            try:
                self._bin.close()
            except OSError:  # flushing the buffer's rest fails again on a full disk; the file is closed anyway
                pass
        for tmp in (self._bin_tmp, self._idx_tmp):
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def _fail_write(self, error: OSError, path: str) -> NoReturn:
        """Discard everything, then raise: one line naming ``path`` when there was no room."""
        self.abort()
        raise_if_no_room(error, path)
        raise error

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"writer for {self.prefix} is closed")


class IndexedDataset:
    """Read-only, zero-copy view of a .bin/.idx pair; fully validated at open.

    ``ds[i]`` and ``ds.get(i, offset, length)`` are slices of a memmap of ``.bin``: only the
    pages touched are read.
    """

    def __init__(self, prefix: str | os.PathLike[str], unindexed_as_sequences: bool = False) -> None:
        """``unindexed_as_sequences``: accept a merged set without document boundaries (doc_idx == [0]
        with N > 0, GPT-NeoX ``merge_datasets.py`` output) and read each sequence as one document.
        Off by default so our own shards stay strictly validated; ``self.unindexed`` says it applied."""
        self.prefix = os.fspath(prefix)
        self.idx_path = index_file_path(self.prefix)
        self.bin_path = data_file_path(self.prefix)
        self.unindexed_as_sequences = unindexed_as_sequences
        self.unindexed = False
        self._open()

    def _fail(self, path: str, problem: str) -> IndexedDatasetError:
        return IndexedDatasetError(f"{path}: {problem}")

    def _open(self) -> None:
        idx, bin_ = self.idx_path, self.bin_path
        for path in (idx, bin_):
            if not os.path.isfile(path):
                raise self._fail(path, "missing file")

        idx_size = os.path.getsize(idx)
        with open(idx, "rb") as f:
            head = f.read(HEADER_SIZE)
        if head[: len(MAGIC)] != MAGIC:
            raise self._fail(idx, f"bad magic {head[:len(MAGIC)]!r}, expected {MAGIC!r} (not an MMIDIDX index)")
        if len(head) < HEADER_SIZE:
            raise self._fail(idx, f"truncated header: {len(head)} bytes, need {HEADER_SIZE}")
        _, version, code, n, d = _HEADER.unpack(head)
        if version != VERSION:
            raise self._fail(idx, f"unsupported version {version}, expected {VERSION}")
        if code in AMBIGUOUS_CODES:
            raise self._fail(idx, f"ambiguous dtype code {code} (float in some Megatron copies, not in others)")
        if code not in DTYPE_CODES:
            raise self._fail(idx, f"unknown dtype code {code}")
        self.dtype: np.dtype = DTYPE_CODES[code]

        expected = HEADER_SIZE + 4 * n + 8 * n + 8 * d
        if idx_size < expected:
            raise self._fail(idx, f"truncated: {idx_size} bytes, header declares N={n}, D={d} -> {expected} bytes")
        if n and idx_size == expected + n:  # Megatron-core IndexedDataset(multimodal=True): int8[N] modes
            raise self._fail(idx, f"a Megatron-core multimodal index ({n} extra bytes of sequence_modes after "
                                  "doc_idx); only text (non-multimodal) shards are supported")
        if idx_size > expected:
            raise self._fail(idx, f"trailing garbage: {idx_size - expected} bytes after the declared arrays")

        # Views into one memmap of the .idx; offset 34 leaves them unaligned, which numpy handles.
        mm = np.memmap(idx, dtype=np.uint8, mode="r")
        o = HEADER_SIZE
        self.sizes: np.ndarray = mm[o : o + 4 * n].view("<i4")  # (N,)
        o += 4 * n
        self.pointers: np.ndarray = mm[o : o + 8 * n].view("<i8")  # (N,) bytes into .bin
        o += 8 * n
        self.doc_idx: np.ndarray = mm[o : o + 8 * d].view("<i8")  # (D,)

        if n and int(self.sizes.min()) < 0:
            raise self._fail(idx, "negative sequence size")
        itemsize = self.dtype.itemsize
        sizes64 = self.sizes.astype(np.int64)
        expected_ptr = np.zeros(n, dtype=np.int64)
        if n > 1:
            np.cumsum(sizes64[:-1] * itemsize, out=expected_ptr[1:])
        if not np.array_equal(self.pointers, expected_ptr):
            bad = int(np.flatnonzero(self.pointers != expected_ptr)[0])
            raise self._fail(
                idx,
                f"pointers inconsistent with sizes: pointers[{bad}]={int(self.pointers[bad])}, "
                f"expected {int(expected_ptr[bad])}",
            )
        if d < 1 or int(self.doc_idx[0]) != 0:
            raise self._fail(idx, "doc_idx must start at 0")
        if d > 1 and bool((np.diff(self.doc_idx) < 0).any()):
            raise self._fail(idx, "doc_idx is not non-decreasing")
        if d == 1 and n > 0 and self.unindexed_as_sequences:
            self.doc_idx = np.arange(n + 1, dtype="<i8")  # (N+1,) one document per sequence
            self.unindexed = True
        if int(self.doc_idx[-1]) != n:
            hint = (" (a merged set without document boundaries; a mix reads it as type: megatron)"
                    if d == 1 and n > 0 else "")
            raise self._fail(idx, f"doc_idx last entry {int(self.doc_idx[-1])} != number of sequences {n}{hint}")

        self.num_tokens: int = int(sizes64.sum())
        bin_size = os.path.getsize(bin_)
        want = self.num_tokens * itemsize
        if bin_size != want:
            problem = "truncated" if bin_size < want else "too long"
            raise self._fail(
                bin_, f"{problem}: {bin_size} bytes, index declares {self.num_tokens} tokens x {itemsize} = {want}"
            )
        # mmap refuses empty files; an empty .bin (no tokens) gets an empty array instead. A plain ndarray
        # view of the memmap (its base keeps the mapping open): slicing a np.memmap costs ~2 us, a view ~0.1 us.
        self._tokens: np.ndarray = (
            np.memmap(bin_, dtype=self.dtype, mode="r").view(np.ndarray) if want else np.empty(0, dtype=self.dtype)
        )  # (num_tokens,)

    # -- access ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.sizes.shape[0])

    @property
    def num_documents(self) -> int:
        return int(self.doc_idx.shape[0]) - 1

    def _seq_index(self, i: int) -> int:
        n = len(self)
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sequence index out of range for {n} sequences")
        return i

    def __getitem__(self, i: int) -> np.ndarray:
        """Tokens of sequence i, shape (sizes[i],); a view of the .bin mapping, no copy."""
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """tokens[offset : offset + length] of sequence i, reading nothing else."""
        i = self._seq_index(i)
        size = int(self.sizes[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"slice [{offset}, {offset}+{length}) outside sequence {i} of {size} tokens")
        start = int(self.pointers[i]) // self.dtype.itemsize + offset
        return self._tokens[start : start + length]

    def document(self, k: int) -> np.ndarray:
        """Concatenated tokens of document k: its sequences are adjacent, so still a view."""
        nd = self.num_documents
        k = int(k) + nd if int(k) < 0 else int(k)
        if not 0 <= k < nd:
            raise IndexError(f"document index out of range for {nd} documents")
        first, end = int(self.doc_idx[k]), int(self.doc_idx[k + 1])
        if first == end:
            return self._tokens[0:0]
        start = int(self.pointers[first]) // self.dtype.itemsize
        return self._tokens[start : start + int(self.sizes[first:end].astype(np.int64).sum())]

    # DataLoader workers: pickle the prefix and re-mmap, instead of copying the memmapped data.
    def __getstate__(self) -> tuple[str, bool]:
        return self.prefix, self.unindexed_as_sequences

    def __setstate__(self, state: tuple[str, bool]) -> None:
        self.__init__(*state)  # type: ignore[misc]

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({self.prefix!r}, dtype={self.dtype.name}, sequences={len(self)}, "
            f"documents={self.num_documents}, tokens={self.num_tokens})"
        )


def merge_datasets(prefixes: Iterable[str | os.PathLike[str]], out_prefix: str | os.PathLike[str]) -> None:
    """Concatenate shards (same dtype) into ``out_prefix``, documents in order; atomic like the writer."""
    datasets = [IndexedDataset(p) for p in prefixes]
    if not datasets:
        raise ValueError("merge_datasets needs at least one input prefix")
    out = os.path.abspath(os.fspath(out_prefix))
    for ds in datasets:
        if os.path.abspath(ds.prefix) == out:
            raise ValueError(f"out_prefix {out_prefix} is also an input")
        if ds.dtype != datasets[0].dtype:
            raise ValueError(
                f"dtype mismatch: {datasets[0].prefix} is {datasets[0].dtype.name}, {ds.prefix} is {ds.dtype.name}"
            )
    with IndexedDatasetWriter(out_prefix, datasets[0].dtype) as writer:
        for ds in datasets:
            writer.add_dataset(ds)
