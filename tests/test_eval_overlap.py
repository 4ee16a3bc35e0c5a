"""Evaluation text kept out of training: a planted evaluation book (and near copies of it) is dropped from a
training source when the data is built, with its count in the summary; a clean source loses nothing."""

from __future__ import annotations

import random
import re
import textwrap
from pathlib import Path

import pytest
import yaml

from megatron_lite import config as config_lib
from megatron_lite.data.eval_overlap import OVERLAPS_EVALUATION, EvalFingerprint, EvaluationCheck, evaluation_line
from megatron_lite.data.manifest import EvaluationRecord, load_manifest
from megatron_lite.data.preprocess import prepare_data
from megatron_lite.data.tokenizer import train_tokenizer
from script_loading import load_script

REPO = Path(__file__).resolve().parents[1]
HEADER = ("The Project Gutenberg EBook of {title}\r\n\r\nThis eBook is for the use of anyone anywhere at no cost.\r\n"
          "\r\n*** START OF THIS PROJECT GUTENBERG EBOOK {title} ***\r\n\r\n")
FOOTER = "\r\n\r\n*** END OF THIS PROJECT GUTENBERG EBOOK {title} ***\r\n\r\nEnd of the Project Gutenberg licence.\r\n"


def _book(seed: int, words: int = 3000) -> str:
    """Prose of made-up words (~20 KB), wrapped at 70 columns: no two books share a sentence."""
    rng = random.Random(seed)
    vocabulary = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
                  for _ in range(400)]
    sentences = [" ".join(rng.choice(vocabulary) for _ in range(rng.randint(6, 18))).capitalize() + "."
                 for _ in range(words // 12)]
    return "\n".join(textwrap.fill(" ".join(sentences[i : i + 5]), 70) for i in range(0, len(sentences), 5))


def _gutenberg(title: str, body: str) -> str:
    return HEADER.format(title=title) + body.replace("\n", "\r\n") + FOOTER.format(title=title)


@pytest.fixture(scope="module")
def tokenizer_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tokenizer([_book(seed) for seed in range(3)], tmp_path_factory.mktemp("tok") / "t.model",
                           vocab_size=400).path


def _config(root: Path, model: Path, eval_texts: list[str]) -> config_lib.Config:
    return config_lib.from_dict({
        "model": {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "vocab_size": 400},
        "data": {"mix": str(root / "mix.yml"), "cache_dir": str(root / "cache"), "num_workers": 1,
                 "eval_texts": eval_texts, "tokenizer": {"model": str(model)}},
    })


def test_planted_evaluation_book_is_dropped_with_its_count_shown(tmp_path: Path, tokenizer_model: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    evaluation = _book(100)
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "held_out.txt").write_text(_gutenberg("HELD OUT", evaluation), newline="")
    books = tmp_path / "books"
    books.mkdir()
    for seed in (1, 2, 3):
        (books / f"clean_{seed}.txt").write_text(_gutenberg(f"CLEAN {seed}", _book(seed)), newline="")
    # the same book from another edition: LF line ends, its own header, re-wrapped lines, curly quotes
    edition = "Produced by volunteers.\n\n" + textwrap.fill(re.sub(r"\s+", " ", evaluation), 60) + "\n\u201cEnd.\u201d\n"
    (books / "planted_edition.txt").write_text(edition)
    (books / "planted_in_anthology.txt").write_text(_book(4) + "\n\n" + evaluation + "\n\n" + _book(5))
    (tmp_path / "mix.yml").write_text(f"groups:\n  text: {{weight: 1.0, sources: {{books: {{type: text, "
                                      f"path: {books}, strip_gutenberg: true}}}}}}\n")

    # no evaluation text there: nothing checked, and the summary says so
    missing = str(tmp_path / "no_such_dir")
    manifest = prepare_data(_config(tmp_path, tokenizer_model, [missing]).data, 400)
    assert manifest.sources["books"].documents == 5
    assert f"evaluation texts: none ({missing} not found); training documents not checked" in capsys.readouterr().out

    # the evaluation book given: the cache key changes, the source is read again and the copies are dropped
    config = _config(tmp_path, tokenizer_model, [str(tmp_path / "eval")])
    manifest = prepare_data(config.data, 400)
    out = capsys.readouterr().out
    record = manifest.sources["books"]
    assert record.documents == 3 and record.skipped[OVERLAPS_EVALUATION] == 2
    held_out = str(tmp_path / "eval" / "held_out.txt")
    assert manifest.evaluation is not None and manifest.evaluation.texts == [held_out]
    assert (f"evaluation texts: 1 text ({held_out}) checked; dropped 2 training documents overlapping evaluation "
            f"text: books: {books / 'planted_edition.txt'} (evaluation text {held_out})") in out
    assert f"{books / 'planted_in_anthology.txt'} (evaluation text {held_out})" in out
    line = evaluation_line(load_manifest(tmp_path / "cache"))
    assert line in out
    run_config = tmp_path / "run.yml"
    run_config.write_text(yaml.safe_dump(config_lib.to_dict(config)))
    assert load_script("tools/inspect_data.py").main(["--config", str(run_config), "--num-samples", "8"]) == 0
    assert line in capsys.readouterr().out

    # cached: the one-line summary of a run's start still counts the drop
    prepare_data(config.data, 400, brief_when_cached=True)
    (reused,) = capsys.readouterr().out.strip().splitlines()
    assert "reused" in reused and "1 evaluation text checked, 2 training documents dropped;" in reused


def test_the_shipped_evaluation_books_are_checked_by_default(tmp_path: Path, tokenizer_model: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """data.eval_texts' default, data/eval (train.extrapolation_eval.books' default): a training source holding
    a copy of a shipped PG-19 test book, with its line ends changed, loses it."""
    monkeypatch.chdir(REPO)  # the default is a path relative to the working directory, like data.mix
    books = tmp_path / "books"
    books.mkdir()
    (books / "clean.txt").write_text(_book(1))
    (books / "pg19_copy.txt").write_text((REPO / "data/eval/10146.txt").read_text().replace("\r\n", "\n"))
    (tmp_path / "mix.yml").write_text(f"groups:\n  text: {{weight: 1.0, sources: {{books: {{type: text, "
                                      f"path: {books}}}}}}}\n")
    config = config_lib.from_dict({
        "model": {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "vocab_size": 400},
        "data": {"mix": str(tmp_path / "mix.yml"), "cache_dir": str(tmp_path / "cache"), "num_workers": 1,
                 "tokenizer": {"model": str(tokenizer_model)}}})
    record = prepare_data(config.data, 400, progress=False).sources["books"]
    assert record.documents == 1 and record.skipped.get("overlaps_evaluation_text") == 1, record.skipped


def test_clean_source_loses_nothing(tmp_path: Path, tokenizer_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "held_out.txt").write_text(_gutenberg("HELD OUT", _book(100)), newline="")
    books = tmp_path / "books"
    books.mkdir()
    for seed in (1, 2):
        (books / f"clean_{seed}.txt").write_text(_book(seed))
    (tmp_path / "mix.yml").write_text(f"groups:\n  text: {{weight: 1.0, sources: {{books: {{type: text, "
                                      f"path: {books}}}}}}}\n")
    manifest = prepare_data(_config(tmp_path, tokenizer_model, [str(tmp_path / "eval")]).data, 400)
    assert manifest.sources["books"].documents == 2 and OVERLAPS_EVALUATION not in manifest.sources["books"].skipped
    assert "evaluation texts: 1 text (" in (out := capsys.readouterr().out)
    assert "no training document overlaps them" in out


def test_overlap_rule() -> None:
    """A copy, an excerpt and a book inside a larger document overlap; a quotation in a long document, a
    Gutenberg licence alone and unrelated text do not."""
    book = _book(100)
    fingerprint = EvalFingerprint.of_texts([("held_out", book), ("other", _book(101))])
    assert fingerprint.match(book.upper().replace("\n", "\r\n")) == "held_out"
    assert fingerprint.match(book[len(book) // 3 : len(book) // 2]) == "held_out"  # a sixth of it, alone
    assert fingerprint.match(_book(7, 12000) + book + _book(8, 12000)) == "held_out"
    assert fingerprint.match(_book(7, 12000) + book[:1500] + _book(8, 12000)) is None
    assert fingerprint.match(FOOTER.format(title="X") * 20) is None
    assert fingerprint.match(_book(9)) is None
    assert EvalFingerprint.of_texts([]).match(book) is None


def test_a_datasets_id_is_read_only_when_a_source_is_built(tmp_path: Path) -> None:
    """A cached start needs no hub: a datasets id joins the cache key by its id, and the manifest's record of a
    build with the same texts is kept as it is."""
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "held_out.txt").write_text(_book(100))
    specs = [str(tmp_path / "eval"), "nobody-such/held-out-books"]
    check = EvaluationCheck(specs)  # no network here: constructing it must not read the id
    assert check.key == EvaluationCheck(specs).key != EvaluationCheck(specs[:1]).key
    previous = EvaluationRecord(key=check.key, specs=specs, texts=["held_out.txt", "row 0"])
    assert check.record(previous) is previous
    # a first build that checked nothing (a mix of Megatron shards) names the id without reading it: it builds offline
    assert check.record(None).texts == [str(tmp_path / "eval" / "held_out.txt"), "nobody-such/held-out-books"]
