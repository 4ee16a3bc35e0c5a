"""Passkey retrieval: exact prompt lengths, the key once at the requested depth, the scorer, and the
generation loop end to end with stand-in models that do / do not copy the key (acceptance 2)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from megatron_lite.data.tokenizer import Tokenizer
from megatron_lite.eval.passkey import (FILLER, KEY_SENTENCE, QUESTION, TASK, PasskeyPromptBuilder, draw_cases,
                                        first_five_digit_number, is_correct, run_passkey, summarize_cases)
from test_eval_support import make_tokenizer, single_thread  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return make_tokenizer(tmp_path_factory.mktemp("passkey_tokenizer"))


@pytest.mark.parametrize("extra", [0, 1, 2, 131, 800])
@pytest.mark.parametrize("depth", [0.0, 0.37, 0.5, 1.0])
def test_prompt_has_the_exact_length_and_the_key_once_at_its_depth(tokenizer: Tokenizer, extra: int,
                                                                   depth: float) -> None:
    builder = PasskeyPromptBuilder(tokenizer)
    length = builder.min_length() + extra  # extra = filler tokens
    key = 40000 + length
    prompt = builder.build(length, key, depth)
    assert len(prompt.token_ids) == length
    text = tokenizer.decode(prompt.token_ids)
    assert text.startswith(TASK + "\n") and text.endswith("\n" + QUESTION)
    sentence = "\n" + KEY_SENTENCE.format(key=key) + "\n"
    assert text.count(sentence) == 1 and text.count(str(key)) == 2  # the sentence names K twice
    assert re.findall(r"\d+", text) == [str(key), str(key)]  # no other number anywhere
    # The key sentence starts where `depth` of the filler lies before it.
    num_filler = length - len(builder.task_ids) - len(builder.key_ids(key)) - len(builder.question_ids)
    num_prefix = prompt.key_start - len(builder.task_ids)
    assert abs(num_prefix - depth * num_filler) <= 0.5
    key_segment = prompt.token_ids[prompt.key_start : prompt.key_start + len(builder.key_ids(key))]
    assert tokenizer.decode(key_segment) == sentence
    assert prompt.distance == length - prompt.key_start
    filler_text = tokenizer.decode(prompt.token_ids[len(builder.task_ids) : prompt.key_start])
    assert (FILLER + " " + FILLER).startswith(filler_text[: 2 * len(FILLER)])


def test_too_short_a_prompt_is_a_user_error(tokenizer: Tokenizer) -> None:
    builder = PasskeyPromptBuilder(tokenizer)
    builder.build(builder.min_length(), 12345, 0.5)  # exactly the fixed parts: fits
    with pytest.raises(ValueError, match="--passkey-lengths"):
        builder.build(builder.min_length() - 1, 12345, 0.5)


def test_cases_are_uniform_draws_fixed_by_seed_and_length() -> None:
    cases = draw_cases(512, 400, seed=1)
    assert cases == draw_cases(512, 400, seed=1)
    assert cases != draw_cases(512, 400, seed=2) and cases != draw_cases(1024, 400, seed=1)
    keys, depths = [k for k, _ in cases], [d for _, d in cases]
    assert all(10000 <= k <= 99999 for k in keys) and all(0.0 <= d <= 1.0 for d in depths)
    assert min(depths) < 0.1 and max(depths) > 0.9 and len(set(keys)) > 390


@pytest.mark.parametrize("output,key,expected", [
    (" 12345. Remember it.", 12345, True),
    ("12345", 12345, True),
    ("is 12345 and 99999", 12345, True),
    (" The pass key is 54321. 12345", 12345, False),  # the first 5-digit number decides
    (" 123456", 12345, False),  # six digits are not a 5-digit number
    (" 123456 then 12345", 12345, True),
    (" 1234", 12345, False),
    (" 1 2 3 4 5", 12345, False),
    ("", 12345, False),
    (" 12346", 12345, False),
])
def test_scorer(output: str, key: int, expected: bool) -> None:
    assert is_correct(output, key) is expected


def test_first_five_digit_number() -> None:
    assert first_five_digit_number("a 7 b 100000 c 31415 d 27182") == 31415
    assert first_five_digit_number("no digits") is None


class StandInCache:
    def __init__(self, max_length: int) -> None:
        self.max_length = max_length
        self.history: torch.Tensor | None = None  # (B, T) every id seen so far


class KeyCopier(nn.Module):
    """Reads the key from the prompt and spells ' K. Remember it.' (or a wrong key): a stand-in for a
    model with perfect (or broken) retrieval, so the loop and the scorer are checked end to end."""

    def __init__(self, tokenizer: Tokenizer, offset: int = 0, padding: int = 0) -> None:
        super().__init__()
        self.tokenizer, self.offset, self.padding = tokenizer, offset, padding
        self.weight = nn.Parameter(torch.zeros(1))  # gives the module a device

    def new_cache(self, max_length: int) -> StandInCache:
        return StandInCache(max_length)

    def forward(self, input_ids_BT: torch.Tensor, cache: StandInCache, logits_from: int = 0) -> torch.Tensor:
        history = input_ids_BT if cache.history is None else torch.cat([cache.history, input_ids_BT], dim=1)
        assert history.shape[1] <= cache.max_length
        cache.history = history
        logits_BTV = torch.zeros(*input_ids_BT.shape, self.tokenizer.vocab_size + self.padding)
        logits_BTV[..., self.tokenizer.vocab_size:] = 2.0  # padded ids (make_vocab_size_divisible_by) rank first
        for row, ids in enumerate(history.tolist()):
            prompt_text = self.tokenizer.decode(ids[: cache.max_length - 64])
            key = int(re.search(r"pass key is (\d{5})", prompt_text).group(1)) + self.offset
            answer = self.tokenizer.encode(f" {key}. Remember it.") + [self.tokenizer.eod_id]
            generated = len(ids) - (cache.max_length - 64)
            logits_BTV[row, -1, answer[min(generated, len(answer) - 1)]] = 1.0
        return logits_BTV[:, logits_from:]


@pytest.mark.parametrize("offset,expected_accuracy,padding", [(0, 1.0, 0), (1, 0.0, 0), (0, 1.0, 37)])
def test_run_passkey_scores_generated_answers(tokenizer: Tokenizer, offset: int, expected_accuracy: float,
                                              padding: int) -> None:
    """With a padded vocabulary whose padding ids score highest, only the tokenizer's ids are generated."""
    cases = run_passkey(KeyCopier(tokenizer, offset, padding), tokenizer, length=300, num_cases=6, seed=3, batch_size=4)
    assert [(c.key, c.depth) for c in cases] == draw_cases(300, 6, seed=3)
    assert all(c.output.startswith(f" {c.key + offset}. Remember it.") for c in cases)
    summary = summarize_cases(cases, train_length=150)
    assert summary["accuracy"] == expected_accuracy and summary["cases"] == 6
    inside = [c for c in cases if c.distance <= 150]
    assert summary["cases_inside"] == len(inside) and summary["cases_outside"] == 6 - len(inside)
    assert all(c.correct == (c.answer == c.key) for c in cases)
