"""What a source reader yields per input record: a Document, or a BadRecord saying what was wrong.

Readers (``data.sources``, ``data.sample_corpus``) build them with ``make_record``; the
preprocessor counts bad records by ``problem`` and reports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

INVALID_JSON = "invalid_json"
MISSING_FIELD = "missing_field"
NOT_TEXT = "not_text"  # the field holds a number, list, ... instead of a string
NON_UTF8 = "non_utf8"
EMPTY = "empty"  # empty or whitespace-only text
UNPARSABLE = "unparsable"  # python_docs: a .py file ast cannot parse
BAD_RECORD_PROBLEMS = (INVALID_JSON, MISSING_FIELD, NOT_TEXT, NON_UTF8, EMPTY, UNPARSABLE)


@dataclass(frozen=True)
class Document:
    text: str
    location: str


@dataclass(frozen=True)
class BadRecord:
    """An input record that is not a usable document: counted and reported, never tokenised."""

    problem: str
    location: str
    detail: str

    def describe(self) -> str:
        return f"{self.location}: {self.problem} ({self.detail})"


Record = Document | BadRecord


def make_record(value: Any, location: str, field: str = "text") -> Record:
    """Validate one extracted field value: a non-empty, encodable string becomes a Document."""
    if value is None:
        return BadRecord(MISSING_FIELD, location, f"field {field!r} is null")
    if isinstance(value, (bytes, bytearray)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError as error:
            return BadRecord(NON_UTF8, location, f"invalid UTF-8 at byte {error.start}")
    if not isinstance(value, str):
        return BadRecord(NOT_TEXT, location, f"field {field!r} is a {type(value).__name__}, not a string")
    try:
        value.encode("utf-8")  # JSON "\ud800" escapes decode to lone surrogates that cannot be encoded
    except UnicodeEncodeError as error:
        return BadRecord(NON_UTF8, location, f"unencodable character at offset {error.start} (lone surrogate)")
    if not value.strip():
        return BadRecord(EMPTY, location, "empty text" if not value else "whitespace-only text")
    return Document(value, location)
