"""Evaluation documents: .txt directories and parquet give the same tokens, Gutenberg boilerplate is
stripped on request, short books are skipped and counted, long ones truncated."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_lite.data.tokenizer import Tokenizer
from megatron_lite.eval.documents import load_documents, source_for
from test_eval_support import make_tokenizer, single_thread, write_books  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return make_tokenizer(tmp_path_factory.mktemp("documents_tokenizer"))


@pytest.fixture(scope="module")
def books(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_books(tmp_path_factory.mktemp("books"), [60, 5, 80])  # the middle book is short


def test_short_books_are_skipped_and_long_ones_truncated(tokenizer: Tokenizer, books: Path) -> None:
    documents = load_documents(str(books), tokenizer, max_doc_tokens=600, strip_gutenberg=True)
    assert documents.num_read == 3 and documents.num_too_short == 1 and len(documents.token_ids) == 2
    assert [name.rsplit("/", 1)[-1] for name in documents.names] == ["book_00.txt", "book_02.txt"]
    assert all(ids.shape == (600,) for ids in documents.token_ids)
    assert "2 of 3 documents" in documents.summary() and "1 shorter ones skipped" in documents.summary()
    limited = load_documents(str(books), tokenizer, max_doc_tokens=600, max_documents=1)
    assert len(limited.token_ids) == 1


def test_gutenberg_boilerplate_is_stripped_on_request(tokenizer: Tokenizer, books: Path) -> None:
    stripped = load_documents(str(books), tokenizer, max_doc_tokens=100, strip_gutenberg=True)
    raw = load_documents(str(books), tokenizer, max_doc_tokens=100, strip_gutenberg=False)
    stripped_text = tokenizer.decode(stripped.token_ids[0].tolist())
    raw_text = tokenizer.decode(raw.token_ids[0].tolist())
    assert raw_text.startswith("The Project Gutenberg eBook") and "PROJECT GUTENBERG" not in stripped_text
    assert "\r" not in raw_text  # CRLF normalised either way
    full = load_documents(str(books), tokenizer, max_doc_tokens=2, strip_gutenberg=True)
    assert all("Licence" not in tokenizer.decode(ids.tolist()) for ids in full.token_ids)


def test_parquet_gives_the_same_documents(tokenizer: Tokenizer, books: Path, tmp_path: Path) -> None:
    texts = [path.read_bytes().decode() for path in sorted(books.glob("*.txt"))]
    pq.write_table(pa.table({"text": texts, "title": ["a", "b", "c"]}), tmp_path / "pg19.parquet")
    from_txt = load_documents(str(books), tokenizer, 600, strip_gutenberg=True)
    from_parquet = load_documents(str(tmp_path / "pg19.parquet"), tokenizer, 600, strip_gutenberg=True)
    assert from_parquet.num_too_short == 1
    assert [ids.tolist() for ids in from_parquet.token_ids] == [ids.tolist() for ids in from_txt.token_ids]
    assert source_for(str(tmp_path)).type == "parquet"


def test_sources(tmp_path: Path) -> None:
    assert source_for("emozilla/pg19-test").type == "hf" and source_for("pg19").split == "test"
    with pytest.raises(ValueError, match="--ppl-docs"):
        source_for(str(tmp_path / "missing" / "books.txt"))
    with pytest.raises(ValueError, match="--ppl-docs"):
        source_for(str(tmp_path))  # an empty directory


def test_no_long_enough_document_names_the_flag(tokenizer: Tokenizer, books: Path) -> None:
    with pytest.raises(ValueError, match="--max-doc-tokens"):
        load_documents(str(books), tokenizer, max_doc_tokens=10**6)


def test_bits_per_byte_is_the_nll_in_bits_over_the_scored_text_bytes(tokenizer: Tokenizer, books: Path) -> None:
    """Computed here independently: SentencePiece's own byte offsets give the scored text (tokens 1..N-1 of
    the character-budgeted text, kept whole), one full forward gives the summed NLL."""
    import math

    import sentencepiece as spm
    import torch
    import torch.nn.functional as F

    from megatron_lite.eval.perplexity import sliding_window_perplexity
    from megatron_lite.model import build_model
    from test_eval_support import tiny_eval_config

    budget, length = 2000, 300
    documents = load_documents(str(books), tokenizer, max_doc_tokens=length, max_doc_chars=budget)
    assert len(documents.token_ids) == 3 and documents.max_doc_chars == budget
    window = max(len(ids) for ids in documents.token_ids)  # the cut text is kept whole: > length tokens
    assert window > length
    model = build_model(tiny_eval_config("rope", seq_length=window, vocab_size=320)).eval()
    processor = spm.SentencePieceProcessor(model_file=str(tokenizer.path))
    nll_bits, scored_bytes = 0.0, 0
    for name, ids in zip(documents.names, documents.token_ids):
        text = Path(name).read_text(encoding="utf-8").replace("\r\n", "\n")[:budget]  # cleaning: newlines only
        pieces = processor.encode(text, return_type="proto").pieces
        assert [piece.id for piece in pieces] == ids.tolist()
        scored_bytes += pieces[-1].end - pieces[0].end  # UTF-8 byte offsets in the input
        with torch.no_grad():
            logits = model(ids[None])[0, :-1].float()  # (N - 1, V): predictions of tokens 1..N-1
        nll_bits += float(F.cross_entropy(logits, ids[1:], reduction="sum")) / math.log(2)
    result = sliding_window_perplexity(model, documents.token_ids, window, window, scored_bytes=documents.scored_bytes)
    assert result.num_bytes == scored_bytes
    assert result.bits_per_byte == pytest.approx(nll_bits / scored_bytes, rel=1e-6)
    with pytest.raises(ValueError, match="--max-doc-chars 0"):
        load_documents(str(books), tokenizer, max_doc_tokens=length, max_doc_chars=0)
