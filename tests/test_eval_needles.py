"""RULER-style needle suite: exact prompt lengths with the needles at their depths (every task), the
string_match_all scorer, identical cases and results under a seed, and a scripted model that answers
right up to a known length, whose effective context length must come out as exactly that length."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from megatron_lite.data.tokenizer import Tokenizer, train_tokenizer
from megatron_lite.eval import long_context
from megatron_lite.eval.needles import (TASKS, DocumentHaystack, NeedlePromptBuilder, NoiseHaystack, draw_specs,
                                        effective_context, run_needles, string_match_all, summarize_needles,
                                        task_names)
from script_loading import load_script
from test_eval_support import (make_checkpoint, single_thread, tokenizer_corpus,  # noqa: F401 (fixture)
                               write_books)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DEPTHS = [0.0, 0.3, 1.0]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The evaluation tests' corpus plus the needle templates, so prompts of ~300 tokens hold every task."""
    lines = [text for task in TASKS for spec in draw_specs(task, 1, 30, seed=99)
             for text in (spec.intro, *spec.needles, spec.question)]
    return train_tokenizer([*tokenizer_corpus(), "\n".join(lines)],
                           tmp_path_factory.mktemp("needle_tokenizer") / "tokenizer.model", 500)


def haystack_of(kind: str, tokenizer: Tokenizer) -> Any:
    if kind == "noise":
        return NoiseHaystack(tokenizer)
    documents = [tokenizer.encode(f"Document {i} says {'abc ' * (20 + 7 * i)}") for i in range(3)]
    return DocumentHaystack(documents)


@pytest.mark.parametrize("haystack_kind", ["noise", "docs"])
@pytest.mark.parametrize("task", TASKS)
def test_prompts_have_the_exact_length_and_the_needles_at_their_depths(tokenizer: Tokenizer, task: str,
                                                                       haystack_kind: str) -> None:
    haystack = haystack_of(haystack_kind, tokenizer)
    builder = NeedlePromptBuilder(tokenizer, haystack)
    specs = draw_specs(task, 400, 6, seed=4, depths=DEPTHS)
    shortest = builder.min_length(specs)
    for spec, extra in zip(specs, [0, 1, 2, 57, 133, 400]):
        length = shortest + extra
        prompt = builder.build(spec, length)
        assert len(prompt.token_ids) == length
        assert spec.depth == DEPTHS[spec.index % len(DEPTHS)] == spec.needle_depths[0]  # the answer needle's
        text = tokenizer.decode(prompt.token_ids)
        assert text.startswith(spec.intro + "\n") and text.endswith("\n" + spec.question)
        num_haystack = prompt.haystack_tokens
        segments = sorted((start, len(builder.needle_ids(needle)), needle)
                          for start, needle in zip(prompt.needle_starts, spec.needles))
        haystack_ids, cursor = [], len(builder._encode("intro", spec.intro))
        for start, size, needle in segments:
            assert tokenizer.decode(prompt.token_ids[start : start + size]) == "\n" + needle + "\n"
            haystack_ids += prompt.token_ids[cursor:start]
            cursor = start + size
        for start, depth in zip(prompt.needle_starts, spec.needle_depths):
            needles_before = sum(size for other, size, _ in segments if other < start)
            haystack_before = start - len(builder._encode("intro", spec.intro)) - needles_before
            assert haystack_before == round(depth * num_haystack)
        haystack_ids += prompt.token_ids[cursor : length - len(builder._encode("question", spec.question))]
        assert haystack_ids == haystack.tokens(num_haystack, spec.index)  # the rest is haystack, in order
        for answer in spec.answers:
            assert answer in text
        if task == "vt":
            assert list(prompt.needle_starts) == sorted(prompt.needle_starts)  # the chain in assignment order
            assert len(spec.answers) == 5 and all(f"VAR {name} = " in text for name in spec.answers)
        else:
            counts = {"niah_single": (1, 1), "niah_multikey": (4, 1), "niah_multivalue": (4, 4),
                      "niah_multiquery": (4, 4)}[task]
            assert (len(spec.needles), len(spec.answers)) == counts
            for needle in spec.needles:
                key = needle.split(" for ")[1].split(" is: ")[0]
                assert (key in spec.question) == (needle.split(" is: ")[1][:-1] in spec.answers)


def test_single_needle_values_cycle_over_numbers_words_and_uuids() -> None:
    specs = draw_specs("niah_single", 512, 6, seed=1)
    assert [spec.value_kind for spec in specs] == ["number", "word", "uuid"] * 2
    number, word, uuid = specs[0].answers[0], specs[1].answers[0], specs[2].answers[0]
    assert number.isdigit() and len(number) == 7
    assert "-" in word and word.replace("-", "").isalpha()
    assert [len(part) for part in uuid.split("-")] == [8, 4, 4, 4, 12] and int(uuid.replace("-", ""), 16) >= 0


def test_too_short_a_length_is_a_user_error(tokenizer: Tokenizer) -> None:
    builder = NeedlePromptBuilder(tokenizer)
    spec = draw_specs("niah_multikey", 300, 1, seed=0)[0]
    builder.build(spec, builder.fixed_length(spec))  # no haystack at all: fits
    with pytest.raises(ValueError, match="--needle-lengths"):
        builder.build(spec, builder.fixed_length(spec) - 1)


def test_cases_are_fixed_by_seed_task_and_length() -> None:
    cases = draw_specs("niah_multivalue", 512, 10, seed=1)
    assert cases == draw_specs("niah_multivalue", 512, 10, seed=1)
    assert cases != draw_specs("niah_multivalue", 512, 10, seed=2)
    assert cases != draw_specs("niah_multivalue", 1024, 10, seed=1)
    assert [c.answers for c in cases] != [c.answers for c in draw_specs("niah_multikey", 512, 10, seed=1)]
    assert [c.depth for c in cases] == [0.0, 0.25, 0.5, 0.75, 1.0] * 2


def test_task_names() -> None:
    assert task_names("all") == list(TASKS) and task_names("none") == [] and task_names("") == []
    assert task_names("vt, niah_single,vt") == ["vt", "niah_single"]
    with pytest.raises(ValueError, match="unknown task 'niah'; valid: all, niah_single, niah_multikey"):
        task_names("niah_single,niah")


@pytest.mark.parametrize("output,answers,score", [
    (" 1234567.", ["1234567"], 1.0),
    (" the value is 7654321", ["1234567"], 0.0),
    (" 1234567, 2345678 and 3456789", ["1234567", "2345678", "3456789", "4567890"], 0.75),
    (" 4567890 3456789 2345678 1234567", ["1234567", "2345678", "3456789", "4567890"], 1.0),
    (" BRIGHT-RIVER", ["bright-river"], 1.0),  # case-insensitive
    (" qwert, asdfg", ["QWERT", "ASDFG", "ZXCVB", "POIUY", "LKJHG"], 0.4),
    ("", ["QWERT"], 0.0),
    (" 123456", ["1234567"], 0.0),  # a prefix is not the string
])
def test_string_match_all(output: str, answers: list[str], score: float) -> None:
    assert string_match_all(output, answers) == pytest.approx(score)


# ----------------------------------------------------------------------------------------------
# A scripted model: the right answers up to a known prompt length, a wrong one beyond


class ScriptedCache:
    def __init__(self, max_length: int) -> None:
        self.max_length = max_length
        self.replies: list[list[int]] = []  # per row: the ids to emit
        self.generated = 0


class ScriptedModel(nn.Module):
    """Answers every prompt it knows with its expected strings while the prompt is at most ``max_correct``
    tokens long, and with "I do not know." beyond; then the end-of-document token."""

    def __init__(self, tokenizer: Tokenizer, answers: dict[tuple[int, ...], list[str]], max_correct: int) -> None:
        super().__init__()
        self.tokenizer, self.answers, self.max_correct = tokenizer, answers, max_correct
        self.weight = nn.Parameter(torch.zeros(1))  # gives the module a device

    def new_cache(self, max_length: int) -> ScriptedCache:
        return ScriptedCache(max_length)

    def reply(self, prompt: list[int]) -> list[int]:
        text = ", ".join(self.answers[tuple(prompt)]) if len(prompt) <= self.max_correct else "I do not know"
        return self.tokenizer.encode(f" {text}.") + [self.tokenizer.eod_id]

    def forward(self, input_ids_BT: torch.Tensor, cache: ScriptedCache, logits_from: int = 0) -> torch.Tensor:
        if not cache.replies:  # the prompt
            cache.replies = [self.reply(row) for row in input_ids_BT.tolist()]
        else:
            cache.generated += 1
        logits_BTV = torch.zeros(*input_ids_BT.shape, self.tokenizer.vocab_size)
        for row, reply in enumerate(cache.replies):
            logits_BTV[row, -1, reply[min(cache.generated, len(reply) - 1)]] = 1.0
        return logits_BTV[:, logits_from:]


def scripted_rows(tokenizer: Tokenizer, lengths: list[int], max_correct: int, cases: int = 3) -> list[dict[str, Any]]:
    builder = NeedlePromptBuilder(tokenizer)
    answers = {tuple(builder.build(spec, length).token_ids): list(spec.answers)
               for task in TASKS for length in lengths for spec in draw_specs(task, length, cases, 7, DEPTHS)}
    model = ScriptedModel(tokenizer, answers, max_correct)
    rows = []
    for task in TASKS:
        for length in lengths:
            found = run_needles(model, tokenizer, task, length, cases, 7, DEPTHS, batch_size=2, builder=builder)
            rows.append({"task": task, "length": length, **summarize_needles(found)})
    return rows


def test_a_scripted_model_gets_exactly_its_effective_context(tokenizer: Tokenizer) -> None:
    lengths = [300, 340, 380, 420, 460]
    rows = scripted_rows(tokenizer, lengths, max_correct=420)
    assert {(r["length"], r["score"], r["all_present"]) for r in rows} == \
        {(n, float(n <= 420), float(n <= 420)) for n in lengths}
    assert [d["depth"] for d in rows[0]["by_depth"]] == DEPTHS
    assert effective_context(rows, 340)["length"] == 420
    assert effective_context(rows, 359)["length"] == 420  # training length not evaluated: reference 340
    assert effective_context(rows, 359)["reference_length"] == 340
    assert effective_context(rows, 460)["length"] is None  # score 0 at the training length
    assert effective_context(rows, 460)["reference_score"] == 0.0
    assert effective_context(rows, 299) == {"length": None, "training_length": 299, "reference_length": None,
                                            "reference_score": None, "threshold": None}


def rows_with(scores: dict[int, float]) -> list[dict[str, Any]]:
    return [{"task": "vt", "length": length, "score": score} for length, score in scores.items()]


@pytest.mark.parametrize("scores,training_length,expected", [
    ({256: 1.0, 512: 1.0, 1024: 0.3, 2048: 1.0}, 512, 512),  # a dip ends the run: 2048 does not count
    ({256: 0.8, 512: 0.8, 1024: 0.72, 2048: 0.71}, 512, 1024),  # threshold 0.9 x 0.8 = 0.72
    ({256: 1.0, 512: 0.55, 1024: 0.5, 2048: 0.49}, 512, 1024),  # threshold max(0.495, 0.5) = 0.5
    ({256: 1.0, 512: 0.49, 1024: 0.49}, 512, None),  # training-length score below 0.5
    ({256: 1.0, 512: 0.2}, 4096, None),  # reference = 512 (longest evaluated below 4096)
    ({256: 1.0, 512: 0.2}, 300, 256),  # reference = 256
])
def test_effective_context_rule(scores: dict[int, float], training_length: int, expected: int | None) -> None:
    assert effective_context(rows_with(scores), training_length)["length"] == expected


def test_the_effective_length_averages_the_tasks() -> None:
    rows = rows_with({512: 1.0, 1024: 1.0}) + [{"task": "niah_single", "length": n, "score": s}
                                               for n, s in [(512, 1.0), (1024, 0.7)]]
    assert effective_context(rows, 512)["length"] == 512  # mean 0.85 < 0.9
    rows[-1]["score"] = 0.8
    assert effective_context(rows, 512)["length"] == 1024  # mean 0.9


# ----------------------------------------------------------------------------------------------
# The tool end to end on a tiny trained checkpoint


@pytest.fixture(scope="module")
def checkpoint(tokenizer: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("needle_model") / "rope", tokenizer, "rope", steps=5)


def needle_args(checkpoint: Path, out: Path, *extra: str) -> list[str]:
    return ["--checkpoints", f"tiny={checkpoint}", "--out", str(out), "--needles", "niah_single,vt",
            "--needle-lengths", "240,260", "--needle-cases", "2", "--needle-depths", "0,1", "--seed", "3",
            "--batch-size", "2", "--scaling", "none,linear:2", "--quiet", *extra]


def test_tool_needle_results_are_reproducible_and_resume(checkpoint: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    tool = load_script("tools/eval_long_context.py")
    assert tool.main(needle_args(checkpoint, tmp_path / "a")) == 0
    assert tool.main(needle_args(checkpoint, tmp_path / "b")) == 0
    first = json.loads((tmp_path / "a" / "results.json").read_text())
    second = json.loads((tmp_path / "b" / "results.json").read_text())
    assert first["needles"] == second["needles"] and first["effective_context"] == second["effective_context"]
    for name in ("tables.md", "needle_cases.json"):
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text()
    assert (tmp_path / "a" / "needles_heatmap.png").read_bytes()[:8] == PNG_MAGIC

    assert [(r["model"], r["scaling"], r["task"], r["length"], r["cases"]) for r in first["needles"]] == \
        [("tiny", s, t, n, 2) for s in ("none", "linear:2") for t in ("niah_single", "vt") for n in (240, 260)]
    assert all(0.0 <= r["score"] <= 1.0 for r in first["needles"])
    # training length 32: no evaluated length at or below it, so no reference and no effective length
    assert first["effective_context"] == [
        {"model": "tiny", "scaling": s, "length": None, "training_length": 32, "reference_length": None,
         "reference_score": None, "threshold": None} for s in ("none", "linear:2")]
    cases = json.loads((tmp_path / "a" / "needle_cases.json").read_text())
    assert len(cases) == 16 and {c["depth"] for c in cases} == {0.0, 1.0}
    tables = (tmp_path / "a" / "tables.md").read_text()
    assert "| model | train length | scaling | task | 240 | 260 |" in tables
    assert "| tiny | rope | linear:2 | none | 32 | – | – | – |" in tables

    def no_needles(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("needle results are cached")

    monkeypatch.setattr(long_context, "run_needles", no_needles)
    (tmp_path / "a" / "results.json").unlink()
    assert tool.main(needle_args(checkpoint, tmp_path / "a")) == 0
    assert json.loads((tmp_path / "a" / "results.json").read_text())["needles"] == first["needles"]


@pytest.mark.parametrize("extra,named", [
    (["--needles", "niah_single,needle"], "valid: all, niah_single, niah_multikey"),
    (["--needle-lengths", ""], "--needle-lengths"),
    (["--needle-depths", "0,1.5"], "--needle-depths"),
    (["--needle-depths", "0,x"], "--needle-depths"),
    (["--needle-cases", "0"], "--needle-cases"),
    (["--needle-haystack", "docs"], "--ppl-docs"),
    (["--needle-haystack", "books"], "--needle-haystack"),
    (["--needle-lengths", "100"], "--needle-lengths 100"),
])
def test_flag_errors(checkpoint: Path, tmp_path: Path, extra: list[str], named: str,
                     capsys: pytest.CaptureFixture[str]) -> None:
    tool = load_script("tools/eval_long_context.py")
    assert tool.main(needle_args(checkpoint, tmp_path, *extra)) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and len(error.strip().splitlines()) == 1 and named in error, error


def test_the_docs_haystack_is_the_ppl_documents(checkpoint: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    haystacks: list[Any] = []
    real = long_context.run_needles

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        haystacks.append(args[8].haystack)  # the builder
        return real(*args, **kwargs)

    monkeypatch.setattr(long_context, "run_needles", recording)
    books = write_books(tmp_path / "books", [40, 50], gutenberg=False)
    tool = load_script("tools/eval_long_context.py")
    assert tool.main(["--checkpoints", str(checkpoint), "--out", str(tmp_path / "out"), "--ppl-docs", str(books),
                      "--windows", "32", "--stride", "32", "--max-doc-tokens", "128", "--needles", "niah_single",
                      "--needle-lengths", "240", "--needle-cases", "1", "--needle-haystack", "docs", "--quiet"]) == 0
    assert len(haystacks) == 1 and isinstance(haystacks[0], DocumentHaystack)
    assert [len(doc) for doc in haystacks[0].documents] == [128, 128]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["settings"]["needle_haystack"] == "docs" and len(results["needles"]) == 1
