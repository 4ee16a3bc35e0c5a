"""Passkey retrieval (Mohtashami & Jaggi's landmark-attention test; CoCA paper App. B.1, Listing 1).

prompt = "\\n".join([task, prefix_filler, key_sentence, suffix_filler, question]). The landmark code
sizes the filler in characters; here the prompt is built from token segments so its length is
exactly the requested number of tokens: the filler is one long token stream of the repeated filler
sentence, and the prefix/suffix are its first a/b tokens (a + b fills the budget, a = round(depth *
(a + b))), so a cut can fall inside a word, as "grow, then trim" does in the reference.

A case is correct iff the first 5-digit number (a run of exactly five digits) in the 64 greedily
generated tokens equals the key. The passkey distance is the number of tokens from the start of
the key sentence to the end of the prompt: the span attention must bridge to answer.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from megatron_lite.data.tokenizer import AnyTokenizer
from megatron_lite.eval.generation import generate

TASK = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
        "I will quiz you about the important information there.")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
KEY_SENTENCE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"
KEY_MIN, KEY_MAX = 10000, 99999
NUM_NEW_TOKENS = 64

_FIVE_DIGITS = re.compile(r"(?<!\d)\d{5}(?!\d)")


def first_five_digit_number(text: str) -> int | None:
    match = _FIVE_DIGITS.search(text)
    return int(match.group()) if match else None


def is_correct(output_text: str, key: int) -> bool:
    return first_five_digit_number(output_text) == key


@dataclass(frozen=True)
class PasskeyPrompt:
    token_ids: list[int]
    key: int
    depth: float  # requested depth in [0, 1]: share of the filler placed before the key
    key_start: int  # index of the first token of the key sentence segment

    @property
    def distance(self) -> int:
        return len(self.token_ids) - self.key_start


class PasskeyPromptBuilder:
    """Token segments encoded once per tokenizer; ``build`` assembles a prompt of an exact length."""

    def __init__(self, tokenizer: AnyTokenizer) -> None:
        self.tokenizer = tokenizer
        self.task_ids = tokenizer.encode_prompt(TASK + "\n")  # the prompt starts a document (BOS, if any)
        self.question_ids = tokenizer.encode("\n" + QUESTION)
        self._filler_ids: list[int] = []
        self._filler_repeats = 0

    def key_ids(self, key: int) -> list[int]:
        return self.tokenizer.encode("\n" + KEY_SENTENCE.format(key=key) + "\n")

    def filler_ids(self, num_tokens: int) -> list[int]:
        """The first num_tokens tokens of the filler sentence repeated (encoded as one text)."""
        while len(self._filler_ids) < num_tokens:
            self._filler_repeats = max(16, 2 * self._filler_repeats)
            self._filler_ids = self.tokenizer.encode(" ".join([FILLER] * self._filler_repeats))
        return self._filler_ids[:num_tokens]

    def min_length(self, key: int = KEY_MAX) -> int:
        return len(self.task_ids) + len(self.key_ids(key)) + len(self.question_ids)

    def build(self, length: int, key: int, depth: float) -> PasskeyPrompt:
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth={depth}: must be in [0, 1]")
        key_ids = self.key_ids(key)
        num_filler = length - len(self.task_ids) - len(key_ids) - len(self.question_ids)
        if num_filler < 0:
            raise ValueError(f"--passkey-lengths {length}: shorter than the prompt without filler "
                             f"({length - num_filler} tokens)")
        num_prefix = round(depth * num_filler)
        prefix_ids = self.filler_ids(num_prefix)
        suffix_ids = self.filler_ids(num_filler - num_prefix)
        token_ids = self.task_ids + prefix_ids + key_ids + suffix_ids + self.question_ids
        assert len(token_ids) == length
        return PasskeyPrompt(token_ids, key, depth, key_start=len(self.task_ids) + num_prefix)


def draw_cases(length: int, num_cases: int, seed: int) -> list[tuple[int, float]]:
    """(key, depth) pairs: key uniform in 10000..99999, depth uniform in [0, 1]; one stream per
    (seed, length), so every model and scaling sees the same cases."""
    rng = random.Random(seed * 1_000_003 + length)
    return [(rng.randint(KEY_MIN, KEY_MAX), rng.random()) for _ in range(num_cases)]


@dataclass(frozen=True)
class PasskeyCase:
    length: int
    key: int
    depth: float
    distance: int
    answer: int | None  # first 5-digit number generated
    correct: bool
    output: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@torch.no_grad()
def run_passkey(
    model: Any,
    tokenizer: AnyTokenizer,
    length: int,
    num_cases: int,
    seed: int,
    batch_size: int = 1,
    builder: PasskeyPromptBuilder | None = None,
    on_cases: Callable[[int], None] | None = None,
) -> list[PasskeyCase]:
    """Greedy-decode 64 tokens after each prompt (KV cache; equal-length prompts batch together)."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: must be >= 1 (--batch-size)")
    builder = builder or PasskeyPromptBuilder(tokenizer)
    device = next(model.parameters()).device
    prompts = [builder.build(length, key, depth) for key, depth in draw_cases(length, num_cases, seed)]
    cases: list[PasskeyCase] = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        ids_BT = torch.tensor([prompt.token_ids for prompt in batch], dtype=torch.long, device=device)
        out_BT = generate(model, ids_BT, NUM_NEW_TOKENS, temperature=0.0, eos_token_id=tokenizer.eod_id,
                          vocab_limit=tokenizer.vocab_size)
        for prompt, row in zip(batch, out_BT[:, length:].tolist()):
            output = tokenizer.decode(row)
            answer = first_five_digit_number(output)
            cases.append(PasskeyCase(length, prompt.key, prompt.depth, prompt.distance, answer,
                                     answer == prompt.key, output))
        if on_cases is not None:
            on_cases(len(batch))
    return cases


def summarize_cases(cases: list[PasskeyCase], train_length: int) -> dict[str, Any]:
    """Accuracy overall and split by passkey distance inside / outside the training window."""
    inside = [case for case in cases if case.distance <= train_length]
    outside = [case for case in cases if case.distance > train_length]

    def accuracy(group: list[PasskeyCase]) -> float | None:
        return sum(case.correct for case in group) / len(group) if group else None

    return {"accuracy": accuracy(cases), "cases": len(cases),
            "accuracy_inside": accuracy(inside), "cases_inside": len(inside),
            "accuracy_outside": accuracy(outside), "cases_outside": len(outside)}
