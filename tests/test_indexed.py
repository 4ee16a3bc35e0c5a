"""MMIDIDX .bin/.idx shards: byte layout checked by an independent struct reader, validation, merge."""

from __future__ import annotations

import os
import pickle
import resource
import signal
import struct
from pathlib import Path

import numpy as np
import pytest

from megatron_lite.data.indexed import (
    IndexedDataset,
    IndexedDatasetWriter,
    dtype_for_vocab,
    merge_datasets,
    neox_prefix,
)

# Independent of indexed.py: the layout as documented by Megatron's MMapIndexedDataset.
MAGIC = b"MMIDIDX\x00\x00"
CODE_FMT = {1: "B", 2: "b", 3: "h", 4: "i", 5: "q", 8: "H"}
CODE_SIZE = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 8: 2}


def read_pair(prefix: str) -> dict:
    """Parse {prefix}.idx/.bin with struct and plain reads only."""
    with open(prefix + ".idx", "rb") as f:
        raw = f.read()
    assert raw[:9] == MAGIC
    version, code, n, d = struct.unpack_from("<QBQQ", raw, 9)
    o = 9 + 8 + 1 + 8 + 8
    sizes = list(struct.unpack_from(f"<{n}i", raw, o))
    o += 4 * n
    pointers = list(struct.unpack_from(f"<{n}q", raw, o))
    o += 8 * n
    doc_idx = list(struct.unpack_from(f"<{d}q", raw, o))
    o += 8 * d
    assert o == len(raw), "idx has trailing bytes"
    with open(prefix + ".bin", "rb") as f:
        data = f.read()
    seqs = [list(struct.unpack_from(f"<{s}{CODE_FMT[code]}", data, p)) for s, p in zip(sizes, pointers)]
    assert len(data) == sum(sizes) * CODE_SIZE[code]
    return dict(version=version, code=code, sizes=sizes, pointers=pointers, doc_idx=doc_idx, seqs=seqs)


def idx_bytes(code: int, sizes: list[int], pointers: list[int], doc_idx: list[int], *, magic: bytes = MAGIC,
              version: int = 1, n: int | None = None, d: int | None = None) -> bytes:
    n = len(sizes) if n is None else n
    d = len(doc_idx) if d is None else d
    return (magic + struct.pack("<QBQQ", version, code, n, d) + struct.pack(f"<{len(sizes)}i", *sizes)
            + struct.pack(f"<{len(pointers)}q", *pointers) + struct.pack(f"<{len(doc_idx)}q", *doc_idx))


# 3 int32 sequences, 2 documents: [seq0], [seq1, seq2].
HAND_SEQS = [[5, -7, 2**31 - 1], [0], [9, 8, 7, 6]]
HAND_SIZES = [3, 1, 4]
HAND_PTRS = [0, 12, 16]
HAND_DOCS = [0, 1, 3]


def write_hand_pair(prefix: str, idx: bytes | None = None, bin_: bytes | None = None) -> None:
    with open(prefix + ".idx", "wb") as f:
        f.write(idx_bytes(4, HAND_SIZES, HAND_PTRS, HAND_DOCS) if idx is None else idx)
    with open(prefix + ".bin", "wb") as f:
        f.write(struct.pack("<8i", *sum(HAND_SEQS, [])) if bin_ is None else bin_)


# Documents as lists of sequences; doc 1 is a multi-item document.
DOCS = [[[1, 2, 3]], [[10, 11], [12], [13, 14, 15, 16]], [[7]], [[4, 4, 4, 4, 4]]]


@pytest.mark.parametrize("vocab,code", [(50_304, 8), (65_499, 8), (65_500, 4), (200_000, 4)])
def test_writer_matches_independent_reader(tmp_path: Path, vocab: int, code: int) -> None:
    prefix = neox_prefix(str(tmp_path / "shard"), "text")
    assert prefix.endswith("shard_text_document")
    top = vocab - 1
    docs = DOCS + [[[top, 0, top]]]
    with IndexedDatasetWriter(prefix, dtype_for_vocab(vocab)) as w:
        for doc in docs:
            if len(doc) == 1:
                w.add_document(np.asarray(doc[0]))
            else:
                for seq in doc:
                    w.add_item(seq)
                w.end_document()
    got = read_pair(prefix)
    seqs = [s for doc in docs for s in doc]
    sizes = [len(s) for s in seqs]
    item = CODE_SIZE[code]
    assert got["version"] == 1 and got["code"] == code
    assert got["sizes"] == sizes
    assert got["pointers"] == [item * sum(sizes[:i]) for i in range(len(sizes))]
    assert got["doc_idx"] == [0, 1, 4, 5, 6, 7]
    assert got["seqs"] == seqs

    ds = IndexedDataset(prefix)
    assert len(ds) == len(seqs) and ds.num_documents == len(docs)
    assert ds.sizes.tolist() == sizes and ds.doc_idx.tolist() == got["doc_idx"]
    assert ds.num_tokens == sum(sizes) and ds.dtype == np.dtype(CODE_FMT[code]).newbyteorder("<")
    assert [ds[i].tolist() for i in range(len(ds))] == seqs
    assert ds.document(1).tolist() == [10, 11, 12, 13, 14, 15, 16]


def test_hand_built_pair_reads_back(tmp_path: Path) -> None:
    prefix = str(tmp_path / "hand")
    write_hand_pair(prefix)
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.int32 and len(ds) == 3 and ds.num_documents == 2 and ds.num_tokens == 8
    assert [ds[i].tolist() for i in range(3)] == HAND_SEQS
    assert ds[-1].tolist() == HAND_SEQS[2]
    assert ds.get(2, 1, 2).tolist() == [8, 7] and ds.get(0, 1).tolist() == [-7, 2**31 - 1]
    assert ds.document(0).tolist() == HAND_SEQS[0]
    assert ds.document(1).tolist() == HAND_SEQS[1] + HAND_SEQS[2]
    # Zero-copy: views into the .bin memmap.
    for view in (ds[1], ds.get(2, 1, 2), ds.document(1)):
        assert not view.flags.owndata and not view.flags.writeable
        while not isinstance(view, np.memmap):
            view = view.base
        assert view.filename == str((tmp_path / "hand.bin").resolve())
    with pytest.raises(IndexError):
        ds[3]
    with pytest.raises(IndexError):
        ds.get(0, 2, 5)
    again = pickle.loads(pickle.dumps(ds))
    assert again[2].tolist() == HAND_SEQS[2]


GOOD_BIN = struct.pack("<8i", *sum(HAND_SEQS, []))
CORRUPTIONS = {
    "truncated_idx": ("idx", idx_bytes(4, HAND_SIZES, HAND_PTRS, HAND_DOCS)[:-5], None, "truncated"),
    "trailing_idx": ("idx", idx_bytes(4, HAND_SIZES, HAND_PTRS, HAND_DOCS) + b"\0", None, "trailing garbage"),
    "truncated_bin": ("bin", None, GOOD_BIN[:-4], "truncated"),
    "long_bin": ("bin", None, GOOD_BIN + b"\0\0\0\0", "too long"),
    "bad_magic": ("idx", idx_bytes(4, HAND_SIZES, HAND_PTRS, HAND_DOCS, magic=b"TNTIDX\x00\x00\x00"), None,
                  "bad magic"),
    "version": ("idx", idx_bytes(4, HAND_SIZES, HAND_PTRS, HAND_DOCS, version=2), None, "unsupported version 2"),
    "code6": ("idx", idx_bytes(6, HAND_SIZES, HAND_PTRS, HAND_DOCS), None, "ambiguous dtype code 6"),
    "code7": ("idx", idx_bytes(7, HAND_SIZES, HAND_PTRS, HAND_DOCS), None, "ambiguous dtype code 7"),
    "code9": ("idx", idx_bytes(9, HAND_SIZES, HAND_PTRS, HAND_DOCS), None, "unknown dtype code 9"),
    "pointers": ("idx", idx_bytes(4, HAND_SIZES, [0, 12, 20], HAND_DOCS), None, "pointers inconsistent"),
    "doc_last": ("idx", idx_bytes(4, HAND_SIZES, HAND_PTRS, [0, 1, 2]), None, "doc_idx last entry 2"),
    "doc_start": ("idx", idx_bytes(4, HAND_SIZES, HAND_PTRS, [1, 1, 3]), None, "start at 0"),
    "doc_order": ("idx", idx_bytes(4, HAND_SIZES, HAND_PTRS, [0, 2, 1, 3]), None, "non-decreasing"),
    "short_header": ("idx", MAGIC + b"\x01\x00", None, "truncated header"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corruption_fails_at_open(tmp_path: Path, case: str) -> None:
    which, idx, bin_, problem = CORRUPTIONS[case]
    prefix = str(tmp_path / "bad")
    write_hand_pair(prefix, idx, bin_)
    with pytest.raises(ValueError) as err:
        IndexedDataset(prefix)
    msg = str(err.value)
    assert f"{prefix}.{which}" in msg and problem in msg, msg


@pytest.mark.parametrize("which", ["bin", "idx"])
def test_missing_file(tmp_path: Path, which: str) -> None:
    prefix = str(tmp_path / "gone")
    write_hand_pair(prefix)
    os.unlink(f"{prefix}.{which}")
    with pytest.raises(ValueError, match="missing file") as err:
        IndexedDataset(prefix)
    assert f"{prefix}.{which}" in str(err.value)


def test_writer_rejects_out_of_range_and_bad_dtypes(tmp_path: Path) -> None:
    with IndexedDatasetWriter(str(tmp_path / "u16"), np.uint16) as w:
        with pytest.raises(ValueError, match=r"token id 65536 does not fit uint16"):
            w.add_document([1, 65536])
        with pytest.raises(ValueError, match=r"token id -1 does not fit uint16"):
            w.add_document(np.array([-1, 3]))
        with pytest.raises(ValueError, match="integers"):
            w.add_document([1.5])
        w.add_document([65535])
    assert IndexedDataset(str(tmp_path / "u16"))[0].tolist() == [65535]  # rejected items left no trace
    with IndexedDatasetWriter(str(tmp_path / "i32"), np.int32) as w:
        with pytest.raises(ValueError, match=r"token id 2147483648 does not fit int32"):
            w.add_document([2**31])
        with pytest.raises(ValueError, match=r"token id 1267650600228229401496703205376 does not fit int32"):
            w.add_document([2**100])
    for dt in (np.float32, np.float64, np.uint32):
        with pytest.raises(ValueError, match="unsupported token dtype"):
            IndexedDatasetWriter(str(tmp_path / "f"), dt)


def test_interrupted_writer_leaves_no_idx(tmp_path: Path) -> None:
    prefix = str(tmp_path / "crash")
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(prefix, np.uint16) as w:
            w.add_document([1, 2, 3])
            raise RuntimeError("tokenizer died")
    assert os.listdir(tmp_path) == []  # no .idx, no .bin, no temporaries


@pytest.mark.parametrize("limit", [1000, 20_000], ids=["first_flush", "buffered_rest_fails_again_at_close"])
def test_full_disk_is_one_line_naming_the_file_and_leaves_no_temporary(tmp_path: Path, limit: int) -> None:
    """A real file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored: write() fails with EFBIG as on a full disk) while
    small documents are buffered: the failed flush leaves bytes in the buffer, whose flush at close fails again."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        with pytest.raises(ValueError) as error:
            with IndexedDatasetWriter(tmp_path / "full", np.uint16) as w:
                for _ in range(1000):
                    w.add_document(np.arange(100))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert str(error.value) == (f"{tmp_path / 'full.bin'}: no room to write (File too large): the file system is "
                                "full or a quota or file-size limit applies; free space and re-run (no partial file "
                                "is left)")
    assert os.listdir(tmp_path) == []


def test_rewrite_replaces_pair(tmp_path: Path) -> None:
    prefix = str(tmp_path / "again")
    for tokens in ([1, 2, 3], [9]):
        with IndexedDatasetWriter(prefix, np.uint16) as w:
            w.add_document(tokens)
    assert IndexedDataset(prefix)[0].tolist() == [9]
    assert sorted(os.listdir(tmp_path)) == ["again.bin", "again.idx"]


def test_merge_equals_concatenation(tmp_path: Path) -> None:
    a, b, out = (str(tmp_path / n) for n in ("a", "b", "merged"))
    with IndexedDatasetWriter(a, np.uint16) as w:
        w.add_document([1, 2])
        w.add_item([3])
        w.add_item([4, 5])
        w.end_document()
    with IndexedDatasetWriter(b, np.uint16) as w:
        w.add_document([6, 7, 8])
        w.add_document([9])
    merge_datasets([a, b], out)
    ra, rb, rm = read_pair(a), read_pair(b), read_pair(out)
    assert rm["code"] == 8
    assert rm["seqs"] == ra["seqs"] + rb["seqs"]
    assert rm["sizes"] == ra["sizes"] + rb["sizes"]
    assert rm["doc_idx"] == [0, 1, 3, 4, 5]
    assert rm["pointers"] == [0, 4, 6, 10, 16]
    assert [IndexedDataset(out).document(k).tolist() for k in range(4)] == [[1, 2], [3, 4, 5], [6, 7, 8], [9]]

    with IndexedDatasetWriter(str(tmp_path / "c"), np.int32) as w:
        w.add_document([1])
    with pytest.raises(ValueError, match="dtype mismatch"):
        merge_datasets([a, str(tmp_path / "c")], str(tmp_path / "m2"))
    assert not os.path.exists(str(tmp_path / "m2.idx"))


def test_dtype_for_vocab() -> None:
    assert dtype_for_vocab(50_257) == np.uint16
    assert dtype_for_vocab(65_499) == np.uint16
    assert dtype_for_vocab(65_500) == np.int32
    assert dtype_for_vocab(256_000) == np.int32


def test_writer_bytes_equal_hand_built(tmp_path: Path) -> None:
    hand, ours = str(tmp_path / "hand"), str(tmp_path / "ours")
    write_hand_pair(hand)
    with IndexedDatasetWriter(ours, np.int32) as w:
        w.add_document(HAND_SEQS[0])
        w.add_item(HAND_SEQS[1])
        w.add_item(HAND_SEQS[2])
        w.end_document()
    for ext in (".idx", ".bin"):
        assert Path(ours + ext).read_bytes() == Path(hand + ext).read_bytes()


def test_empty_dataset(tmp_path: Path) -> None:
    prefix = str(tmp_path / "empty")
    with IndexedDatasetWriter(prefix, np.uint16):
        pass
    ds = IndexedDataset(prefix)
    assert len(ds) == 0 and ds.num_documents == 0 and ds.num_tokens == 0
    assert read_pair(prefix)["doc_idx"] == [0]


def test_written_shards_are_readable_by_others(tmp_path) -> None:
    import stat

    from megatron_lite.data.indexed import IndexedDatasetWriter

    with IndexedDatasetWriter(tmp_path / "shard", "uint16") as writer:
        writer.add_document([1, 2, 3])
    for suffix in (".bin", ".idx"):
        mode = (tmp_path / f"shard{suffix}").stat().st_mode
        assert mode & stat.S_IRGRP and mode & stat.S_IROTH, oct(mode)
