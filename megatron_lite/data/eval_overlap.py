"""Evaluation text kept out of training: the evaluation books are fingerprinted, every training document is
checked against them while the data is built, and a document that overlaps one is dropped (and counted).

Text is compared after normalisation: lower case, UTF-8 bytes of letters and digits only (a-z, 0-9 and
non-ASCII letters; whitespace, punctuation, quotes and dashes removed), so line ends, re-wrapped lines,
straight or curly quotes and a Project Gutenberg edition's formatting do not hide a copy. Every 64-byte
window of that stream (about 13 words) is hashed; a window is *sampled* when its hash falls in the lowest
1/32 of the range, which picks the same windows in any text that holds them (no alignment needed). An
evaluation text's fingerprint is the set of its sampled hashes (its Gutenberg header and licence stripped:
they are shared by every Gutenberg book). A training document *overlaps* an evaluation text when the distinct
sampled hashes they share are at least :data:`MIN_SHARED` and at least :data:`OVERLAP_FRACTION` of the
smaller of the two: a copy of the book (with any header, any line ends), a book inside a larger document, or
a document that is mostly an excerpt. A short quotation in a long document is kept.

Per document the cost is linear in its length (numpy over its bytes) plus a binary search per sampled window
in the sorted evaluation hashes; docs/data.md gives the measured throughput.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatron_lite.config import SourceConfig
from megatron_lite.data.book_specs import SAMPLE_BOOKS, looks_local, text_source
from megatron_lite.data.cleaning import OVERLAPS_EVALUATION, Cleaner
from megatron_lite.data.manifest import EvaluationRecord, Manifest
from megatron_lite.data.records import Document
from megatron_lite.data.sources import input_fingerprint, read_source

WINDOW_BYTES = 64  # a power of two: the window hash is built by doubling
SAMPLE_BITS = 5  # 1 window in 2**5 = 32 is sampled
MIN_SHARED = 8  # sampled windows (~250 normalised characters at least) before a document can count as a copy
OVERLAP_FRACTION = 0.5
METHOD = {"window_bytes": WINDOW_BYTES, "sample_bits": SAMPLE_BITS, "min_shared": MIN_SHARED,
          "overlap_fraction": OVERLAP_FRACTION, "version": 1}
SETTING = "data.eval_texts"
DEFAULT_SPEC = "data/eval"  # the default: the shipped PG-19 test books

_PRIME = np.uint64(1099511628211)  # the polynomial hash's base (odd; FNV's 64-bit prime)
# ASCII bytes that are not letters or digits (upper case is gone after str.lower); removed by bytes.translate
_NOT_ALNUM = bytes(c for c in range(128) if not (ord("a") <= c <= ord("z") or ord("0") <= c <= ord("9")))
# U+0080-U+00BF (no-break space, guillemets, ...) and U+2000-U+207F (curly quotes, dashes, ellipsis) in UTF-8
_UNICODE_PUNCTUATION = re.compile(rb"\xc2[\x80-\xbf]|\xe2[\x80\x81][\x80-\xbf]")


def normalized_bytes(text: str) -> np.ndarray:
    """(n,) uint8: the lower-cased UTF-8 bytes of ``text``'s letters and digits (non-ASCII letters kept)."""
    data = text.lower().encode("utf-8", "surrogatepass").translate(None, _NOT_ALNUM)
    if not data.isascii():
        data = _UNICODE_PUNCTUATION.sub(b"", data)
    return np.frombuffer(data, dtype=np.uint8)


def sampled_hashes(text: str) -> np.ndarray:
    """(k,) uint64, sorted and distinct: the hashes of the sampled 64-byte windows of ``text`` normalised.
    (32-bit hashes measured 1.4x faster but collided ~40x more often than chance on real books.)"""
    hashes = normalized_bytes(text).astype(np.uint64)
    power, width = _PRIME, 1
    with np.errstate(over="ignore"):  # arithmetic modulo 2**64 is the point
        while width < WINDOW_BYTES:  # hash(window of 2w at i) = hash(w at i) * PRIME**w + hash(w at i + w)
            if len(hashes) <= width:
                return np.empty(0, dtype=np.uint64)
            hashes = hashes[:-width] * power + hashes[width:]
            power, width = power * power, width * 2
        hashes ^= hashes >> np.uint64(31)  # mix (splitmix64's finaliser), so the top bits depend on every byte
        hashes *= np.uint64(0xBF58476D1CE4E5B9)
        hashes ^= hashes >> np.uint64(29)
    return np.unique(hashes[hashes >> np.uint64(64 - SAMPLE_BITS) == 0])


@dataclass
class EvalFingerprint:
    """The sampled hashes of the evaluation texts; ``match(text)`` names the one a training document overlaps."""

    names: list[str] = field(default_factory=list)
    hashes: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.uint64))  # (H,) sorted, distinct
    owners: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))  # (H,) index into names
    sizes: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))  # (texts,) sampled hashes each

    @classmethod
    def of_texts(cls, named_texts: list[tuple[str, str]]) -> EvalFingerprint:
        per_text = [sampled_hashes(text) for _, text in named_texts]
        if not per_text:
            return cls()
        hashes = np.concatenate(per_text)
        owners = np.repeat(np.arange(len(per_text)), [len(h) for h in per_text])
        hashes, first = np.unique(hashes, return_index=True)  # a window in two texts belongs to the first
        return cls([name for name, _ in named_texts], hashes, owners[first],
                   np.array([len(h) for h in per_text], dtype=np.int64))

    def digest(self) -> str:
        """The content, not the names: the same books under another path (a moved checkout) need no re-check."""
        return hashlib.sha256(json.dumps(METHOD).encode() + self.hashes.tobytes() + self.sizes.tobytes()).hexdigest()

    def match(self, text: str) -> str | None:
        """The name of the evaluation text ``text`` overlaps, or None."""
        if not len(self.hashes):
            return None
        document = sampled_hashes(text)
        if len(document) < MIN_SHARED:
            return None
        where = np.minimum(np.searchsorted(self.hashes, document), len(self.hashes) - 1)
        shared = np.bincount(self.owners[where[self.hashes[where] == document]], minlength=len(self.names))
        needed = np.maximum(MIN_SHARED, OVERLAP_FRACTION * np.minimum(self.sizes, len(document)))
        overlapping = np.flatnonzero(shared >= needed)
        return self.names[int(overlapping[np.argmax(shared[overlapping])])] if len(overlapping) else None


def _read_texts(spec: str) -> list[tuple[str, str]]:
    """(location, text) of every document of a book spec, newlines normalised, Gutenberg header stripped."""
    return _read_source(text_source(spec, SETTING, strip_gutenberg=True))


def _read_source(source: SourceConfig) -> list[tuple[str, str]]:
    cleaner = Cleaner(source)
    texts = []
    for record in read_source(source, SETTING):
        if isinstance(record, Document) and (text := cleaner(record.text, record.location)) is not None:
            texts.append((record.location, text))
    return texts


class EvaluationCheck:
    """The evaluation texts of ``data.eval_texts``. Local ones are read at once (their content is the cache key,
    so editing or adding a book re-checks the sources; touching a file does not); ``datasets`` ids are keyed by
    their id and read only when a source is built. A local path that does not exist is recorded as missing."""

    def __init__(self, specs: list[str]) -> None:
        self.specs = list(specs)
        self.missing: list[str] = []
        local: list[str] = []
        self._hub: list[str] = []
        for index, spec in enumerate(self.specs):
            if not spec.strip():
                raise ValueError(f"{SETTING}[{index}] is empty: name a directory of .txt books, a file or a datasets id")
            if spec == DEFAULT_SPEC and not Path(spec).exists() and SAMPLE_BOOKS.is_dir():
                spec = str(SAMPLE_BOOKS)  # the shipped books from any working directory (a repository checkout)
            if (spec == DEFAULT_SPEC or looks_local(spec)) and not Path(spec).exists():
                self.missing.append(spec)
            elif looks_local(spec):
                local.append(spec)
            else:
                self._hub.append(spec)
        self._local, local_fingerprint = _local_fingerprint(local)
        self.key = hashlib.sha256(json.dumps([METHOD, local_fingerprint.digest(), self._hub]).encode()).hexdigest()
        self._fingerprint: EvalFingerprint | None = None if self._hub else local_fingerprint

    def fingerprint(self) -> EvalFingerprint:
        """All evaluation texts fingerprinted (datasets ids read now, once)."""
        if self._fingerprint is None:
            self._fingerprint = EvalFingerprint.of_texts(
                self._local + [text for spec in self._hub for text in _read_hub_texts(spec)])
        return self._fingerprint

    def record(self, previous: EvaluationRecord | None) -> EvaluationRecord:
        """What the manifest keeps: ``previous`` when it was made for the same texts (no datasets id read again).
        A datasets id no built source needed (a mix of Megatron shards, which are not checked) is named by its id,
        not read: such a cache builds offline."""
        if previous is not None and previous.key == self.key:
            return previous
        read = self._fingerprint is not None
        names = self._fingerprint.names if read else [name for name, _ in self._local] + self._hub
        return EvaluationRecord(key=self.key, specs=self.specs, texts=names, missing=self.missing)


def _read_hub_texts(spec: str) -> list[tuple[str, str]]:
    try:
        return _read_texts(spec)
    except OSError as error:  # offline, or no such dataset
        raise ValueError(f"{SETTING}: {spec!r} is a datasets id and could not be read from the Hugging Face hub "
                         f"({error}); give a local copy of it, or leave it out (--set 'data.eval_texts=[data/eval]') "
                         "and check against the others") from error


_LOCAL_FINGERPRINTS: dict[tuple[str, ...], tuple[list[tuple[str, str]], EvalFingerprint]] = {}


def _local_fingerprint(specs: list[str]) -> tuple[list[tuple[str, str]], EvalFingerprint]:
    """The texts and fingerprint of local book specs, remembered per process while their files are unchanged
    (sizes and mtimes): a process that prepares data many times reads the books once."""
    sources = [text_source(spec, SETTING, strip_gutenberg=True) for spec in specs]
    key = tuple(specs) + tuple(input_fingerprint(source, SETTING) for source in sources)
    if key not in _LOCAL_FINGERPRINTS:
        if len(_LOCAL_FINGERPRINTS) >= 8:
            _LOCAL_FINGERPRINTS.clear()
        texts = [text for source in sources for text in _read_source(source)]
        _LOCAL_FINGERPRINTS[key] = texts, EvalFingerprint.of_texts(texts)
    return _LOCAL_FINGERPRINTS[key]


def _plural(count: int, noun: str) -> str:
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def _dropped(manifest: Manifest) -> list[tuple[str, int, list[str]]]:
    """(source, training documents dropped for overlapping evaluation text, first locations) per source."""
    return [(name, count, source.skipped_examples.get(OVERLAPS_EVALUATION, []))
            for name, source in manifest.sources.items() if (count := source.skipped.get(OVERLAPS_EVALUATION, 0))]


def evaluation_brief(manifest: Manifest) -> str:
    """A clause for the one-line summary of a reused cache: texts checked, training documents dropped."""
    record = manifest.evaluation
    if record is None or not record.texts:
        return "no evaluation text checked"
    total = sum(count for _, count, _ in _dropped(manifest))
    return f"{_plural(len(record.texts), 'evaluation text')} checked, {_plural(total, 'training document')} dropped"


def evaluation_line(manifest: Manifest) -> str:
    """One line for the data summary: which evaluation texts were checked, and the training documents dropped."""
    record = manifest.evaluation
    unchecked = [name for name, source in manifest.sources.items()
                 if any(Path(shard.prefix).is_absolute() for shard in source.shards)]
    if record is None or not record.texts:
        missing = f" ({', '.join(record.missing)} not found)" if record is not None and record.missing else ""
        return f"evaluation texts: none{missing}; training documents not checked against evaluation text ({SETTING})"
    dropped = _dropped(manifest)
    total = sum(count for _, count, _ in dropped)
    shown = ", ".join(record.texts[:3]) + (", ..." if len(record.texts) > 3 else "")
    line = f"evaluation texts: {_plural(len(record.texts), 'text')} ({shown}) checked; "
    if total:
        examples = "; ".join(f"{name}: {example}" for name, _, examples in dropped for example in examples[:2])
        line += f"dropped {_plural(total, 'training document')} overlapping evaluation text: {examples}"
    else:
        line += "no training document overlaps them"
    if record.missing:
        line += f"; not found: {', '.join(record.missing)}"
    if unchecked:
        line += f"; not checked (token shards, no text): {', '.join(unchecked)}"
    return line
