"""RULER-style needle suite (Hsieh et al. 2024, "RULER: What's the real context size of your
long-context language models?"): synthetic retrieval tasks with exact token lengths and depths.

Tasks (``TASKS``), RULER's templates shortened so a prompt fits in a few hundred tokens:

* ``niah_single``: one needle "One of the special magic {kind} for {key} is: {value}." The value
  kind cycles over the cases: a 7-digit number, a word pair from a built-in list, a UUID-like hex
  string (36 characters, from the seeded generator) — RULER's niah_single_1/2/3 in one task.
* ``niah_multikey``: the real needle plus 3 distractor needles with other keys (7-digit values).
* ``niah_multivalue``: 4 needles for the same key; all 4 values must be returned.
* ``niah_multiquery``: 4 needles with 4 keys; all 4 keys are asked at once.
* ``vt`` (variable tracking): one chain "VAR A = 12345", "VAR B = VAR A", ... (4 hops, 5 names of 5
  capital letters); every name bound to the value must be returned.

Keys are word pairs ("bright-river"). The prompt is ``intro + haystack-with-needles + question``,
built from token segments so its length is exactly the requested number of tokens. The haystack is
the passkey filler sentence repeated (``NoiseHaystack``) or a token stream of evaluation documents
(``DocumentHaystack``); needles go in at token positions (RULER inserts at sentence boundaries; a
cut here may fall inside a word, as in the passkey prompt). Depth d of a needle: round(d * H)
haystack tokens lie before it, H = haystack tokens in the prompt.

Depths: each case has one requested depth (the cases of a task x length cycle over ``depths``). The
answer needle — the single needle, the real key's needle, the first value, the first key asked, the
chain's "VAR X1 = value" — is placed at it; the other needles at seeded-random depths in [0, 1]
(niah, as RULER places every needle at random) or, for ``vt``, at sorted random depths in [d, 1],
so the chain reads in assignment order.

Scoring is RULER's ``string_match_all`` for all five tasks: the score of a case is the fraction of
the expected strings found (case-insensitive substring) in the generated text (greedy decoding, up
to ``NEW_TOKENS[task]`` tokens, cut at the end-of-document token); a task x length scores the mean
over its cases. A case is "correct" when every expected string is present (score 1).

Every (seed, task, length) has its own random stream, so every model and scaling sees identical cases.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch

from megatron_lite.data.tokenizer import AnyTokenizer
from megatron_lite.eval.generation import generate
from megatron_lite.eval.passkey import FILLER, TASK

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt")
VALUE_KINDS = ("number", "word", "uuid")  # niah_single cycles over them; the multi-needle tasks use numbers
KIND_NOUNS = {"number": "numbers", "word": "words", "uuid": "uuids"}
NUM_NEEDLES = 4  # RULER's defaults: 4 keys (multikey, multiquery) or values (multivalue)
VT_HOPS = 4  # RULER's default: one chain, 4 hops, 5 variable names
NEW_TOKENS = {"niah_single": 128, "niah_multikey": 128, "niah_multivalue": 128, "niah_multiquery": 128, "vt": 64}
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
SCORE_TOLERANCE = 1e-9  # float rounding: 0.72 meets 0.9 x 0.8 (= 0.7200000000000001)

NIAH_NEEDLE = "One of the special magic {kind} for {key} is: {value}."
NIAH_QUESTION = ("What are all the special magic {kind} for {query} mentioned in the text? "
                 "The special magic {kind} for {query} mentioned in the text are")
VT_INTRO = "Memorize and track the chain of variable assignment hidden in the following text."
VT_FIRST = "VAR {name} = {value}"
VT_HOP = "VAR {name} = VAR {previous}"
VT_QUESTION = ("Question: Find all variables that are assigned the value {value} in the text above. "
               "Answer: According to the chain of variable assignment in the text above, {count} variables are "
               "assigned the value {value}, they are:")

ADJECTIVES = ("bright quiet brave calm eager fancy gentle happy jolly kind lively proud silly witty "
              "ancient bitter clever curious dusty frozen golden hollow humble icy lucky misty noble "
              "rapid rusty scarlet shiny sleepy smooth sour stormy sunny tender velvet wild").split()
NOUNS = ("river apple badger candle dragon falcon garden harbor island jacket kettle lantern meadow "
         "needle orchard pebble quill rabbit saddle tiger umbrella valley walnut yacht zebra anchor "
         "basket castle desert engine forest glacier hammer igloo jungle ladder mirror").split()


def task_names(text: str) -> list[str]:
    """``--needles`` value: "all", "none"/"" or a comma list of TASKS (order kept, duplicates dropped)."""
    text = text.strip()
    if text in ("", "none"):
        return []
    if text == "all":
        return list(TASKS)
    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in TASKS]
    if unknown:
        raise ValueError(f"--needles {text!r}: unknown task {unknown[0]!r}; valid: all, {', '.join(TASKS)}")
    return list(dict.fromkeys(names))


# ----------------------------------------------------------------------------------------------
# Cases: what goes into a prompt (text only; drawn from the seeded stream)


@dataclass(frozen=True)
class NeedleSpec:
    """One case before tokenisation: the needle sentences, where they go, the question and the answers."""

    task: str
    index: int  # case number within (task, length): picks the haystack offset
    depth: float  # requested depth of the answer needle
    value_kind: str
    intro: str
    needles: tuple[str, ...]
    needle_depths: tuple[float, ...]  # one per needle; the answer needle's is ``depth``
    question: str
    answers: tuple[str, ...]  # every one must appear in the output for a full score


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _word(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def _uuid(rng: random.Random) -> str:
    digits = f"{rng.getrandbits(128):032x}"
    return "-".join([digits[:8], digits[8:12], digits[12:16], digits[16:20], digits[20:]])


VALUE_DRAWS: dict[str, Callable[[random.Random], str]] = {"number": _number, "word": _word, "uuid": _uuid}


def _distinct(draw: Callable[[], str], count: int, taken: set[str]) -> list[str]:
    values: list[str] = []
    while len(values) < count:
        value = draw()
        if value not in taken:
            taken.add(value)
            values.append(value)
    return values


def _join_keys(keys: Sequence[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


def _niah_spec(task: str, index: int, depth: float, rng: random.Random) -> NeedleSpec:
    kind = VALUE_KINDS[index % len(VALUE_KINDS)] if task == "niah_single" else "number"
    taken: set[str] = set()
    num_keys = NUM_NEEDLES if task in ("niah_multikey", "niah_multiquery") else 1
    num_values = NUM_NEEDLES if task == "niah_multivalue" else 1
    keys = _distinct(lambda: _word(rng), num_keys, taken)
    pairs = [(key, value) for key in keys
             for value in _distinct(lambda: VALUE_DRAWS[kind](rng), num_values, taken)]
    asked = keys if task == "niah_multiquery" else keys[:1]
    answers = [value for key, value in pairs if key in asked]
    nouns = KIND_NOUNS[kind]
    needles = [NIAH_NEEDLE.format(kind=nouns, key=key, value=value) for key, value in pairs]
    depths = [depth] + [rng.random() for _ in needles[1:]]  # the answer needle comes first in ``pairs``
    query = _join_keys(asked)
    return NeedleSpec(task, index, depth, kind, TASK, tuple(needles), tuple(depths),
                      NIAH_QUESTION.format(kind=nouns, query=query), tuple(answers))


def _vt_spec(index: int, depth: float, rng: random.Random) -> NeedleSpec:
    value = str(rng.randint(10000, 99999))
    names = _distinct(lambda: "".join(rng.choices(string.ascii_uppercase, k=5)), VT_HOPS + 1, set())
    needles = [VT_FIRST.format(name=names[0], value=value)]
    needles += [VT_HOP.format(name=name, previous=previous) for previous, name in zip(names, names[1:])]
    depths = [depth] + sorted(depth + (1.0 - depth) * rng.random() for _ in names[1:])
    question = VT_QUESTION.format(value=value, count=len(names))
    return NeedleSpec("vt", index, depth, "variable", VT_INTRO, tuple(needles), tuple(depths), question, tuple(names))


def draw_specs(task: str, length: int, num_cases: int, seed: int,
               depths: Sequence[float] = DEFAULT_DEPTHS) -> list[NeedleSpec]:
    """``num_cases`` cases of ``task``; case i asks at depths[i % len(depths)]. One random stream per
    (seed, task, length), so every model and scaling sees the same cases."""
    if task not in TASKS:
        raise ValueError(f"--needles {task!r}: unknown task; valid: {', '.join(TASKS)}")
    if not depths or any(not 0.0 <= depth <= 1.0 for depth in depths):
        raise ValueError(f"--needle-depths {','.join(map(str, depths))}: each must be in [0, 1]")
    rng = random.Random(f"needles/{seed}/{task}/{length}")
    specs = []
    for index in range(num_cases):
        depth = depths[index % len(depths)]
        specs.append(_vt_spec(index, depth, rng) if task == "vt" else _niah_spec(task, index, depth, rng))
    return specs


# ----------------------------------------------------------------------------------------------
# Haystacks and prompts (token segments, so lengths are exact)


class Haystack(Protocol):
    name: str

    def tokens(self, num_tokens: int, offset: int) -> list[int]:
        """``num_tokens`` haystack token ids; ``offset`` (the case number) may vary where they start."""
        ...


class NoiseHaystack:
    """The passkey filler sentence repeated (RULER's "noise" haystack); the same tokens for every case."""

    name = "noise"

    def __init__(self, tokenizer: AnyTokenizer) -> None:
        self.tokenizer = tokenizer
        self._ids: list[int] = []
        self._repeats = 0

    def tokens(self, num_tokens: int, offset: int = 0) -> list[int]:
        while len(self._ids) < num_tokens:
            self._repeats = max(16, 2 * self._repeats)
            self._ids = self.tokenizer.encode(" ".join([FILLER] * self._repeats))
        return self._ids[:num_tokens]


class DocumentHaystack:
    """Evaluation documents (``--ppl-docs``) as one token stream: case i starts at document i (mod the
    count) and runs on through the next ones, wrapping around, for as many tokens as needed."""

    def __init__(self, documents: Sequence[Sequence[int]], name: str = "docs", prefix_ids: Sequence[int] = ()) -> None:
        prefix = list(prefix_ids)  # a BOS starts each document: not part of the haystack text
        self.documents = [list(doc)[len(prefix):] if prefix and list(doc)[: len(prefix)] == prefix else list(doc)
                          for doc in documents]
        self.documents = [doc for doc in self.documents if doc]
        if not self.documents:
            raise ValueError("--needle-haystack docs: the --ppl-docs documents hold no tokens")
        self.name = name

    def tokens(self, num_tokens: int, offset: int = 0) -> list[int]:
        ids: list[int] = []
        index = offset
        while len(ids) < num_tokens:
            ids.extend(self.documents[index % len(self.documents)])
            index += 1
        return ids[:num_tokens]


@dataclass(frozen=True)
class NeedlePrompt:
    spec: NeedleSpec
    token_ids: list[int]
    needle_starts: tuple[int, ...]  # index of each needle segment's first token, in ``spec.needles`` order
    haystack_tokens: int  # H: haystack tokens in the prompt (needle j has round(depth_j * H) before it)


class NeedlePromptBuilder:
    """Fixed segments encoded once per tokenizer; ``build`` assembles a prompt of an exact length."""

    def __init__(self, tokenizer: AnyTokenizer, haystack: Haystack | None = None) -> None:
        self.tokenizer = tokenizer
        self.haystack: Haystack = haystack or NoiseHaystack(tokenizer)
        self._cache: dict[tuple[str, str], list[int]] = {}

    def _encode(self, part: str, text: str) -> list[int]:
        if (part, text) not in self._cache:
            if part == "intro":  # the prompt starts a document (BOS, if any)
                self._cache[(part, text)] = self.tokenizer.encode_prompt(text + "\n")
            elif part == "needle":
                self._cache[(part, text)] = self.tokenizer.encode("\n" + text + "\n")
            else:
                self._cache[(part, text)] = self.tokenizer.encode("\n" + text)
        return self._cache[(part, text)]

    def needle_ids(self, text: str) -> list[int]:
        return self._encode("needle", text)

    def fixed_length(self, spec: NeedleSpec) -> int:
        """Tokens of the prompt without haystack."""
        return (len(self._encode("intro", spec.intro)) + sum(len(self.needle_ids(n)) for n in spec.needles)
                + len(self._encode("question", spec.question)))

    def build(self, spec: NeedleSpec, length: int) -> NeedlePrompt:
        intro_ids, question_ids = self._encode("intro", spec.intro), self._encode("question", spec.question)
        num_haystack = length - self.fixed_length(spec)
        if num_haystack < 0:
            raise ValueError(f"--needle-lengths {length}: shorter than the {spec.task} prompt without haystack "
                             f"({length - num_haystack} tokens)")
        haystack = self.haystack.tokens(num_haystack, spec.index)
        cuts = [round(depth * num_haystack) for depth in spec.needle_depths]
        order = sorted(range(len(spec.needles)), key=lambda j: (cuts[j], j))  # ties keep needle order
        token_ids, starts, previous = list(intro_ids), [0] * len(cuts), 0
        for j in order:
            token_ids += haystack[previous : cuts[j]]
            starts[j], previous = len(token_ids), cuts[j]
            token_ids += self.needle_ids(spec.needles[j])
        token_ids += haystack[previous:] + question_ids
        assert len(token_ids) == length
        return NeedlePrompt(spec, token_ids, tuple(starts), num_haystack)

    def min_length(self, specs: Sequence[NeedleSpec]) -> int:
        """The longest no-haystack prompt of these cases: a shorter length cannot hold them all."""
        return max(self.fixed_length(spec) for spec in specs)


# ----------------------------------------------------------------------------------------------
# Scoring and the generation loop


def string_match_all(output: str, answers: Sequence[str]) -> float:
    """RULER's string_match_all for one case: the fraction of ``answers`` that occur in ``output``,
    case-insensitive."""
    text = output.lower()
    return sum(answer.lower() in text for answer in answers) / len(answers)


@dataclass(frozen=True)
class NeedleCase:
    task: str
    length: int
    depth: float
    value_kind: str
    answers: list[str]
    score: float  # fraction of answers present
    correct: bool  # all present
    output: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def completion_text(tokenizer: AnyTokenizer, row: list[int]) -> str:
    """Generated ids up to (not including) the first end-of-document token, decoded."""
    if tokenizer.eod_id in row:
        row = row[: row.index(tokenizer.eod_id)]
    return tokenizer.decode(row)


@torch.no_grad()
def run_needles(
    model: Any,
    tokenizer: AnyTokenizer,
    task: str,
    length: int,
    num_cases: int,
    seed: int,
    depths: Sequence[float] = DEFAULT_DEPTHS,
    batch_size: int = 1,
    builder: NeedlePromptBuilder | None = None,
    on_cases: Callable[[int], None] | None = None,
) -> list[NeedleCase]:
    """Greedy-decode NEW_TOKENS[task] tokens after each prompt (KV cache; the prompts of a task x length
    all have the same length, so they batch together)."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: must be >= 1 (--batch-size)")
    builder = builder or NeedlePromptBuilder(tokenizer)
    device = next(model.parameters()).device
    prompts = [builder.build(spec, length) for spec in draw_specs(task, length, num_cases, seed, depths)]
    cases: list[NeedleCase] = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        ids_BT = torch.tensor([prompt.token_ids for prompt in batch], dtype=torch.long, device=device)
        out_BT = generate(model, ids_BT, NEW_TOKENS[task], temperature=0.0, eos_token_id=tokenizer.eod_id,
                          vocab_limit=tokenizer.vocab_size)  # (B, length + new)
        for prompt, row in zip(batch, out_BT[:, length:].tolist()):
            output = completion_text(tokenizer, row)
            score = string_match_all(output, prompt.spec.answers)
            cases.append(NeedleCase(task, length, prompt.spec.depth, prompt.spec.value_kind,
                                    list(prompt.spec.answers), score, score == 1.0, output))
        if on_cases is not None:
            on_cases(len(batch))
    return cases


def summarize_needles(cases: Sequence[NeedleCase]) -> dict[str, Any]:
    """Mean score and all-present share overall, and the mean score per requested depth."""
    by_depth: dict[float, list[float]] = {}
    for case in cases:
        by_depth.setdefault(case.depth, []).append(case.score)
    return {"score": sum(c.score for c in cases) / len(cases),
            "all_present": sum(c.correct for c in cases) / len(cases), "cases": len(cases),
            "by_depth": [{"depth": depth, "score": sum(scores) / len(scores), "cases": len(scores)}
                         for depth, scores in sorted(by_depth.items())]}


# ----------------------------------------------------------------------------------------------
# Effective context length


def effective_context(rows: Sequence[dict[str, Any]], training_length: int) -> dict[str, Any]:
    """The effective context length of one model x scaling from its ``needles`` rows (one per task x length).

    score(L) = mean over the tasks of the task's score at length L. Reference length R = the training
    length if it was evaluated, else the longest evaluated length below it. Threshold = max(0.9 *
    score(R), 0.5). Effective length = the longest L >= R such that every evaluated length from R up to
    L meets the threshold (up to float rounding; a dip ends the run: a pass beyond a failing length
    does not count). None
    when score(R) < 0.5 or no length <= the training length was evaluated.
    """
    scores: dict[int, list[float]] = {}
    for row in rows:
        scores.setdefault(row["length"], []).append(row["score"])
    mean = {length: sum(values) / len(values) for length, values in sorted(scores.items())}
    below = [length for length in mean if length <= training_length]
    result: dict[str, Any] = {"length": None, "training_length": training_length,
                              "reference_length": max(below) if below else None, "reference_score": None,
                              "threshold": None}
    if not below:
        return result
    reference = max(below)
    result["reference_score"] = mean[reference]
    if mean[reference] < 0.5:
        return result
    threshold = max(0.9 * mean[reference], 0.5)
    result["threshold"] = threshold
    for length in (length for length in mean if length >= reference):
        if mean[length] < threshold - SCORE_TOLERANCE:
            break
        result["length"] = length
    return result
