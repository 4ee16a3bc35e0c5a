"""Per-source document cleaning: newline normalisation, Gutenberg boilerplate, length, exact dedup.

Nothing is dropped silently: every document removed is counted by reason in a :class:`Tally`
(with its first few locations), and documents kept despite a problem (e.g. Gutenberg markers
missing) are counted as warnings.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from megatron_lite.config import SourceConfig

MAX_EXAMPLES = 5  # locations kept per problem for the report

# Drop reasons (cleaning) and warnings; bad-record problems come from sources.py.
TOO_SHORT = "too_short"
DUPLICATE = "duplicate"
GUTENBERG_MARKERS_MISSING = "gutenberg_markers_missing"
OVERLAPS_EVALUATION = "overlaps_evaluation_text"  # eval_overlap.py: shares much text with an evaluation book

# "*** START OF THE PROJECT GUTENBERG EBOOK TITLE ***" and the older "THIS ... EBOOK/ETEXT"
# variants; the title and the closing stars are optional (some files wrap or omit them).
_GUTENBERG_START = re.compile(
    r"^\*{3}\s*START OF (?:THE|THIS) PROJECT GUTENBERG E(?:BOOK|TEXT)\b.*$", re.IGNORECASE | re.MULTILINE
)
_GUTENBERG_END = re.compile(
    r"^\*{3}\s*END OF (?:THE|THIS) PROJECT GUTENBERG E(?:BOOK|TEXT)\b.*$", re.IGNORECASE | re.MULTILINE
)


@dataclass
class Tally:
    """Counts by problem plus the first few locations of each (for the report and the manifest)."""

    counts: Counter[str] = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def add(self, problem: str, location: str) -> None:
        self.counts[problem] += 1
        seen = self.examples.setdefault(problem, [])
        if len(seen) < MAX_EXAMPLES:
            seen.append(location)

    def as_dicts(self) -> tuple[dict[str, int], dict[str, list[str]]]:
        return dict(sorted(self.counts.items())), {key: list(value) for key, value in sorted(self.examples.items())}


def normalize_newlines(text: str) -> str:
    """CRLF and lone CR -> LF (CRLF first, so it becomes one LF, not two)."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def strip_gutenberg(text: str) -> tuple[str, bool]:
    """Text between the START and END markers; ``(text, found_both)``.

    A missing marker leaves that end of the text as it is (better to keep a licence header than
    to lose a book); the caller counts it.
    """
    start = _GUTENBERG_START.search(text)
    begin = start.end() if start else 0
    end = _GUTENBERG_END.search(text, begin)
    if not start and not end:
        return text, False
    finish = end.start() if end else len(text)
    return text[begin:finish].strip("\n"), bool(start and end)


class Cleaner:
    """Applies one source's cleaning settings; returns the cleaned text or None (dropped, counted).
    ``evaluation_match(text)`` names the evaluation text a document overlaps (None: it overlaps none)."""

    def __init__(self, source: SourceConfig, evaluation_match: Callable[[str], str | None] | None = None) -> None:
        self.source = source
        self.evaluation_match = evaluation_match
        self.dropped = Tally()
        self.warnings = Tally()
        # 16-byte digests: exact-duplicate detection needs collision resistance, not secrecy,
        # and halves the memory of a full sha256 per document.
        self._seen: set[bytes] = set()

    def __call__(self, text: str, location: str) -> str | None:
        source = self.source
        if source.normalize_newlines:
            text = normalize_newlines(text)
        markers_found = True
        if source.strip_gutenberg:
            text, markers_found = strip_gutenberg(text)
        if len(text) < source.min_chars:
            self.dropped.add(TOO_SHORT, location)
            return None
        if source.deduplicate:
            digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()
            if digest in self._seen:
                self.dropped.add(DUPLICATE, location)
                return None
            self._seen.add(digest)
        if self.evaluation_match is not None and (overlapped := self.evaluation_match(text)) is not None:
            self.dropped.add(OVERLAPS_EVALUATION, f"{location} (evaluation text {overlapped})")
            return None
        if not markers_found:  # warnings count kept documents only; drops are counted above
            self.warnings.add(GUTENBERG_MARKERS_MISSING, location)
        return text
