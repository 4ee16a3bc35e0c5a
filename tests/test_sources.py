"""Source readers, the built-in sample corpus, cleaning, and the paper mix file (no network)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from megatron_lite.data import cleaning, sample_corpus
from megatron_lite.data.cleaning import Cleaner, Tally, normalize_newlines, strip_gutenberg
from megatron_lite.config import SourceConfig
from megatron_lite.data.mix import group_weights, load_mix
from megatron_lite.data.sources import BadRecord, Document, input_fingerprint, read_source

REPO = Path(__file__).resolve().parents[1]


def summary(records) -> list[tuple[str, str]]:
    """(kind, location) pairs: 'doc' or the bad-record problem."""
    return [("doc" if isinstance(r, Document) else r.problem, r.location) for r in records]


def write_jsonl(path: Path) -> Path:
    lines = [
        json.dumps({"text": "first document"}).encode(),
        b'{"text": "broken',  # invalid JSON
        json.dumps({"body": "no text field"}).encode(),
        b'{"text": "caf\xe9"}',  # latin-1 byte: not UTF-8
        json.dumps({"text": ""}).encode(),
        json.dumps({"text": 42}).encode(),
        b'{"text": "lone \\ud800 surrogate"}',
        b"",  # blank line
        json.dumps([1, 2]).encode(),
        json.dumps({"text": "last document \u00e9\u4e2d"}).encode(),
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_jsonl_reports_every_bad_record_with_file_and_line(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "data.jsonl")
    records = list(read_source(SourceConfig(type="jsonl", path=str(path)), "j"))
    assert summary(records) == [
        ("doc", f"{path}:1"), ("invalid_json", f"{path}:2"), ("missing_field", f"{path}:3"),
        ("non_utf8", f"{path}:4"), ("empty", f"{path}:5"), ("not_text", f"{path}:6"), ("non_utf8", f"{path}:7"),
        ("empty", f"{path}:8"), ("invalid_json", f"{path}:9"), ("doc", f"{path}:10"),
    ]
    assert records[-1].text == "last document \u00e9\u4e2d"
    assert "body" in records[2].detail  # the keys that were there


def test_jsonl_text_field_gzip_and_max_documents(tmp_path: Path) -> None:
    rows = [{"content": f"doc {i}"} for i in range(5)]
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as handle:
        handle.write("\n".join(map(json.dumps, rows)) + "\n")
    source = SourceConfig(type="jsonl", path=str(tmp_path), text_field="content", max_documents=3)
    assert [r.text for r in read_source(source)] == ["doc 0", "doc 1", "doc 2"]


def test_text_files_directories_and_globs(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "two.txt").write_text("second\r\nfile")
    (tmp_path / "a.txt").write_text("first file")
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe oops")
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "skip.md").write_text("not a .txt")
    records = list(read_source(SourceConfig(type="text", path=str(tmp_path))))
    # Sorted as paths (component by component): b/two.txt before bad.txt.
    assert summary(records) == [("doc", str(tmp_path / "a.txt")), ("doc", str(tmp_path / "b" / "two.txt")),
                                ("non_utf8", str(tmp_path / "bad.txt")), ("empty", str(tmp_path / "empty.txt"))]
    assert records[1].text == "second\r\nfile"  # readers do not clean; Cleaner does
    globbed = list(read_source(SourceConfig(type="text", path=str(tmp_path / "**" / "*.md"))))
    assert [r.text for r in globbed] == ["not a .txt"]


def test_missing_paths_are_user_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"source books: path=.*nowhere.*does not exist"):
        list(read_source(SourceConfig(type="text", path=str(tmp_path / "nowhere")), "books"))
    with pytest.raises(ValueError, match="matches no files"):
        list(read_source(SourceConfig(type="parquet", path=str(tmp_path / "*.parquet")), "p"))


def test_parquet_rows_and_missing_column(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["one", None, "", "four"], "n": [1, 2, 3, 4]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"body": ["x", "y"]}), tmp_path / "b.parquet")
    records = list(read_source(SourceConfig(type="parquet", path=str(tmp_path))))
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    assert summary(records) == [("doc", f"{a}:row 0"), ("missing_field", f"{a}:row 1"), ("empty", f"{a}:row 2"),
                                ("doc", f"{a}:row 3"), ("missing_field", f"{b}:row 0"), ("missing_field", f"{b}:row 1")]
    assert "columns: body" in records[-1].detail


@pytest.mark.parametrize("streaming", [True, False])
def test_hf_save_to_disk_dataset(tmp_path: Path, streaming: bool) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": ["alpha", "", None, "delta"], "id": [0, 1, 2, 3]}),
        "test": datasets.Dataset.from_dict({"text": ["held out"], "id": [9]}),
    }).save_to_disk(str(tmp_path / "ds"))
    source = SourceConfig(type="hf", path=str(tmp_path / "ds"), streaming=streaming)
    label = f"{tmp_path / 'ds'}:train"
    assert summary(read_source(source)) == [("doc", f"{label}:row 0"), ("empty", f"{label}:row 1"),
                                            ("missing_field", f"{label}:row 2"), ("doc", f"{label}:row 3")]
    with pytest.raises(ValueError, match="split='validation' not in"):
        list(read_source(SourceConfig(type="hf", path=str(tmp_path / "ds"), split="validation")))


def test_hf_local_repo_copy_goes_through_load_dataset(tmp_path: Path) -> None:
    """A local directory of data files: the same load_dataset call a hub id takes (streaming, no download)."""
    pytest.importorskip("datasets")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "train.jsonl").write_text("\n".join(json.dumps({"content": t}) for t in ["x = 1\n", "y = 2\n"]) + "\n")
    source = SourceConfig(type="hf", path=str(repo), streaming=True, text_field="content")
    assert [(r.text, r.location) for r in read_source(source)] == [("x = 1\n", f"{repo}:train:row 0"),
                                                                   ("y = 2\n", f"{repo}:train:row 1")]


def test_python_code_walks_sorted_and_skips_tests_and_site_packages(tmp_path: Path) -> None:
    for relative in ["b.py", "a.py", "pkg/__init__.py", "pkg/mod.py", "test/test_x.py", "pkg/tests/t.py",
                     "site-packages/lib.py", "idlelib/idle_test/t.py", "notes.txt"]:
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(f"# {relative}\n")
    records = list(read_source(SourceConfig(type="python_code", path=str(tmp_path))))
    assert [Path(r.location).relative_to(tmp_path).as_posix() for r in records] == [
        "a.py", "b.py", "pkg/__init__.py", "pkg/mod.py"]


def test_python_docs_collects_docstrings_by_qualified_name(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text('"""The package."""\n')
    (tmp_path / "pkg" / "shapes.py").write_text(
        '"""Shapes module."""\n\nclass Circle:\n    """A round shape.\n\n    Indented detail.\n    """\n\n'
        '    def area(self):\n        """Area of the circle."""\n        return 0\n\n'
        'if True:\n    async def grow():\n        """Grow it."""\n')
    (tmp_path / "plain.py").write_text("x = 1\n")  # no docstrings: no document, nothing to report
    (tmp_path / "broken.py").write_text("def oops(:\n")
    (tmp_path / "latin.py").write_bytes(b'"""caf\xe9"""\n')
    records = list(read_source(SourceConfig(type="python_docs", path=str(tmp_path))))
    assert [(r.problem if isinstance(r, BadRecord) else "doc", Path(r.location.split(" ")[0]).name)
            for r in records] == [("unparsable", "broken.py"), ("non_utf8", "latin.py"),
                                  ("doc", "__init__.py"), ("doc", "shapes.py")]
    assert records[2].text == "pkg\n\nThe package."
    assert records[3].text == ("pkg.shapes\n\nShapes module.\n\npkg.shapes.Circle\n\nA round shape.\n\nIndented detail."
                               "\n\npkg.shapes.Circle.area\n\nArea of the circle.\n\npkg.shapes.grow\n\nGrow it.")


def test_builtin_corpus_reads_the_installation() -> None:
    """Default python_docs starts with the licence (when installed) and pydoc topics; code is stdlib .py."""
    docs = list(read_source(SourceConfig(type="python_docs", max_documents=3)))
    licences = sample_corpus.licence_files()
    assert [d.location for d in docs[: len(licences)]] == [str(p) for p in licences]
    assert any(d.location.startswith("pydoc_data.topics[") for d in docs)
    code = list(read_source(SourceConfig(type="python_code", max_documents=3)))
    stdlib = sample_corpus.stdlib_dir()
    assert [Path(c.location) for c in code] == sample_corpus.python_files(stdlib)[: len(code)]
    assert not any(set(Path(p).parts) & {"site-packages", "test"} for p in sample_corpus.python_files(stdlib))


def test_input_fingerprint_tracks_local_files(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("one")
    source = SourceConfig(type="text", path=str(tmp_path))
    before = input_fingerprint(source)
    assert input_fingerprint(source) == before
    (tmp_path / "a.txt").write_text("one, edited")
    assert input_fingerprint(source) != before
    assert input_fingerprint(SourceConfig(type="hf", path="org/remote-id")) == input_fingerprint(
        SourceConfig(type="hf", path="org/other-id"))  # hub ids: identified by the config hash instead


# ----------------------------------------------------------------------------------------------
# Cleaning


def test_normalize_newlines() -> None:
    assert normalize_newlines("a\r\nb\rc\n\r\n") == "a\nb\nc\n\n"


@pytest.mark.parametrize("start, end", [
    ("*** START OF THE PROJECT GUTENBERG EBOOK ALICE ***", "*** END OF THE PROJECT GUTENBERG EBOOK ALICE ***"),
    ("*** START OF THIS PROJECT GUTENBERG EBOOK ALICE ***", "*** END OF THIS PROJECT GUTENBERG EBOOK ALICE ***"),
    ("***START OF THE PROJECT GUTENBERG EBOOK", "*** END OF THE PROJECT GUTENBERG EBOOK ***"),
])
def test_strip_gutenberg_variants(start: str, end: str) -> None:
    text = f"Title: Alice\nLicence header\n{start}\n\nChapter I\nDown the rabbit hole.\n\n{end}\nLicence footer\n"
    assert strip_gutenberg(text) == ("Chapter I\nDown the rabbit hole.", True)


def test_cleaner_counts_every_drop_and_kept_warning() -> None:
    source = SourceConfig(type="text", path="x", strip_gutenberg=True, min_chars=5)
    cleaner = Cleaner(source)
    book = "head\r\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\r\nThe story.\r\n*** END OF THE PROJECT GUTENBERG EBOOK X ***\r\n"
    assert cleaner(book, "book.txt") == "The story."
    assert cleaner("No markers here at all.", "plain.txt") == "No markers here at all."  # kept, warned
    assert cleaner("tiny", "tiny.txt") is None
    assert cleaner("The story.", "again.txt") is None  # same cleaned text as book.txt
    assert dict(cleaner.dropped.counts) == {"too_short": 1, "duplicate": 1}
    assert cleaner.dropped.examples == {"too_short": ["tiny.txt"], "duplicate": ["again.txt"]}
    assert dict(cleaner.warnings.counts) == {"gutenberg_markers_missing": 1}
    keep_all = Cleaner(SourceConfig(type="text", path="x", deduplicate=False, normalize_newlines=False))
    assert keep_all("a\r\nb", "1") == "a\r\nb" and keep_all("a\r\nb", "2") == "a\r\nb"


def test_tally_keeps_first_few_examples() -> None:
    tally = Tally()
    for i in range(8):
        tally.add("empty", f"f:{i}")
    assert tally.counts["empty"] == 8 and tally.examples["empty"] == [f"f:{i}" for i in range(cleaning.MAX_EXAMPLES)]


# ----------------------------------------------------------------------------------------------
# Mix files


def test_paper_mix_parses() -> None:
    mix = load_mix(REPO / "configs/data/paper_mix.yml")
    assert group_weights(mix) == {"text": 0.75, "code": 0.25}
    sources = {name: source for group in mix.groups.values() for name, source in group.sources.items()}
    assert set(mix.groups["text"].sources) == {"pile", "bookcorpus", "wikipedia"}
    assert all(s.type == "hf" and s.streaming and s.max_documents for s in sources.values())
    assert sources["wikipedia"].name == "20231101.en"


def test_sample_mix_parses() -> None:
    mix = load_mix(REPO / "configs/data/sample_mix.yml")
    assert [s.type for g in mix.groups.values() for s in g.sources.values()] == ["python_docs", "python_code"]
