"""Book specs (megatron_lite/data/book_specs.py): a local path or a ``datasets`` id ID[:SPLIT[:COLUMN]], the
shipped evaluation books in data/eval, books written out for tools that need .txt files, and the
evaluation tool's --quick preset. No network: the datasets id path is served from a local parquet file."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_lite.data.book_specs import SAMPLE_BOOKS, books_directory, text_source
from megatron_lite.data.cleaning import strip_gutenberg
from megatron_lite.data.sources import decode_auto
from script_loading import REPO, load_script

TEXTS = ["First book. " * 40, "Second book. " * 50, "Third book. " * 60]


@pytest.fixture()
def parquet_file(tmp_path: Path) -> Path:
    path = tmp_path / "hub" / "train-00000-of-00001.parquet"
    path.parent.mkdir()
    pq.write_table(pa.table({"content": TEXTS, "title": ["a", "b", "c"]}), path)
    return path


@pytest.fixture()
def fake_hub(monkeypatch: pytest.MonkeyPatch, parquet_file: Path) -> list[dict[str, Any]]:
    """``datasets.load_dataset`` for the id ``someone/books`` answers from the local parquet file (the
    same call, offline); returns the calls made."""
    calls: list[dict[str, Any]] = []
    real_load = datasets.load_dataset

    def load_dataset(path: str, name: str | None = None, **kwargs: Any) -> Any:
        calls.append({"path": path, "name": name, **kwargs})
        assert path == "someone/books", path
        return real_load("parquet", data_files={kwargs["split"]: str(parquet_file)}, split=kwargs["split"],
                         streaming=kwargs["streaming"])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def test_local_paths_and_dataset_ids(tmp_path: Path, parquet_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    assert text_source(str(SAMPLE_BOOKS), "--ppl-docs").type == "text"
    assert text_source(str(parquet_file.parent), "--ppl-docs").type == "parquet"
    assert text_source(str(parquet_file), "--ppl-docs").type == "parquet"
    assert text_source(str(SAMPLE_BOOKS / "10146.txt"), "--ppl-docs").type == "text"
    plain = text_source("emozilla/pg19-test", "--ppl-docs")
    assert (plain.type, plain.path, plain.split, plain.text_field, plain.streaming) == \
        ("hf", "emozilla/pg19-test", "test", "text", True)
    full = text_source("emozilla/pg19:validation:body", "--books", split="train")
    assert (full.path, full.split, full.text_field) == ("emozilla/pg19", "validation", "body")
    assert text_source("emozilla/pg19", "--books", split="train", text_field="content").split == "train"
    for spec, message in [(str(tmp_path / "missing"), "no such file or directory"),
                          ("books/pg19.txt", "no such file or directory"),
                          ("data/evall", "no such file or directory"),  # "data" exists: a mistyped path
                          ("owner/name:train:text:extra", "not an existing path, nor a datasets id"),
                          ("owner/name::text", "not an existing path, nor a datasets id")]:
        with pytest.raises(ValueError, match=f"^--books '{spec}': {message}"):
            text_source(spec, "--books")


def test_shipped_books_are_small_public_domain_gutenberg_files() -> None:
    books = sorted(SAMPLE_BOOKS.glob("*.txt"))
    assert [book.name for book in books] == ["10146.txt", "10321.txt"]
    assert sum(book.stat().st_size for book in books) <= 1 << 20
    for book in books:
        text, markers_found = strip_gutenberg(decode_auto(book.read_bytes()).replace("\r\n", "\n"))
        assert markers_found and len(text) > 200_000
        assert "for the use of anyone anywhere" not in text and "END OF TH" not in text  # licence header, footer


def test_a_txt_directory_is_used_as_it_is(tmp_path: Path) -> None:
    assert books_directory(str(SAMPLE_BOOKS), "--eval-books", tmp_path, "test") == SAMPLE_BOOKS
    assert not any(tmp_path.iterdir())


def test_a_dataset_id_is_streamed_written_out_once_and_reused(tmp_path: Path,
                                                              fake_hub: list[dict[str, Any]]) -> None:
    directory = books_directory("someone/books:train:content", "--books", tmp_path / "cache", "test",
                                max_documents=2)
    assert fake_hub == [{"path": "someone/books", "name": None, "split": "train", "streaming": True,
                         "data_files": None}]
    assert directory.parent == tmp_path / "cache" and not directory.name.endswith(".partial")
    written = sorted(directory.glob("*.txt"))
    assert [path.name for path in written] == ["000000.txt", "000001.txt"]
    assert [path.read_text() for path in written] == TEXTS[:2]
    assert books_directory("someone/books:train:content", "--books", tmp_path / "cache", "test", 2) == directory
    assert len(fake_hub) == 1  # the finished copy is reused
    with pytest.raises(ValueError, match="^--books 'someone/books:train': no readable books"):
        books_directory("someone/books:train", "--books", tmp_path / "cache", "test")  # no column "text"
    assert not list((tmp_path / "cache").glob("*.partial"))


def test_a_saved_dataset_dict_is_written_out_by_split(tmp_path: Path) -> None:
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": TEXTS}),
                                   "test": datasets.Dataset.from_dict({"text": ["Held out. " * 30]})})
    splits.save_to_disk(str(tmp_path / "saved"))
    directory = books_directory(str(tmp_path / "saved"), "--eval-books", tmp_path / "cache", "test")
    assert [path.read_text() for path in sorted(directory.glob("*.txt"))] == ["Held out. " * 30]


def test_reproduce_writes_out_dataset_books_under_out(tmp_path: Path, fake_hub: list[dict[str, Any]]) -> None:
    reproduce = load_script("tools/reproduce.py")
    out = tmp_path / "out"
    args = reproduce.parse_args(["--books", "someone/books:train:content", "--eval-books", "data/eval",
                                 "--out", str(out), "--dataset-max-books", "3"])
    reproduce.settings_from_args(args)
    assert not fake_hub  # parsing never downloads
    settings = reproduce.with_books_on_disk(reproduce.settings_from_args(args), args)
    assert settings.books is not None and settings.books.parent == out / "data" / "books"
    assert len(list(settings.books.glob("*.txt"))) == 3 and fake_hub[0]["split"] == "train"
    assert settings.eval_books == Path("data/eval")


# --quick (tools/eval_long_context.py): each preset flag and where its value comes from

def _parse(*extra: str) -> argparse.Namespace:
    tool = load_script("tools/eval_long_context.py")
    return tool.parse_args(["--checkpoints", "runs/coca_slack", "--out", "runs/eval_quick", *extra])


def test_quick_resolves_to_its_documented_values() -> None:
    tool = load_script("tools/eval_long_context.py")
    quick = tool.settings_from_args(_parse("--quick"))
    assert (quick.ppl_docs, quick.strip_gutenberg) == (str(REPO / "data" / "eval"), True)
    assert (quick.windows, quick.stride, quick.max_doc_tokens, quick.max_docs) == ([128, 256], 64, 1024, 2)
    assert (quick.passkey_lengths, quick.passkey_cases) == ([128, 256], 2)
    assert (quick.needles, quick.needle_lengths, quick.needle_cases) == (
        ["niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt"], [256, 512], 1)
    full = tool.settings_from_args(_parse("--ppl-docs", "data/eval"))
    assert (full.windows[0], full.stride, full.max_doc_tokens, full.max_docs) == (512, 512, 32768, 100)
    assert (full.passkey_lengths, full.passkey_cases, full.needles, full.strip_gutenberg) == ([], 100, [], False)


def test_explicit_flags_win_over_quick() -> None:
    args = _parse("--quick", "--windows", "128", "--passkey-cases", "1", "--needles", "none",
                  "--ppl-docs", "emozilla/pg19-test")
    assert (args.windows, args.passkey_cases, args.needles, args.stride) == ("128", 1, "none", 64)
    assert (args.ppl_docs, args.strip_gutenberg) == ("emozilla/pg19-test", False)  # stripping only for data/eval
