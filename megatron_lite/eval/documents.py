"""Evaluation documents (PG-19 style books): read, clean, tokenise, keep the long ones, truncate.

``--ppl-docs`` is a book spec (``megatron_lite.data.book_specs``): a directory of .txt books (one book
per file; the repository ships two PG-19 test books in ``data/eval``), a directory or file of parquet
(one book per row, column ``--text-field``), a single .txt file, or a ``datasets`` id ``ID[:SPLIT[:COLUMN]]``
(default split ``test``; e.g. ``emozilla/pg19-test``, the parquet copy of the PG-19 test set).
Reading reuses the data pipeline's readers and cleaning (newline normalisation, optional
Project Gutenberg header/footer stripping).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_lite.config import SourceConfig
from megatron_lite.data.book_specs import text_source
from megatron_lite.data.cleaning import Cleaner
from megatron_lite.data.records import BadRecord
from megatron_lite.data.sources import read_source
from megatron_lite.data.tokenizer import AnyTokenizer


@dataclass
class EvalDocuments:
    source: str
    max_doc_tokens: int
    names: list[str] = field(default_factory=list)
    token_ids: list[torch.Tensor] = field(default_factory=list)  # each (max_doc_tokens,) int64; (>= it) with max_doc_chars
    scored_bytes: list[int] = field(default_factory=list)  # UTF-8 bytes of each document's scored text
    max_doc_chars: int | None = None  # texts cut to this many characters before tokenising
    num_read: int = 0
    num_too_short: int = 0  # fewer than max_doc_tokens tokens: skipped (reported)
    num_bad: int = 0  # unreadable records (empty, not UTF-8, ...)

    def summary(self) -> str:
        kept = (f"cut to {self.max_doc_chars:,} characters, whole" if self.max_doc_chars is not None
                else f"truncated to {self.max_doc_tokens:,}")
        return (f"{len(self.token_ids)} of {self.num_read} documents from {self.source} have >= "
                f"{self.max_doc_tokens:,} tokens and are used ({kept}); "
                f"{self.num_too_short} shorter ones skipped" + (f", {self.num_bad} unreadable" if self.num_bad else ""))


def source_for(spec: str, split: str = "test", text_field: str = "text", strip_gutenberg: bool = False,
               max_documents: int | None = None, flag: str = "--ppl-docs") -> SourceConfig:
    """The data-pipeline source a ``--ppl-docs`` value (or the setting ``flag`` names) stands for."""
    return text_source(spec, flag, split, text_field, strip_gutenberg, max_documents)


def scored_text_bytes(tokenizer: AnyTokenizer, token_ids: list[int]) -> int:
    """UTF-8 bytes of the text that tokens 1..N-1 stand for (token 0 is never scored): the decoded document
    minus its decoded first token (a BOS decodes to nothing, so then it is the whole text)."""
    return len(tokenizer.decode(token_ids).encode("utf-8")) - len(tokenizer.decode(token_ids[:1]).encode("utf-8"))


def load_documents(
    spec: str,
    tokenizer: AnyTokenizer,
    max_doc_tokens: int,
    max_documents: int | None = None,
    strip_gutenberg: bool = False,
    split: str = "test",
    text_field: str = "text",
    max_doc_chars: int | None = None,
    flags: tuple[str, str] = ("--ppl-docs", "--max-doc-tokens"),
) -> EvalDocuments:
    """Tokenise documents in source order; keep the first ``max_documents`` with >= max_doc_tokens tokens.
    ``max_doc_chars`` cuts every text to that many characters first, so models with different tokenizers
    score the same text: the cut text is then kept whole, and ``max_doc_tokens`` is only the minimum.
    ``flags``: the settings the errors name for ``spec`` and ``max_doc_tokens`` (a tool's flags, a config's keys)."""
    spec_flag, length_flag = flags
    if max_doc_tokens < 2:
        raise ValueError(f"{length_flag} {max_doc_tokens}: must be >= 2")
    if max_doc_chars is not None and max_doc_chars < 1:
        raise ValueError(f"--max-doc-chars {max_doc_chars}: must be >= 1")
    source = source_for(spec, split, text_field, strip_gutenberg, flag=spec_flag)
    cleaner = Cleaner(source)
    documents = EvalDocuments(source=spec, max_doc_tokens=max_doc_tokens, max_doc_chars=max_doc_chars)
    for record in read_source(source, spec_flag.lstrip("-")):
        if max_documents is not None and len(documents.token_ids) >= max_documents:
            break
        if isinstance(record, BadRecord):
            documents.num_bad += 1
            continue
        documents.num_read += 1
        text = cleaner(record.text, record.location)
        if text is not None and max_doc_chars is not None:
            text = text[:max_doc_chars]
        tokens = tokenizer.encode_prompt(text) if text is not None else []  # as a training document starts
        if len(tokens) < max_doc_tokens:
            documents.num_too_short += 1
            continue
        if max_doc_chars is None:
            tokens = tokens[:max_doc_tokens]
        # with a character budget the whole cut text is scored, so every tokenizer scores the same text;
        # max_doc_tokens is then only the minimum length
        documents.names.append(record.location)
        documents.token_ids.append(torch.tensor(tokens, dtype=torch.long))
        documents.scored_bytes.append(scored_text_bytes(tokenizer, tokens))
    if not documents.token_ids:
        raise ValueError(f"{spec_flag} {spec!r}: none of {documents.num_read} documents has >= {max_doc_tokens} "
                         f"tokens ({length_flag}); lower {length_flag}")
    return documents
