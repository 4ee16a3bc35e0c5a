"""SentencePiece BPE tokenizer: trained on a sample of the mix, safe for code (exact round trip).

Settings and why (checked by tests/test_tokenizer.py):

* ``normalization_rule_name="identity"``, ``remove_extra_whitespaces=False``: no NFKC, no
  collapsing of spaces, so indentation, trailing spaces and blank lines survive;
* ``add_dummy_prefix=False``: no invented leading space (decode would otherwise have to guess);
* training "sentences" are multi-line chunks of documents, so ``\\n`` is an ordinary character and
  merges into pieces such as ``):\\n``; ``allow_whitespace_only_pieces`` gives ``▁▁▁▁`` indent pieces;
* ``byte_fallback=True``: any character outside the vocabulary (tabs in a corpus without tabs,
  rare Unicode, control characters) becomes ``<0xNN>`` byte pieces, never ``<unk>``;
* ``split_digits=True``: numbers are spelled digit by digit.
* Specials with fixed ids, as GPT-NeoX: ``<|endoftext|>`` = 0 (EOD, appended to every document),
  ``<|pad|>`` = 1, ``<unk>`` = 2. They are control symbols, so the literal text "<|endoftext|>"
  in a document is encoded as ordinary characters and can never fake a document boundary.

Known limit: the text character U+2581 (``▁``) is SentencePiece's space marker and decodes as a
space, as in every SentencePiece model.

``data.tokenizer.model`` may instead name a Hugging Face ``tokenizer.json`` (or a directory holding
one): ``load_tokenizer`` returns an ``HFTokenizer`` (megatron_lite/data/hf_tokenizer.py) with the
same interface, EOD = its EOS, BOS where its post-processor adds one.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, Union

import sentencepiece as spm
from tqdm import tqdm

from megatron_lite.checkpoint_dirs import HF_TOKENIZER_CONFIG_FILE, TOKENIZER_FILES, tokenizer_companions, tokenizer_file_name
from megatron_lite.config import DataConfig, MixConfig, ModelConfig
from megatron_lite.console import notice
from megatron_lite.data.cleaning import Cleaner
from megatron_lite.data.hf_tokenizer import HFTokenizer, is_hf_tokenizer, resolve_tokenizer_path
from megatron_lite.data.megatron_source import check_tokenizer as check_megatron_tokenizer
from megatron_lite.data.mix import group_weights, load_mix
from megatron_lite.data.records import Document
from megatron_lite.data.sources import read_source, source_settings
from megatron_lite.files import copy_file_atomic, file_sha256, write_bytes_atomic, write_json_atomic

EOD_PIECE, PAD_PIECE, UNK_PIECE = "<|endoftext|>", "<|pad|>", "<unk>"
EOD_ID, PAD_ID, UNK_ID = 0, 1, 2
MIN_VOCAB_SIZE = 3 + 256 + 16  # specials + byte pieces + a few merges
SENTENCE_CHARS = 4096  # training chunk length; max_sentence_length is in bytes (<= 4 per char)

TOKENIZER_FILE = "tokenizer/tokenizer.model"  # relative to data.cache_dir (manifest contract)
TOKENIZER_SPEC_FILE = "tokenizer/train_spec.json"  # what the cached model was trained from
SPEC_VERSION = 1  # bump when the sampling recipe changes

TRAINER_SETTINGS: dict[str, Any] = {
    "model_type": "bpe",
    "character_coverage": 0.9995,  # rarer characters go to byte fallback instead of taking vocab
    "byte_fallback": True,
    "normalization_rule_name": "identity",
    "remove_extra_whitespaces": False,
    "add_dummy_prefix": False,
    "split_digits": True,
    "allow_whitespace_only_pieces": True,
    "split_by_whitespace": True,
    "max_sentence_length": 4 * SENTENCE_CHARS,
    "unk_id": UNK_ID, "unk_piece": UNK_PIECE,
    "eos_id": EOD_ID, "eos_piece": EOD_PIECE,
    "pad_id": PAD_ID, "pad_piece": PAD_PIECE,
    "bos_id": -1,
    "minloglevel": 2,  # SentencePiece's C++ log is very chatty
}


class Tokenizer:
    """A SentencePiece model file with the EOD/PAD ids the data pipeline needs."""

    kind: Literal["sentencepiece", "hf"] = "sentencepiece"
    bos_id: int | None = None  # documents are separated by EOD only (GPT-NeoX convention)
    prefix_ids: list[int] = []  # nothing before a document's text (HFTokenizer: its BOS, if any); never mutated

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"tokenizer model {self.path} does not exist")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(self.path))
        except (RuntimeError, OSError) as error:
            raise ValueError(f"tokenizer model {self.path}: not a SentencePiece model ({error})") from None
        self.sha256: str = file_sha256(self.path)
        self.eod_id: int = self._special(EOD_PIECE, self._sp.eos_id(), required=True)
        self.pad_id: int = self._special(PAD_PIECE, self._sp.pad_id(), required=False)

    def _special(self, piece: str, fallback: int, required: bool) -> int:
        """Our piece if the model has it, else the model's own eos/pad id (models from elsewhere)."""
        token = self._sp.piece_to_id(piece)
        if self._sp.id_to_piece(token) == piece:
            return token
        if fallback >= 0:
            return fallback
        if required:
            raise ValueError(f"tokenizer model {self.path} has neither a {piece!r} piece nor an eos id")
        return self.eod_id  # no pad: padding positions are masked anyway

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """One call for many texts; one thread by default (preprocessing parallelises by process)."""
        return self._sp.encode(list(texts), num_threads=num_threads)

    def encode_documents(self, texts: Sequence[str]) -> list[list[int]]:
        """Each document as the shards hold it, without the final EOD (appended by the caller)."""
        return self.encode_batch(texts)

    def encode_prompt(self, text: str) -> list[int]:
        """The start of a document: just the text (no BOS)."""
        return self.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def id_to_piece(self, token: int) -> str:
        return self._sp.id_to_piece(int(token))

    # Worker processes get the path and reload the model instead of pickling the C++ object.
    def __getstate__(self) -> str:
        return str(self.path)

    def __setstate__(self, path: str) -> None:
        self.__init__(path)  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, eod_id={self.eod_id}, pad_id={self.pad_id})"


AnyTokenizer = Union[Tokenizer, HFTokenizer]  # one interface: encode*, decode, vocab_size, eod/pad/bos ids


def load_tokenizer(path: str | os.PathLike[str]) -> AnyTokenizer:
    """The tokenizer ``path`` names: a SentencePiece ``.model``, a ``tokenizer.json``, or a directory holding
    one of them (an HF tokenizer / model dir, a checkpoint). ValueError naming the path otherwise."""
    resolved = resolve_tokenizer_path(path)
    return HFTokenizer(resolved) if is_hf_tokenizer(resolved) else Tokenizer(resolved)


def check_vocab_fits(tokenizer: AnyTokenizer, vocab_size: int, origin: str) -> None:
    """Every id the tokenizer can produce must have an embedding row: one-line ValueError otherwise.
    ``origin`` names where the tokenizer came from (e.g. "data.tokenizer.model='tok.json'")."""
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"model.vocab_size={vocab_size}: tokenizer {origin} has {tokenizer.vocab_size} pieces "
                         f"(added tokens included), ids would not fit the embedding; set model.vocab_size >= "
                         f"{tokenizer.vocab_size} or use another tokenizer")


def check_document_mask(eod_id: int, model: ModelConfig, origin: str) -> None:
    """Document masking splits at model.attention.eod_token_id: it must be the tokenizer's EOD ``eod_id``."""
    attention = model.attention
    if attention.document_mask and attention.eod_token_id != eod_id:
        raise ValueError(f"model.attention.eod_token_id={attention.eod_token_id}: the tokenizer ({origin}) ends "
                         f"documents with id {eod_id}; set model.attention.eod_token_id={eod_id} (it must be the "
                         "EOD for model.attention.document_mask)")


def model_tokenizer(explicit: str | os.PathLike[str] | None, carried: Path | None, model: ModelConfig,
                    checkpoint: str) -> AnyTokenizer:
    """The tokenizer to run a loaded checkpoint with (generate, evaluation): ``explicit`` (--tokenizer) or the
    one the checkpoint carries; its ids must fit the model's embedding rows and its EOD the document mask."""
    path = explicit or carried
    if path is None:
        raise ValueError(f"{checkpoint}: the checkpoint carries no tokenizer (tokenizer.model or tokenizer.json); "
                         "pass --tokenizer")
    origin = f"--tokenizer {explicit}" if explicit else str(carried)
    tokenizer = load_tokenizer(path)
    if tokenizer.vocab_size > model.padded_vocab_size:
        raise ValueError(f"{origin}: {tokenizer.vocab_size} tokens do not fit the model's {model.padded_vocab_size} "
                         "embedding rows")
    check_document_mask(tokenizer.eod_id, model, origin)
    return tokenizer


def training_sentences(texts: Iterable[str], chunk_chars: int = SENTENCE_CHARS) -> Iterator[str]:
    """Documents cut into multi-line chunks (at line ends where possible) that fit max_sentence_length."""
    for text in texts:
        chunk: list[str] = []
        size = 0
        for line in text.splitlines(keepends=True):
            while len(line) > chunk_chars:  # a single huge line (minified code, data)
                if chunk:
                    yield "".join(chunk)
                    chunk, size = [], 0
                yield line[:chunk_chars]
                line = line[chunk_chars:]
            if size + len(line) > chunk_chars and chunk:
                yield "".join(chunk)
                chunk, size = [], 0
            chunk.append(line)
            size += len(line)
        if chunk:
            yield "".join(chunk)


def train_tokenizer(texts: Iterable[str], output: str | os.PathLike[str], vocab_size: int, num_threads: int = 1) -> Tokenizer:
    """Train a BPE model on ``texts`` and write it atomically to ``output``."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size={vocab_size}: must be >= {MIN_VOCAB_SIZE} (3 specials + 256 byte pieces + merges)")
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=training_sentences(texts), model_writer=model, vocab_size=vocab_size,
            num_threads=max(1, num_threads), **TRAINER_SETTINGS,
        )
    except RuntimeError as error:
        if "required_chars" in str(error):  # every kept character needs a piece besides specials and bytes
            hint = "the sample has more distinct characters than the vocabulary holds: raise the vocabulary size"
        else:  # "Vocabulary size too high": too little text to learn that many merges
            hint = "too little sample text: raise data.tokenizer.sample_chars or lower the vocabulary size"
        raise ValueError(f"tokenizer training failed for vocab_size={vocab_size}: {error} ({hint})") from None
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(output, model.getvalue())
    tokenizer = Tokenizer(output)
    if tokenizer.vocab_size != vocab_size:
        raise ValueError(f"tokenizer training produced {tokenizer.vocab_size} pieces, not vocab_size={vocab_size}: "
                         "the sample is too small; raise data.tokenizer.sample_chars or lower the vocabulary")
    return tokenizer


def source_budgets(mix: MixConfig, sample_chars: int) -> dict[str, tuple[str, float]]:
    """Characters to draw from each source: the group's share, split by source weight (or evenly)."""
    budgets = {}
    for group_name, share in group_weights(mix).items():
        sources = mix.groups[group_name].sources
        weights = {name: source.weight if source.weight is not None else 1.0 for name, source in sources.items()}
        total = sum(weights.values())
        for name in sources:
            budgets[name] = (group_name, sample_chars * share * weights[name] / total)
    return budgets


def sample_mix(mix: MixConfig, sample_chars: int, progress: bool = True) -> dict[str, list[str]]:
    """Cleaned documents from the start of each source, ``sample_chars`` in all, in group proportions.

    When a group runs out of text before its share is reached, every group is scaled down by the
    same factor so the proportions stay exact (the sample is then smaller than requested).
    Bad records are skipped here; preprocessing counts and reports them.
    """
    budgets = source_budgets(mix, sample_chars)
    collected: dict[str, list[str]] = {}
    bar = tqdm(desc="tokenizer sample", total=sample_chars, unit="char", unit_scale=True, disable=not progress)
    for group_name, group in mix.groups.items():
        for name, source in group.sources.items():
            budget, cleaner, texts, size = budgets[name][1], Cleaner(source), [], 0
            for record in read_source(source, name):
                if size >= budget:
                    break
                if isinstance(record, Document) and (text := cleaner(record.text, record.location)) is not None:
                    texts.append(text)
                    size += len(text)
                    bar.update(len(text))
            collected[name] = texts
    bar.close()
    group_budget: dict[str, float] = {}
    group_size: dict[str, int] = {}
    for name, (group_name, budget) in budgets.items():
        group_budget[group_name] = group_budget.get(group_name, 0.0) + budget
        group_size[group_name] = group_size.get(group_name, 0) + sum(map(len, collected[name]))
    scale = min(1.0, *(group_size[g] / group_budget[g] for g in group_budget))
    sample: dict[str, list[str]] = {}
    for name, (group_name, budget) in budgets.items():
        sample[name] = _truncate(collected[name], int(budget * scale))
    if progress:
        sizes = {g: sum(len(t) for n, ts in sample.items() if budgets[n][0] == g for t in ts) for g in group_budget}
        total = sum(sizes.values()) or 1
        shares = ", ".join(f"{g} {size:,} chars ({size / total:.1%})" for g, size in sizes.items())
        note = f"; a group ran short, sample scaled to {scale:.0%} of {sample_chars:,}" if scale < 1 else ""
        print(f"tokenizer sample: {shares}{note}", file=sys.stderr)
    return sample


def _truncate(texts: list[str], limit: int) -> list[str]:
    out, size = [], 0
    for text in texts:
        if size >= limit:
            break
        out.append(text[: limit - size])
        size += len(out[-1])
    return out


def train_from_mix(mix: MixConfig, output: str | os.PathLike[str], vocab_size: int, sample_chars: int,
                   num_threads: int = 1, progress: bool = True) -> Tokenizer:
    """Draw the sample (group proportions by characters) and train; the whole recipe in one call."""
    sample = sample_mix(mix, sample_chars, progress=progress)
    texts = [text for name in sample for text in sample[name]]
    if not texts:
        raise ValueError("tokenizer training: the mix produced no documents")
    return train_tokenizer(texts, output, vocab_size, num_threads=num_threads)


# ----------------------------------------------------------------------------------------------
# The tokenizer of a data cache


def _mix_settings(mix: MixConfig) -> dict[str, Any]:
    """asdict(mix) with each source as source_settings() gives it (stable across added source fields)."""
    settings = dataclasses.asdict(mix)
    for group_name, group in mix.groups.items():
        settings["groups"][group_name]["sources"] = {name: source_settings(source)
                                                     for name, source in group.sources.items()}
    return settings


def _tokenizer_spec(data: DataConfig, vocab_size: int, mix: MixConfig) -> dict[str, Any]:
    return {"vocab_size": vocab_size, "sample_chars": data.tokenizer.sample_chars,
            "mix": _mix_settings(mix), "trainer": TRAINER_SETTINGS, "version": SPEC_VERSION}


def _remove_tokenizers(directory: Path, keep: set[str]) -> None:
    """Drop the cache's tokenizer files other than ``keep``: one tokenizer per cache, never two to choose from."""
    for name in (*TOKENIZER_FILES, HF_TOKENIZER_CONFIG_FILE):
        if name not in keep:
            (directory / name).unlink(missing_ok=True)


def _no_check(what: str) -> None:
    """``before_change`` where no other run can read the cache (nothing locked it)."""


def _other_tokenizers(directory: Path, keep: set[str]) -> bool:
    return any((directory / name).exists() for name in (*TOKENIZER_FILES, HF_TOKENIZER_CONFIG_FILE) if name not in keep)


def _install_tokenizer(source: Path, directory: Path, before_change: Callable[[str], None] = _no_check) -> Path:
    """Copy a given tokenizer (and its tokenizer_config.json) into the cache under the checkpoint names,
    atomically and only when the bytes differ; returns the cached tokenizer file."""
    directory.mkdir(parents=True, exist_ok=True)
    files = tokenizer_companions(source)
    targets = [directory / tokenizer_file_name(source)] + [directory / HF_TOKENIZER_CONFIG_FILE] * (len(files) - 1)
    keep = {target.name for target in targets}
    copies = [(file, target) for file, target in zip(files, targets)
              if not target.is_file() or file_sha256(file) != file_sha256(target)]
    if copies or _other_tokenizers(directory, keep):
        before_change(f"replace its tokenizer by {source}")
    _remove_tokenizers(directory, keep=keep)
    for file, target in copies:
        copy_file_atomic(file, target)
    return targets[0]


def _trained_tokenizer(target: Path, spec_path: Path, spec: dict[str, Any]) -> Tokenizer | None:
    """The model this cache trained for ``spec``, or None when there is none to reuse: none trained yet, another
    spec, or a damaged file (named in a notice: the pipeline made it, so it retrains it)."""
    if not (spec_path.is_file() and target.is_file()):
        return None
    try:
        if json.loads(spec_path.read_text()) != spec:
            return None
    except ValueError as error:  # JSON or UTF-8
        notice(f"data cache: {spec_path} is damaged (not JSON: {error}); retraining the tokenizer", stacklevel=3)
        return None
    try:
        return Tokenizer(target)
    except ValueError as error:
        why = str(error).removeprefix(f"tokenizer model {target}: ")
        notice(f"data cache: {target} is damaged ({why}); retraining it", stacklevel=3)
        return None


def ensure_tokenizer(data: DataConfig, vocab_size: int, mix: MixConfig | None = None, *, retrain: bool = False,
                     progress: bool = True, before_change: Callable[[str], None] = _no_check) -> AnyTokenizer:
    """The cache's tokenizer: a copy of ``data.tokenizer.model`` (SentencePiece, or a Hugging Face
    tokenizer.json with its tokenizer_config.json), or a SentencePiece model trained from the mix (reused
    while the vocabulary size, sample size, mix and trainer settings are unchanged); ``vocab_size`` is
    model.vocab_size (the tokenizer must fit it), ``mix`` data.mix parsed (parsed here when not given).
    ``before_change(what)`` runs before the cache's tokenizer files change (data/cache_lock.py: it refuses while
    another run reads the cache)."""
    mix = mix if mix is not None else load_mix(data.mix)
    check_megatron_tokenizer(data, mix)  # pre-tokenised shards: the model is given, never trained
    cache_dir = Path(data.cache_dir)
    target, spec_path = cache_dir / TOKENIZER_FILE, cache_dir / TOKENIZER_SPEC_FILE
    given = data.tokenizer.model
    origin = f"data.tokenizer.model={given!r}"
    if given:
        if not os.path.exists(given):
            raise ValueError(f"{origin}: file does not exist")
        try:
            source = resolve_tokenizer_path(given)
        except ValueError as error:
            raise ValueError(f"{origin}: {error}") from None
        target = _install_tokenizer(source, target.parent, before_change)
        spec_path.unlink(missing_ok=True)  # not trained by us: a later null model must retrain
        try:
            tokenizer = load_tokenizer(target)
        except ValueError:
            _remove_tokenizers(target.parent, keep=set())  # the cache keeps no copy for a later run to trip on
            try:
                load_tokenizer(source)  # the user's file, never overwritten: named as the one to fix
            except ValueError as error:
                raise ValueError(f"{origin}: {error}; fix or replace that file") from None
            raise
    else:
        if _other_tokenizers(target.parent, keep={target.name}):
            before_change("replace its tokenizer by one trained from the mix")
        _remove_tokenizers(target.parent, keep={target.name})  # an earlier given tokenizer.json
        spec = json.loads(json.dumps(_tokenizer_spec(data, vocab_size, mix)))  # normalised (tuples -> lists)
        tokenizer = None if retrain else _trained_tokenizer(target, spec_path, spec)
        if tokenizer is None:
            before_change(f"train its tokenizer anew ({vocab_size} pieces, data.tokenizer.sample_chars="
                          f"{data.tokenizer.sample_chars})")
            start = time.perf_counter()
            tokenizer = train_from_mix(mix, target, vocab_size, data.tokenizer.sample_chars,
                                       num_threads=data.num_workers, progress=progress)
            write_json_atomic(spec_path, spec, indent=2, sort_keys=True)
            if progress:
                print(f"tokenizer: trained {tokenizer.vocab_size} pieces in {time.perf_counter() - start:.1f}s "
                      f"-> {target}", file=sys.stderr)
    check_vocab_fits(tokenizer, vocab_size, origin)
    if tokenizer.vocab_size < vocab_size:
        notice(f"tokenizer {target} has {tokenizer.vocab_size} pieces, model.vocab_size="
               f"{vocab_size}: the extra embedding rows are never used", stacklevel=2)
    return tokenizer
