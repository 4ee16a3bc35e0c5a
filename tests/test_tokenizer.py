"""SentencePiece tokenizer: specials, exact round trip on code, mix sampling, caching, CLI."""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path

import pytest

from megatron_lite import config as config_lib
from megatron_lite.data import tokenizer as tokenizer_lib
from megatron_lite.data.mix import load_mix
from megatron_lite.data.sample_corpus import stdlib_dir
from megatron_lite.data.tokenizer import (EOD_ID, PAD_ID, Tokenizer, ensure_tokenizer, sample_mix, train_tokenizer,
                                          training_sentences)
from script_loading import load_script

STDLIB_FILES = ["textwrap.py", "json/decoder.py", "tokenize.py", "string.py", "difflib.py"]
WORDS = "the of and to in is was for on that with as by at from his her it an were are which this be".split()

HANDMADE = [
    "def f(x):\n\tif x:\n\t\treturn  x  \n\n\n    # four spaces, then a tab:\t\n",
    "class A:\n    def m(self):\n        pass   \n\n\n\n",  # trailing spaces and blank lines
    "  leading spaces\ttab\t\ttabs\n",
    "   ",  # whitespace only
    "\n\n\nstarts with newlines and ends without",
    "Unicode: café naïve Ærøskøbing ß Ελληνικά Кириллица 中文字符 日本語 한국어 emoji 😀🐍 e\u0301 \u200b zero-width",
    "windows\r\nline\rends and a form feed \x0c and a NUL \x00 and DEL \x7f",
    "numbers 1234567890 3.14159 0xFF 1e-5",
    "literal specials: <|endoftext|> <|pad|> <unk> <s> </s>",
    "",
]


def _prose(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(60)).capitalize() + ".\n" for _ in range(n)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    code = [(stdlib_dir() / name).read_text(encoding="utf-8") for name in STDLIB_FILES[:2]]
    path = tmp_path_factory.mktemp("tok") / "t.model"
    return train_tokenizer(code + _prose(50) + HANDMADE[:2], path, vocab_size=400)


def test_specials_have_fixed_ids(tok: Tokenizer) -> None:
    assert (tok.eod_id, tok.pad_id, tok.vocab_size) == (EOD_ID, PAD_ID, 400) == (0, 1, 400)
    assert [tok.id_to_piece(i) for i in range(3)] == ["<|endoftext|>", "<|pad|>", "<unk>"]
    ids = tok.encode("a <|endoftext|> b")
    assert EOD_ID not in ids and PAD_ID not in ids  # literal text never fakes a document boundary
    assert tok.decode(ids + [EOD_ID]) == "a <|endoftext|> b"  # control pieces decode to nothing


@pytest.mark.parametrize("text", HANDMADE)
def test_round_trip_handmade(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert 2 not in ids  # byte fallback: never <unk>
    assert tok.decode(ids) == text


@pytest.mark.parametrize("name", STDLIB_FILES)
def test_round_trip_stdlib_sources(tok: Tokenizer, name: str) -> None:
    text = (stdlib_dir() / name).read_text(encoding="utf-8")
    assert tok.decode(tok.encode(text)) == text
    tabbed = text.replace("    ", "\t")  # the stdlib has no tabs; make some
    assert tok.decode(tok.encode(tabbed)) == tabbed


def test_code_safe_pieces(tok: Tokenizer) -> None:
    """Newlines are ordinary characters inside pieces, indentation has whitespace-only pieces,
    digits are split."""
    pieces = [tok.id_to_piece(i) for i in range(tok.vocab_size)]
    assert any("\n" in p and len(p) > 1 for p in pieces)
    assert "▁▁▁▁" in pieces
    assert not any(len(p) > 1 and any(c.isdigit() for c in p) for p in pieces if not p.startswith("<0x"))
    assert tok.encode_batch(["x\n", "y"]) == [tok.encode("x\n"), tok.encode("y")]


def test_pickles_by_path(tok: Tokenizer) -> None:
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.path == tok.path and clone.encode("def x():\n") == tok.encode("def x():\n")


def test_training_errors_are_value_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size=100: must be >= "):
        train_tokenizer(["abc"], tmp_path / "a.model", vocab_size=100)
    with pytest.raises(ValueError, match="vocab_size=5000.*raise data.tokenizer.sample_chars"):
        train_tokenizer(["tiny sample"], tmp_path / "b.model", vocab_size=5000)
    assert not (tmp_path / "b.model").exists()
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="junk.model: not a SentencePiece model"):
        Tokenizer(tmp_path / "junk.model")
    many_chars = "".join(chr(c) for c in range(0x4E00, 0x4E00 + 400)) * 3  # 400 distinct CJK characters
    with pytest.raises(ValueError, match="vocab_size=300.*raise the vocabulary size"):
        train_tokenizer([many_chars], tmp_path / "c.model", vocab_size=300)


def test_training_sentences_keep_every_character() -> None:
    text = "line one\n" + "x" * 25 + "\nend"
    chunks = list(training_sentences([text], chunk_chars=10))
    assert "".join(chunks) == text and max(map(len, chunks)) <= 10


# ----------------------------------------------------------------------------------------------
# Sampling the mix and the cached tokenizer


def _write_mix(tmp_path: Path, text_docs: list[str], code_docs: list[str]) -> Path:
    for name, docs in (("text", text_docs), ("code", code_docs)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    mix = tmp_path / "mix.yml"
    mix.write_text(
        "groups:\n"
        f"  text: {{weight: 3, sources: {{prose: {{type: jsonl, path: {tmp_path / 'text.jsonl'}}}}}}}\n"
        f"  code: {{weight: 1, sources: {{py: {{type: jsonl, path: {tmp_path / 'code.jsonl'}}}}}}}\n")
    return mix


def _code_docs() -> list[str]:
    return [(stdlib_dir() / name).read_text(encoding="utf-8") for name in STDLIB_FILES]


def test_sample_follows_group_proportions(tmp_path: Path) -> None:
    mix = load_mix(_write_mix(tmp_path, _prose(400), _code_docs()))
    sample = sample_mix(mix, 40_000, progress=False)
    sizes = {name: sum(map(len, texts)) for name, texts in sample.items()}
    assert sizes == {"prose": 30_000, "py": 10_000}
    # Text runs short (about 8k chars of prose): every group shrinks by the same factor.
    small = load_mix(_write_mix(tmp_path, _prose(20), _code_docs()))
    sizes = {name: sum(map(len, texts)) for name, texts in sample_mix(small, 40_000, progress=False).items()}
    assert sizes["prose"] == pytest.approx(3 * sizes["py"], abs=2) and sizes["prose"] < 30_000


def _config(tmp_path: Path, vocab_size: int = 400, **data: object) -> config_lib.Config:
    mix = _write_mix(tmp_path, _prose(200), _code_docs())
    return config_lib.from_dict({
        "model": {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "vocab_size": vocab_size},
        "data": {"mix": str(mix), "cache_dir": str(tmp_path / "cache"), "num_workers": 1,
                 "tokenizer": {"sample_chars": 60_000}, **data},
    })


def test_ensure_tokenizer_trains_once_and_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config(tmp_path)
    first = ensure_tokenizer(config.data, config.model.vocab_size, progress=False)
    assert first.path == tmp_path / "cache/tokenizer/tokenizer.model" and first.vocab_size == 400

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("retrained although nothing changed")

    monkeypatch.setattr(tokenizer_lib, "train_from_mix", fail)
    assert ensure_tokenizer(config.data, config.model.vocab_size, progress=False).sha256 == first.sha256
    monkeypatch.undo()
    bigger = config_lib.from_dict({**config_lib.to_dict(config), "model": {**config_lib.to_dict(config)["model"],
                                                                            "vocab_size": 420}})
    assert ensure_tokenizer(bigger.data, bigger.model.vocab_size, progress=False).vocab_size == 420  # spec changed: retrained


def test_ensure_tokenizer_copies_a_given_model(tmp_path: Path, tok: Tokenizer) -> None:
    config = _config(tmp_path, tokenizer={"model": str(tok.path)})
    copied = ensure_tokenizer(config.data, config.model.vocab_size, progress=False)
    assert copied.path == tmp_path / "cache/tokenizer/tokenizer.model" and copied.sha256 == tok.sha256
    small = _config(tmp_path, vocab_size=300, tokenizer={"model": str(tok.path)})
    with pytest.raises(ValueError, match="model.vocab_size=300: tokenizer .* has 400 pieces"):
        ensure_tokenizer(small.data, small.model.vocab_size, progress=False)
    missing = _config(tmp_path, tokenizer={"model": "/nonexistent.model"})
    with pytest.raises(ValueError, match="data.tokenizer.model='/nonexistent.model': file does not exist"):
        ensure_tokenizer(missing.data, missing.model.vocab_size, progress=False)


def test_train_tokenizer_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(tmp_path)
    config_path = tmp_path / "run.yml"
    config_lib.save(config, config_path)
    cli = load_script("tools/train_tokenizer.py")
    assert cli.main(["--config", str(config_path), "--vocab-size", "380", "--out", str(tmp_path / "out")]) == 0
    assert Tokenizer(tmp_path / "out/tokenizer.model").vocab_size == 380
    assert "380 pieces" in capsys.readouterr().out
    assert cli.main(["--config", str(config_path), "--vocab-size", "10"]) == 2  # every CLI: a user error is 2
    assert "vocab_size=10: must be >=" in capsys.readouterr().err
