"""The speedrun's data bundle (megatron_lite/repro/bundle.py, tools/build_data_bundle.py): the same bytes twice,
verified unpacking, one-line errors for a damaged archive, non-UTF-8 Gutenberg books decoded, evaluation books
kept out of training, and shards that a ``type: megatron`` mix source reads. Tiny generated inputs, CPU only."""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import random
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from megatron_lite.config import DataConfig, SourceConfig, TokenizerConfig
from megatron_lite.data.indexed import IndexedDataset
from megatron_lite.data.preprocess import prepare_data
from megatron_lite.data.records import NON_UTF8, BadRecord, Document
from megatron_lite.data.sources import decode_auto, read_text
from megatron_lite.data.tokenizer import Tokenizer
from megatron_lite.files import file_sha256
from megatron_lite.repro.bundle import (MANIFEST_NAME, TOKENIZER_NAME, BundleSpec, UnpackedBundle, build_bundle,
                                        checksum_path, unpack_bundle, write_archive, write_checksum, write_manifest)
from script_loading import load_script

WORDS = ("the of and a to in is was he that it his her with as for had you not be on at by which river house "
         "night morning letter garden").split()
LATIN_LINE = "café über naïve Ångström"  # ISO-8859-1 characters that must survive decoding
MIN_TOKENS = 12_000
VOCAB = 400


def gutenberg_book(title: str, body: str, charset: str = "UTF-8") -> str:
    return (f"The Project Gutenberg EBook of {title}\n\nCharacter set encoding: {charset}\n\n"
            f"*** START OF THIS PROJECT GUTENBERG EBOOK {title.upper()} ***\n\n{body}\n\n"
            f"*** END OF THIS PROJECT GUTENBERG EBOOK {title.upper()} ***\n\nEnd of the Project Gutenberg licence.\n")


def _body(rng: random.Random, marker: str, lines: int = 120) -> str:
    text = [f"{marker} {' '.join(rng.choice(WORDS) for _ in range(10))}" for _ in range(lines)]
    return "\n".join(text)


def make_inputs(tmp_dir: Path) -> tuple[Path, Path, Path]:
    """(books, eval books, code): 7 books (one ISO-8859-1, first in order), 2 eval books (one a copy of a
    training book), 12 .py files."""
    rng = random.Random(0)
    books, eval_books, code = tmp_dir / "books", tmp_dir / "eval_books", tmp_dir / "code"
    for directory in (books, eval_books, code):
        directory.mkdir(parents=True, exist_ok=True)
    latin = gutenberg_book("Latin Book", f"{LATIN_LINE}\n" + _body(rng, "BOOK-LATIN"), "ISO-8859-1")
    (books / "000_latin.txt").write_bytes(latin.encode("latin-1"))
    for index in range(1, 7):
        (books / f"{index:03d}.txt").write_text(gutenberg_book(f"Book {index}", _body(rng, f"BOOK-{index:03d}")))
    (eval_books / "held_out.txt").write_text(gutenberg_book("Held Out", _body(rng, "BOOK-EVAL", 300)))
    shutil.copyfile(books / "002.txt", eval_books / "copy_of_002.txt")
    for index in range(12):
        functions = "\n".join(f"def f{index}_{j}(x):\n    return x * {j} + {index}\n" for j in range(30))
        (code / f"module_{index:02d}.py").write_text(f'"""Module {index}."""\n\n{functions}')
    return books, eval_books, code


def make_tiny_bundle(tmp_dir: Path, name: str = "tiny_bundle.tar.xz") -> Path:
    """A tiny bundle from generated books and .py files (seconds); returns the .tar.xz path."""
    books, eval_books, code = make_inputs(tmp_dir / "inputs")
    spec = BundleSpec(books=(books,), eval_books=eval_books, out=tmp_dir / name, code=(code,), vocab_size=VOCAB,
                      min_tokens=MIN_TOKENS, sample_chars=200_000, workers=1, progress=False)
    return build_bundle(spec).archive


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bundle(tmp_path_factory.mktemp("bundle"))


@pytest.fixture(scope="module")
def unpacked(bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> UnpackedBundle:
    return unpack_bundle(bundle, tmp_path_factory.mktemp("unpacked") / "bundle")


def _decoded(shards: Path, tokenizer: Path) -> str:
    tok = Tokenizer(tokenizer)
    ids = np.concatenate([IndexedDataset(str(p)[:-4]).document(k) for p in sorted(shards.glob("*.idx"))
                          for k in range(IndexedDataset(str(p)[:-4]).num_documents)])
    return tok.decode([int(i) for i in ids if i != tok.eod_id])


def _one_line_error(bundle: Path, dest: Path) -> str:
    with pytest.raises(ValueError) as error:
        unpack_bundle(bundle, dest)
    message = str(error.value)
    assert len(message.splitlines()) == 1 and str(bundle) in message, message
    assert not dest.exists() and not list(dest.parent.glob(f".{dest.name}.tmp-*"))  # nothing half-unpacked
    return message


def test_the_same_inputs_give_the_same_bytes(bundle: Path, tmp_path: Path) -> None:
    again = make_tiny_bundle(tmp_path, name="other_name.tar.xz")
    assert again.read_bytes() == bundle.read_bytes()
    sidecar = bundle.with_name(bundle.name + ".sha256").read_text()
    assert sidecar.split() == [hashlib.sha256(bundle.read_bytes()).hexdigest(), bundle.name]
    with tarfile.open(bundle, "r:xz") as tar:
        members = tar.getmembers()
    assert members[0].name == MANIFEST_NAME
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in members} == {(0, 0, 0, "", "")}


def test_unpack_verifies_and_describes_the_bundle(bundle: Path, unpacked: UnpackedBundle) -> None:
    manifest = unpacked.manifest
    tokens = manifest["tokens"]
    assert unpacked.tokens == tokens["text"] + tokens["code"] >= MIN_TOKENS
    assert tokens["code"] >= MIN_TOKENS // 4 and 3 * tokens["code"] <= tokens["text"]  # 75/25 by whole documents
    assert unpacked.vocab_size == Tokenizer(unpacked.tokenizer).vocab_size == VOCAB
    for group, shards in (("text", unpacked.text_shards), ("code", unpacked.code_shards)):
        assert sum(IndexedDataset(str(p)[:-4]).num_tokens for p in shards.glob("*.idx")) == tokens[group]
    assert sorted(p.name for p in unpacked.eval_books.glob("*.txt")) == ["copy_of_002.txt", "held_out.txt"]
    assert "START OF THIS PROJECT GUTENBERG" in (unpacked.eval_books / "held_out.txt").read_text()  # raw
    stamp = unpacked.root / ".bundle_sha256"
    before = stamp.stat().st_mtime_ns
    assert unpack_bundle(bundle, unpacked.root) == unpacked  # a second call: a no-op
    assert stamp.stat().st_mtime_ns == before


def test_a_flipped_byte_or_a_truncated_archive_is_a_one_line_error(bundle: Path, tmp_path: Path) -> None:
    """Caught by the builder's sha256 beside it; with a sha256 of the damaged bytes, by lzma and tar."""
    data = bytearray(bundle.read_bytes())
    data[len(data) // 2] ^= 0x40
    flipped = tmp_path / "flipped.tar.xz"
    flipped.write_bytes(bytes(data))
    checksum_path(flipped).write_text(checksum_path(bundle).read_text())  # as the builder wrote it
    assert _one_line_error(flipped, tmp_path / "out0") == (
        f"bundle {flipped}: its sha256 is {file_sha256(flipped)}, not {file_sha256(bundle)} "
        f"({checksum_path(flipped)}); the archive is damaged or is not the one that was built")
    write_checksum(flipped)
    assert "corrupted or truncated" in _one_line_error(flipped, tmp_path / "out1")
    truncated = tmp_path / "truncated.tar.xz"
    truncated.write_bytes(bundle.read_bytes()[: len(data) // 2])
    write_checksum(truncated)
    assert "corrupted or truncated" in _one_line_error(truncated, tmp_path / "out2")


def test_an_archive_that_is_not_the_one_built_is_refused_before_anything_is_extracted(
        bundle: Path, tmp_path: Path) -> None:
    """Another tokenizer with a self-consistent manifest: today it is unpacked and its tokenizer installed."""
    root = tmp_path / "root"
    with tarfile.open(bundle, "r:xz") as tar:
        tar.extractall(root)
    (root / TOKENIZER_NAME).write_bytes(b"not the tokenizer that was built")
    manifest = json.loads((root / MANIFEST_NAME).read_text())
    write_manifest(root, {key: value for key, value in manifest.items() if key != "files"})
    swapped = tmp_path / "swapped.tar.xz"
    write_archive(root, swapped, progress=False)
    checksum_path(swapped).write_text(checksum_path(bundle).read_text())  # the archive replaced, not its .sha256
    assert "is not the one that was built" in _one_line_error(swapped, tmp_path / "out1")
    checksum_path(swapped).unlink()
    assert _one_line_error(swapped, tmp_path / "out2") == (
        f"bundle {swapped}: no swapped.tar.xz.sha256 beside it to check the archive against; copy the one "
        "tools/build_data_bundle.py wrote, or give the archive's sha256 with --bundle-sha256 HEX")
    with pytest.raises(ValueError, match=r"^--bundle-sha256 'abc': expected a sha256, 64 hexadecimal digits$"):
        unpack_bundle(swapped, tmp_path / "out3", sha256="abc")
    with pytest.raises(ValueError, match=r"\(--bundle-sha256\); the archive is damaged"):
        unpack_bundle(swapped, tmp_path / "out4", sha256=file_sha256(bundle))
    vouched = unpack_bundle(swapped, tmp_path / "out5", sha256=file_sha256(swapped).upper())  # the user's word
    assert vouched.tokenizer.read_bytes() == b"not the tokenizer that was built"


def crafted_bundle(path: Path, members: list[tuple[str, bytes]]) -> Path:
    """A .tar.xz of ``members`` (name, bytes) in order, with its .sha256 as the builder writes it."""
    with lzma.open(path, "wb", format=lzma.FORMAT_XZ) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    write_checksum(path)
    return path


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (root only: skipped where it cannot be mounted)."""
    mount_point = tmp_path / "small_disk"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def test_declared_sizes_are_checked_before_they_are_written(tmp_path: Path, small_disk: Path) -> None:
    """Zeros compress ~7000x: 8 MiB in a ~2 KB archive; 4 MiB within an explicit limit but not the disk."""
    bomb = crafted_bundle(tmp_path / "bomb.tar.xz", [(MANIFEST_NAME, b'{"files": {}}'), ("zeros.bin", bytes(8 << 20))])
    message = _one_line_error(bomb, tmp_path / "out")
    assert message == (f"bundle {bomb}: its members declare more than {16 * bomb.stat().st_size:,} bytes (reached at "
                       f"'zeros.bin'), the most an archive of {bomb.stat().st_size:,} bytes may unpack to")
    with pytest.raises(ValueError, match=r"declare more than 10 bytes \(reached at 'bundle_manifest.json'\)"):
        unpack_bundle(bomb, tmp_path / "out", max_unpacked_bytes=10)
    large = crafted_bundle(tmp_path / "large.tar.xz", [("zeros.bin", bytes(4 << 20))])
    with pytest.raises(ValueError) as error:
        unpack_bundle(large, small_disk / "bundle", max_unpacked_bytes=1 << 30)
    assert str(error.value) == (f"bundle {large}: 'zeros.bin' declares 4,194,304 bytes, more than the 1,048,576 free "
                                f"on the file system of {small_disk}")
    assert not list(small_disk.iterdir())  # the temporary directory removed


def test_a_full_disk_during_unpacking_is_one_line(bundle: Path, tmp_path: Path, small_disk: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk fills after the free-space check (another writer): the kernel's ENOSPC, as one line."""
    members = [(MANIFEST_NAME, b'{"files": {}}')] + [(f"part{i}.bin", random.Random(i).randbytes(300_000))
                                                      for i in range(4)]
    archive = crafted_bundle(tmp_path / "incompressible.tar.xz", members)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(free=1 << 40))  # the check passes
    with pytest.raises(ValueError) as error:
        unpack_bundle(archive, small_disk / "bundle")
    assert str(error.value) == f"bundle {archive}: unpacking into {small_disk} failed: No space left on device"
    assert not list(small_disk.iterdir())


@pytest.mark.parametrize(("members", "message"), [
    ([("eval_books", b"a file"), ("eval_books/a.txt", b"a book")],
     "archive member 'eval_books/a.txt' is below 'eval_books', a file in the archive"),
    ([("eval_books/a.txt", b"a book"), ("eval_books", b"a file")],
     "archive member 'eval_books' is a file where another member has a directory"),
    ([(TOKENIZER_NAME, b"one"), (TOKENIZER_NAME, b"another")], f"archive member '{TOKENIZER_NAME}' appears twice"),
], ids=["file, then below it", "below, then the file", "twice"])
def test_members_whose_paths_clash_are_one_line(members: list[tuple[str, bytes]], message: str,
                                                tmp_path: Path) -> None:
    archive = crafted_bundle(tmp_path / "clash.tar.xz", members)
    assert _one_line_error(archive, tmp_path / "out") == f"bundle {archive}: {message}"


def test_a_file_that_does_not_match_the_manifest_is_a_one_line_error(bundle: Path, tmp_path: Path) -> None:
    """Re-packed archives, valid as .tar.xz, whose contents disagree with their manifest."""
    root = tmp_path / "root"
    with tarfile.open(bundle, "r:xz") as tar:
        tar.extractall(root)
    shard = next((root / "shards" / "code").glob("*.bin"))
    tampered = bytearray(shard.read_bytes())
    tampered[10] ^= 0x01
    shard.write_bytes(bytes(tampered))
    bad = tmp_path / "tampered.tar.xz"
    write_archive(root, bad, progress=False)
    write_checksum(bad)  # as if the sender checksummed the damaged archive: the manifest still catches it
    message = _one_line_error(bad, tmp_path / "out1")
    assert shard.relative_to(root).as_posix() in message and "sha256" in message
    shard.unlink()
    missing = tmp_path / "missing.tar.xz"
    write_archive(root, missing, progress=False)
    write_checksum(missing)
    assert "is missing" in _one_line_error(missing, tmp_path / "out2")


def test_an_unpack_of_another_bundle_is_replaced(bundle: Path, unpacked: UnpackedBundle, tmp_path: Path) -> None:
    dest = tmp_path / "bundle"
    shutil.copytree(unpacked.root, dest)
    (dest / ".bundle_sha256").write_text("0" * 64 + "\n")  # as if unpacked from another archive
    (dest / "tokenizer.model").write_bytes(b"stale")
    again = unpack_bundle(bundle, dest)
    assert again.tokenizer.read_bytes() == unpacked.tokenizer.read_bytes()


def test_a_directory_that_is_not_an_unpacked_bundle_is_never_replaced(bundle: Path, tmp_path: Path) -> None:
    dest = tmp_path / "mine"
    dest.mkdir()
    (dest / "precious.txt").write_text("keep me")
    with pytest.raises(ValueError, match=r"exists and is not an unpacked bundle"):
        unpack_bundle(bundle, dest)
    assert (dest / "precious.txt").read_text() == "keep me"


def test_a_latin1_book_is_decoded_and_stripped(tmp_path: Path, unpacked: UnpackedBundle) -> None:
    raw = gutenberg_book("Latin", f"{LATIN_LINE}\nsmart \u201cquotes\u201d", "ISO-8859-1").encode("cp1252")
    book = tmp_path / "latin.txt"
    book.write_bytes(raw)
    (record,) = read_text(SourceConfig(type="text", path=str(book)), "books")
    assert isinstance(record, BadRecord) and record.problem == NON_UTF8  # the default stays strict UTF-8
    (record,) = read_text(SourceConfig(type="text", path=str(book), encoding="auto"), "books")
    assert isinstance(record, Document) and LATIN_LINE in record.text and "smart \u201cquotes\u201d" in record.text
    assert decode_auto("undeclared \xe9t\xe9".encode("latin-1")) == "undeclared été"  # no header: cp1252
    text = _decoded(unpacked.text_shards, unpacked.tokenizer)  # in the bundle: decoded and stripped
    assert LATIN_LINE in text and "PROJECT GUTENBERG" not in text and "Character set encoding" not in text


def test_an_evaluation_book_among_the_training_books_is_excluded(unpacked: UnpackedBundle) -> None:
    (excluded,) = unpacked.manifest["excluded_from_training"]
    assert excluded == "books/002.txt = eval_books/copy_of_002.txt"
    assert "books/002.txt" not in unpacked.manifest["sources"]["books"]
    text = _decoded(unpacked.text_shards, unpacked.tokenizer)
    assert "BOOK-001" in text and "BOOK-002" not in text and "BOOK-EVAL" not in text


def test_the_shards_are_a_megatron_mix_source(unpacked: UnpackedBundle, tmp_path: Path) -> None:
    tokenizer = str(unpacked.tokenizer)
    mix = {"groups": {
        "text": {"weight": 0.75, "sources": {"books": {"type": "megatron", "path": str(unpacked.text_shards),
                                                       "tokenizer": tokenizer}}},
        "code": {"weight": 0.25, "sources": {"code": {"type": "megatron", "path": str(unpacked.code_shards),
                                                      "tokenizer": tokenizer}}}}}
    mix_path = tmp_path / "mix.yml"
    mix_path.write_text(json.dumps(mix))
    data = DataConfig(mix=str(mix_path), cache_dir=str(tmp_path / "cache"), tokenizer=TokenizerConfig(model=tokenizer))
    manifest = prepare_data(data, unpacked.vocab_size, workers=1, progress=False)
    assert manifest.sources["books"].tokens == unpacked.manifest["tokens"]["text"]
    assert manifest.sources["code"].tokens == unpacked.manifest["tokens"]["code"]


def test_the_command_prints_tokens_size_and_what_travels(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    books, eval_books, code = make_inputs(tmp_path / "inputs")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "x-1.0-py3-none-any.whl").write_bytes(b"0" * 1000)
    out = tmp_path / "out" / "b.tar.xz"
    common = ["--books", str(books), "--eval-books", str(eval_books), "--code", str(code), "--out", str(out),
              "--vocab-size", str(VOCAB), "--sample-chars", "200000", "--workers", "1", "--no-progress"]
    script = load_script("tools/build_data_bundle.py")
    assert script.main([*common, "--min-tokens", str(MIN_TOKENS), "--wheels", str(wheels)]) == 0
    printed = capsys.readouterr().out
    assert "tokens: text" in printed and "unpack + verify" in printed and "64 MiB limit" in printed
    assert "wheels 0.00 MiB" in printed and out.is_file() and out.with_name("b.tar.xz.sha256").is_file()
    assert script.main([*common, "--min-tokens", "10000000"]) == 2  # more than the inputs hold
    err = capsys.readouterr().err
    assert err.startswith("error: --") and len(err.strip().splitlines()) == 1, err


def test_lzma_filters_suit_16_bit_tokens() -> None:
    """The archive's LZMA2 settings decode with the standard library alone (what the node has)."""
    from megatron_lite.repro.bundle import LZMA_FILTERS

    payload = np.arange(5000, dtype=np.uint16).tobytes()
    packed = lzma.compress(payload, format=lzma.FORMAT_XZ, filters=LZMA_FILTERS)
    assert lzma.decompress(packed) == payload
