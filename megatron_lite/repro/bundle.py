"""The speedrun's data bundle: tokenizer + pre-tokenised MMIDIDX shards + held-out books, one .tar.xz.

Built by tools/build_data_bundle.py from Gutenberg books (75% of the tokens) and Python sources (25%)
through the ordinary pipeline (a staged mix -> ``prepare_data``), then cut to whole documents so that
text = 3 x code and the total reaches ``min_tokens``. The archive is reproducible: entries sorted,
mtime 0, uid/gid 0, no user names, one lzma stream with fixed filters (the standard library's lzma,
single-threaded, is deterministic); SentencePiece training is deterministic for a fixed input.

Layout inside the archive (and of an unpacked bundle)::

    bundle_manifest.json        tokens per group, vocab, sources, sha256 + bytes of every other file
    tokenizer.model
    shards/text/gutenberg_text_document.{bin,idx}
    shards/code/python_code_text_document.{bin,idx}
    eval_books/*.txt            held-out books, raw (headers kept)

``unpack_bundle`` first checks the archive's sha256 against the one its builder wrote (``BUNDLE.sha256``
beside it, or one given, e.g. ``tools/reproduce.py --bundle-sha256``): nothing is extracted from an archive
that is not the one built. It then extracts into a temporary directory beside ``dest``, refusing members
that declare more bytes than the disk has free or than ``MAX_UNPACK_RATIO`` times the archive, verifies
every file against the manifest, records the archive's sha256 in ``dest/.bundle_sha256`` and renames the
directory into place; a later call with the same archive is a cheap no-op. Every failure is one
``ValueError`` line naming the bundle, and the temporary directory is removed.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import math
import os
import re
import shutil
import tarfile
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from megatron_lite.config.loading import short_repr
from megatron_lite.files import file_sha256, write_bytes_atomic, write_text_atomic

BUNDLE_VERSION = 1
MANIFEST_NAME = "bundle_manifest.json"
TOKENIZER_NAME = "tokenizer.model"
TEXT_SHARDS, CODE_SHARDS, EVAL_BOOKS = "shards/text", "shards/code", "eval_books"
UNPACKED_STAMP = ".bundle_sha256"  # in an unpacked bundle: the sha256 of the archive it came from
CHECKSUM_SUFFIX = ".sha256"  # BUNDLE.sha256 beside the archive: 'HEX  NAME' (sha256sum format)
SHA256_FORMAT = re.compile(r"[0-9a-fA-F]{64}")
# Declared unpacked bytes at most this many times the archive's: uint16 token shards compress ~2.4x (the
# real bundle: 24.2 MiB -> 57.5 MiB), the tiny test bundle ~4.5x; a zero-filled member ~7000x.
MAX_UNPACK_RATIO = 16
TOKENIZER_THREADS = 2  # SentencePiece training threads (recorded in the model, so fixed)
TEXT_SHARE = 0.75  # of the bundle's tokens: text = 3 x code
# LZMA2 at preset 9e (64 MiB dictionary) with lp=1, pb=1: literal and match positions aligned to the 2-byte
# tokens. On the real uint16 shards this is ~0.5% smaller than 9e's defaults (lc=3, lp=0, pb=2) and lc=0;
# measurements in the build docs.
LZMA_FILTERS: list[dict[str, Any]] = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME, "lp": 1, "pb": 1}]


@dataclass(frozen=True)
class UnpackedBundle:
    root: Path
    tokenizer: Path
    text_shards: Path
    code_shards: Path
    eval_books: Path
    manifest: dict[str, Any] = field(repr=False)

    @property
    def tokens(self) -> int:
        return int(self.manifest["tokens"]["total"])

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["vocab_size"])


def _unpacked(root: Path, manifest: dict[str, Any]) -> UnpackedBundle:
    return UnpackedBundle(root=root, tokenizer=root / TOKENIZER_NAME, text_shards=root / TEXT_SHARDS,
                          code_shards=root / CODE_SHARDS, eval_books=root / EVAL_BOOKS, manifest=manifest)


def unpacked_at(root: Path) -> UnpackedBundle | None:
    """The bundle already unpacked at ``root`` as its manifest describes it (not verified), or None."""
    path = root / MANIFEST_NAME
    return _unpacked(root, json.loads(path.read_text())) if path.is_file() else None


# ----------------------------------------------------------------------------------------------
# Writing the archive


def _tar_info(name: str, size: int, directory: bool = False) -> tarfile.TarInfo:
    """A header that depends on the name and size only (no mtime, owner or umask)."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.uid, info.gid, info.uname, info.gname = size, 0, 0, 0, "", ""
    info.type, info.mode = (tarfile.DIRTYPE, 0o755) if directory else (tarfile.REGTYPE, 0o644)
    if directory:
        info.size = 0
    return info


def write_archive(root: Path, out: Path, filters: list[dict[str, Any]] | None = None, progress: bool = True) -> None:
    """``root``'s files as a reproducible .tar.xz at ``out`` (atomically): the manifest first, then sorted."""
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    files.sort(key=lambda name: name != MANIFEST_NAME)
    total = sum((root / name).stat().st_size for name in files)
    temporary = out.with_name(f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with lzma.open(temporary, "wb", format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64,
                       filters=filters or LZMA_FILTERS) as xz, \
                tarfile.open(fileobj=xz, mode="w", format=tarfile.USTAR_FORMAT) as tar, \
                tqdm(total=total, desc="compress", unit="B", unit_scale=True, disable=not progress,
                     dynamic_ncols=True) as bar:
            for name in files:
                path = root / name
                with path.open("rb") as handle:
                    tar.addfile(_tar_info(name, path.stat().st_size), handle)
                bar.update(path.stat().st_size)
        os.replace(temporary, out)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def checksum_path(archive: Path) -> Path:
    return archive.with_name(archive.name + CHECKSUM_SUFFIX)


def write_checksum(archive: Path) -> str:
    """``ARCHIVE.sha256`` in sha256sum format; returns the digest."""
    digest = file_sha256(archive)
    write_text_atomic(checksum_path(archive), f"{digest}  {archive.name}\n")
    return digest


def file_entries(root: Path) -> dict[str, dict[str, Any]]:
    """Every file below ``root`` but the manifest: relative path -> bytes + sha256."""
    return {p.relative_to(root).as_posix(): {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != MANIFEST_NAME}


def write_manifest(root: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    manifest = {**manifest, "version": BUNDLE_VERSION, "files": file_entries(root)}
    write_bytes_atomic(root / MANIFEST_NAME, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
    return manifest


# ----------------------------------------------------------------------------------------------
# Unpacking


def parse_sha256(text: str, what: str) -> str:
    """A sha256 as 64 hexadecimal digits, lower-cased; ValueError naming ``what`` otherwise."""
    if not SHA256_FORMAT.fullmatch(text.strip()):
        raise ValueError(f"{what} {short_repr(text)}: expected a sha256, 64 hexadecimal digits")
    return text.strip().lower()


def expected_sha256(bundle: Path, given: str | None) -> tuple[str, str]:
    """(the sha256 the archive must have, where it comes from): ``given`` (``--bundle-sha256``), else the
    first field of ``BUNDLE.sha256``, as tools/build_data_bundle.py writes it. A bundle installs a tokenizer
    and shards, so one with neither is refused rather than trusted."""
    if given is not None:
        return parse_sha256(given, "--bundle-sha256"), "--bundle-sha256"
    sidecar = checksum_path(bundle)
    if not sidecar.is_file():
        raise ValueError(f"bundle {bundle}: no {sidecar.name} beside it to check the archive against; copy the "
                         "one tools/build_data_bundle.py wrote, or give the archive's sha256 with --bundle-sha256 HEX")
    with sidecar.open("rb") as handle:
        fields = handle.read(4096).decode(errors="replace").split()
    return parse_sha256(fields[0] if fields else "", f"bundle {bundle}: {sidecar} holds"), str(sidecar)


def _members(bundle: Path, tar: tarfile.TarFile) -> Iterator[tuple[tarfile.TarInfo, str]]:
    """Regular files with safe relative names (no absolute paths, no '..', no links or devices)."""
    for info in tar:
        name = info.name
        parts = Path(name).parts
        if info.isdir():
            continue
        if not info.isfile() or name.startswith("/") or ".." in parts or not parts:
            raise ValueError(f"bundle {bundle}: unexpected archive member {short_repr(name)} (not a plain relative "
                             "file)")
        yield info, name


def _check_room(bundle: Path, target: Path, info: tarfile.TarInfo, declared: int, max_bytes: int) -> None:
    """Before a member is written: the bytes declared so far within ``max_bytes``, and the member's within
    the free space of ``target``'s file system."""
    if declared > max_bytes:
        raise ValueError(f"bundle {bundle}: its members declare more than {max_bytes:,} bytes (reached at "
                         f"{short_repr(info.name)}), the most an archive of {bundle.stat().st_size:,} bytes may "
                         "unpack to")
    free = shutil.disk_usage(target).free
    if info.size > free:
        raise ValueError(f"bundle {bundle}: {short_repr(info.name)} declares {info.size:,} bytes, more than the "
                         f"{free:,} free on the file system of {target.parent}")


def _check_path(bundle: Path, target: Path, name: str, seen: set[str]) -> None:
    """A member's path is new and does not clash with another member's: a file where a directory must go
    (or the other way round) would otherwise be a FileExistsError or IsADirectoryError."""
    shown = short_repr(name)
    if name in seen:
        raise ValueError(f"bundle {bundle}: archive member {shown} appears twice")
    seen.add(name)
    path = target / name
    if path.is_dir():
        raise ValueError(f"bundle {bundle}: archive member {shown} is a file where another member has a directory")
    for parent in path.relative_to(target).parents:
        if (target / parent).is_file():
            raise ValueError(f"bundle {bundle}: archive member {shown} is below {short_repr(parent.as_posix())}, "
                             "a file in the archive")


def _extract(bundle: Path, target: Path, max_bytes: int) -> None:
    declared = 0
    seen: set[str] = set()
    try:
        with tarfile.open(bundle, mode="r:xz") as tar:
            for info, name in _members(bundle, tar):
                declared += info.size
                _check_room(bundle, target, info, declared, max_bytes)
                _check_path(bundle, target, name, seen)
                path = target / name
                path.parent.mkdir(parents=True, exist_ok=True)
                source = tar.extractfile(info)
                assert source is not None
                with source, path.open("wb") as handle:
                    shutil.copyfileobj(source, handle, 1 << 20)
    except (lzma.LZMAError, tarfile.TarError, EOFError) as error:
        detail = " ".join(str(error).split()) or type(error).__name__
        raise ValueError(f"bundle {bundle}: corrupted or truncated archive ({detail})") from None
    except OSError as error:  # a full disk, a file system's limit, permissions
        raise ValueError(f"bundle {bundle}: unpacking into {target.parent} failed: {error.strerror or error}") from None


def _read_manifest(bundle: Path, root: Path) -> dict[str, Any]:
    path = root / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"bundle {bundle}: {MANIFEST_NAME} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"bundle {bundle}: {MANIFEST_NAME} is unreadable ({error})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ValueError(f"bundle {bundle}: {MANIFEST_NAME} has no files table")
    return manifest


def verify_files(bundle: Path, root: Path, manifest: dict[str, Any]) -> None:
    """Every manifest file present with its size and sha256, and no file the manifest does not list."""
    listed: dict[str, dict[str, Any]] = manifest["files"]
    for name, entry in listed.items():
        path = root / name
        if not path.is_file():
            raise ValueError(f"bundle {bundle}: {name} is missing")
        if path.stat().st_size != entry["bytes"] or file_sha256(path) != entry["sha256"]:
            raise ValueError(f"bundle {bundle}: {name} does not match its sha256 in {MANIFEST_NAME} (corrupted)")
    extra = sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                   if p.is_file() and p.name not in (MANIFEST_NAME, UNPACKED_STAMP)
                   and p.relative_to(root).as_posix() not in listed)
    if extra:
        raise ValueError(f"bundle {bundle}: {extra[0]} is not in {MANIFEST_NAME} ({len(extra)} unlisted file(s))")


def unpack_bundle(bundle: Path, dest: Path, sha256: str | None = None,
                  max_unpacked_bytes: int | None = None) -> UnpackedBundle:
    """``bundle`` unpacked and verified at ``dest``; a cheap no-op when ``dest`` already holds it. The
    archive must have the sha256 ``sha256`` or, without it, the one in ``BUNDLE.sha256``; its members may
    declare at most ``max_unpacked_bytes`` (default: ``MAX_UNPACK_RATIO`` x the archive's size)."""
    bundle, dest = Path(bundle), Path(dest)
    if not bundle.is_file():
        raise ValueError(f"bundle {bundle}: no such file")
    expected, source = expected_sha256(bundle, sha256)
    digest = file_sha256(bundle)
    if digest != expected:
        raise ValueError(f"bundle {bundle}: its sha256 is {digest}, not {expected} ({source}); the archive is "
                         "damaged or is not the one that was built")
    if max_unpacked_bytes is None:
        max_unpacked_bytes = MAX_UNPACK_RATIO * bundle.stat().st_size
    stamp = dest / UNPACKED_STAMP
    if stamp.is_file() and stamp.read_text().strip() == digest:
        manifest = _read_manifest(bundle, dest)
        if all((dest / name).is_file() and (dest / name).stat().st_size == entry["bytes"]
               for name, entry in manifest["files"].items()):
            return _unpacked(dest, manifest)
    if dest.exists() and not stamp.is_file() and (not dest.is_dir() or any(dest.iterdir())):
        # only an earlier unpack (stamped) is ever replaced: a mistyped destination must not lose its files
        raise ValueError(f"bundle {bundle}: {dest} exists and is not an unpacked bundle (no {UNPACKED_STAMP}); "
                         "give an empty or new directory")
    temporary = dest.with_name(f".{dest.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        temporary.mkdir()
        _extract(bundle, temporary, max_unpacked_bytes)
        manifest = _read_manifest(bundle, temporary)
        verify_files(bundle, temporary, manifest)
        (temporary / UNPACKED_STAMP).write_text(digest + "\n")
        if dest.exists():  # an older or damaged unpack: replaced whole
            old = dest.with_name(f".{dest.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            os.replace(dest, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(temporary, dest)
    except OSError as error:  # outside the extraction: creating, stamping or renaming the directories
        raise ValueError(f"bundle {bundle}: unpacking into {dest} failed: {error.strerror or error}") from None
    finally:
        if temporary.exists():
            shutil.rmtree(temporary, ignore_errors=True)
    return _unpacked(dest, manifest)


def timed_unpack(bundle: Path, dest: Path) -> tuple[UnpackedBundle, float]:
    start = time.perf_counter()
    unpacked = unpack_bundle(bundle, dest)
    return unpacked, time.perf_counter() - start


# ----------------------------------------------------------------------------------------------
# Building


@dataclass(frozen=True)
class BundleSpec:
    """What tools/build_data_bundle.py asks for (one flag each)."""

    books: tuple[Path, ...]  # directories of Gutenberg .txt books (raw, headers kept)
    eval_books: Path  # held-out books shipped as text; never trained on
    out: Path  # BUNDLE.tar.xz
    code: tuple[Path, ...]  # directories of .py files (default: stdlib + site-packages)
    vocab_size: int = 16_000
    min_tokens: int = 30_000_000
    sample_chars: int = 10_000_000  # tokenizer training sample (75/25 like the bundle)
    workers: int = 2
    work_dir: Path | None = None  # staging + data cache (default: a temporary directory, removed)
    filters: tuple[dict[str, Any], ...] = tuple(LZMA_FILTERS)
    progress: bool = True


@dataclass(frozen=True)
class BuildResult:
    archive: Path
    sha256: str
    bytes: int
    manifest: dict[str, Any]
    excluded: tuple[str, ...]  # training books left out because an evaluation book has their content
    seconds: float


def default_code_dirs() -> tuple[Path, ...]:
    """The standard library and the installed packages' directories (site-packages), deduplicated."""
    import sysconfig

    paths = sysconfig.get_paths()
    found: dict[Path, Path] = {}
    for key in ("stdlib", "purelib", "platlib"):
        path = Path(paths[key])
        if path.is_dir():
            found.setdefault(path.resolve(), path)
    return tuple(found.values())


# Bytes staged per wanted token: generous (books run ~3.8 chars/token, code ~3.6 at 16K pieces), so
# the whole-document cut almost never runs short; what is staged beyond the cut is tokenised, not shipped.
STAGE_CHARS_PER_TOKEN = {"text": 5.0, "code": 5.0}


def _book_files(directories: tuple[Path, ...], flag: str) -> list[Path]:
    files: list[Path] = []
    for directory in directories:
        if not directory.is_dir():
            raise ValueError(f"{flag} {directory}: no such directory")
        found = sorted(p for p in directory.rglob("*.txt") if p.is_file())
        if not found:
            raise ValueError(f"{flag} {directory}: no .txt books in it")
        files.extend(found)
    return files


def _content_digest(raw: bytes) -> str:
    """The book's text as training sees it (decoded, newlines normalised, Gutenberg header stripped)."""
    from megatron_lite.data.cleaning import normalize_newlines, strip_gutenberg
    from megatron_lite.data.sources import decode_auto

    return hashlib.sha256(strip_gutenberg(normalize_newlines(decode_auto(raw)))[0].encode()).hexdigest()


def held_out_books(books: list[Path], eval_files: list[Path], progress: bool) -> tuple[list[Path], list[str]]:
    """Training books minus any whose content (raw bytes, or the text after decoding and stripping) is an
    evaluation book's; the excluded ones as 'training = eval' strings."""
    eval_digests: dict[str, Path] = {}
    for path in eval_files:
        raw = path.read_bytes()
        eval_digests[hashlib.sha256(raw).hexdigest()] = path
        eval_digests[_content_digest(raw)] = path
    kept, excluded = [], []
    for path in tqdm(books, desc="overlap check", unit="book", disable=not progress, dynamic_ncols=True):
        raw = path.read_bytes()
        match = eval_digests.get(hashlib.sha256(raw).hexdigest()) or eval_digests.get(_content_digest(raw))
        if match is None:
            kept.append(path)
        else:
            excluded.append(f"{path} = {match}")
    return kept, excluded


def _stage(files: list[Path], directory: Path, budget_chars: float, suffix: str) -> list[Path]:
    """Symlinks to the first ``files`` (in order) up to ``budget_chars`` bytes, named so sorting keeps the order."""
    directory.mkdir(parents=True)
    staged, size = [], 0
    for index, path in enumerate(files):
        if size >= budget_chars:
            break
        (directory / f"{index:06d}{suffix}").symlink_to(path.resolve())
        staged.append(path)
        size += path.stat().st_size
    return staged


def _mix_document(stage: Path) -> dict[str, Any]:
    return {"description": "data bundle staging (tools/build_data_bundle.py)", "groups": {
        "text": {"weight": TEXT_SHARE, "sources": {"books": {
            "type": "text", "path": str(stage / "text"), "strip_gutenberg": True, "encoding": "auto"}}},
        "code": {"weight": 1 - TEXT_SHARE, "sources": {"code": {"type": "python_code", "path": str(stage / "code")}}},
    }}


def _cut(prefixes: list[Path], target: int, out_prefix: Path, dtype: Any) -> tuple[int, int, int]:
    """Whole documents, in order, until ``target`` tokens: (documents, tokens, documents available)."""
    from megatron_lite.data.indexed import IndexedDataset, IndexedDatasetWriter

    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    documents = tokens = available = 0
    with IndexedDatasetWriter(out_prefix, dtype) as writer:
        for prefix in prefixes:
            shard = IndexedDataset(prefix)
            available += shard.num_documents
            for k in range(shard.num_documents):
                if tokens >= target:
                    break
                document = shard.document(k)
                writer.add_document(document)
                documents, tokens = documents + 1, tokens + int(document.size)
    return documents, tokens, available


def _relative_name(path: Path, roots: tuple[Path, ...]) -> str:
    for root in roots:
        if path.is_relative_to(root):
            return f"{root.name}/{path.relative_to(root).as_posix()}"
    return str(path)


def _book_listing(staged: list[Path], documents: int, dropped: bool, roots: tuple[Path, ...]) -> dict[str, Any]:
    """The books in the bundle: exactly the first ``documents`` staged ones when cleaning dropped none,
    else every staged book (the bundle holds the first ``documents`` of them that cleaning kept)."""
    names = [_relative_name(path, roots) for path in staged]
    return {"books_staged": names} if dropped else {"books": names[:documents]}


def _code_files(directories: tuple[Path, ...]) -> list[Path]:
    from megatron_lite.data.sample_corpus import python_files

    files: list[Path] = []
    seen: set[Path] = set()
    for directory in directories:
        if not directory.is_dir():
            raise ValueError(f"--code {directory}: no such directory")
        for path in python_files(directory):  # sorted; tests and nested site-packages left out
            if path.resolve() not in seen:
                seen.add(path.resolve())
                files.append(path)
    if not files:
        raise ValueError(f"--code {' '.join(map(str, directories))}: no .py files")
    return files


def build_bundle(spec: BundleSpec) -> BuildResult:
    """Stage the inputs, tokenise them with prepare_data, cut 75/25 by whole documents, pack and checksum."""
    from megatron_lite.config import DataConfig, TokenizerConfig
    from megatron_lite.data.indexed import dtype_for_vocab
    from megatron_lite.data.preprocess import prepare_data

    start = time.perf_counter()
    if spec.min_tokens < 4:
        raise ValueError(f"--min-tokens {spec.min_tokens}: must be >= 4")
    if not spec.eval_books.is_dir():
        raise ValueError(f"--eval-books {spec.eval_books}: no such directory")
    eval_files = _book_files((spec.eval_books,), "--eval-books")
    books, excluded = held_out_books(_book_files(spec.books, "--books"), eval_files, spec.progress)
    code_files = _code_files(spec.code)
    code_target = math.ceil(spec.min_tokens * (1 - TEXT_SHARE))
    text_target = math.ceil(code_target * TEXT_SHARE / (1 - TEXT_SHARE))
    spec.out.parent.mkdir(parents=True, exist_ok=True)
    temporary = spec.work_dir is None
    work = Path(tempfile.mkdtemp(prefix=f".{spec.out.name}.work-", dir=spec.out.parent)) if temporary \
        else spec.work_dir
    assert work is not None
    try:
        stage, root = work / "stage", work / "bundle"
        shutil.rmtree(stage, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
        staged_books = _stage(books, stage / "text", text_target * STAGE_CHARS_PER_TOKEN["text"], ".txt")
        staged_code = _stage(code_files, stage / "code", code_target * STAGE_CHARS_PER_TOKEN["code"], ".py")
        mix_path = work / "mix.yml"
        mix_path.write_text(json.dumps(_mix_document(stage), indent=1) + "\n")  # JSON is YAML
        # data.num_workers is the tokenizer trainer's thread count, which the .model records (trainer_spec):
        # fixed, so --workers (the tokenising processes) does not change the bytes.
        data = DataConfig(mix=str(mix_path), cache_dir=str(work / "cache"), num_workers=TOKENIZER_THREADS,
                          tokenizer=TokenizerConfig(sample_chars=spec.sample_chars))
        prepared = prepare_data(data, spec.vocab_size, workers=spec.workers, progress=spec.progress,
                                documents_per_shard=1 << 40)
        cache = Path(data.cache_dir)
        dtype = dtype_for_vocab(prepared.tokenizer.vocab_size)
        code_docs, code_tokens, _ = _cut(prepared.shard_prefixes(cache, "code"), code_target,
                                         root / CODE_SHARDS / "python_code_text_document", dtype)
        if code_tokens < code_target:
            raise ValueError(f"--code: only {code_tokens:,} code tokens in {len(staged_code):,} files, fewer than the "
                             f"{code_target:,} (25% of --min-tokens {spec.min_tokens:,}) needed; add --code directories")
        text_target = code_tokens * 3
        text_docs, text_tokens, _ = _cut(prepared.shard_prefixes(cache, "books"), text_target,
                                         root / TEXT_SHARDS / "gutenberg_text_document", dtype)
        if text_tokens < text_target:
            raise ValueError(f"--books: only {text_tokens:,} text tokens in {len(staged_books):,} books, fewer than "
                             f"the {text_target:,} (3 x the code tokens) needed; add --books directories")
        shutil.copyfile(cache / "tokenizer" / "tokenizer.model", root / TOKENIZER_NAME)
        (root / EVAL_BOOKS).mkdir(parents=True)
        for path in eval_files:
            shutil.copyfile(path, root / EVAL_BOOKS / path.name)
        roots = tuple(spec.books) + tuple(spec.code)
        skipped = {name: record.skipped for name, record in prepared.sources.items()}
        manifest = write_manifest(root, {
            "tokens": {"text": text_tokens, "code": code_tokens, "total": text_tokens + code_tokens},
            "documents": {"text": text_docs, "code": code_docs},
            "text_share": round(text_tokens / (text_tokens + code_tokens), 4),
            "vocab_size": prepared.tokenizer.vocab_size, "dtype": dtype.name, "eod_id": prepared.tokenizer.eod_id,
            "min_tokens": spec.min_tokens, "tokenizer_sample_chars": spec.sample_chars,
            "sources": {
                **_book_listing(staged_books, text_docs, bool(skipped["books"]), roots),
                "code_dirs": [p.name for p in spec.code], "code_files_staged": len(staged_code),
                "order": "each group keeps its first documents, staged files in sorted order, minus the files "
                         "cleaning skipped (counted in skipped)",
                "skipped": skipped,
            },
            "eval_books": [p.name for p in eval_files],
            "excluded_from_training": [" = ".join(_relative_name(Path(p), roots + (spec.eval_books,))
                                                  for p in pair.split(" = ")) for pair in excluded],
            "lzma_filters": [{k: int(v) for k, v in f.items()} for f in spec.filters],
        })
        write_archive(root, spec.out, list(spec.filters), spec.progress)
        digest = write_checksum(spec.out)
    finally:
        if temporary:
            shutil.rmtree(work, ignore_errors=True)
    return BuildResult(archive=spec.out, sha256=digest, bytes=spec.out.stat().st_size, manifest=manifest,
                       excluded=tuple(excluded), seconds=time.perf_counter() - start)
