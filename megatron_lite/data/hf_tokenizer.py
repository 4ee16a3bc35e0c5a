"""Hugging Face tokenizers (``tokenizer.json``) with the interface of the SentencePiece ``Tokenizer``.

Built on the ``tokenizers`` library alone (no transformers at run time). The rules, so data made
with a model's own tokenizer looks like that model's training data:

* EOD is the tokenizer's EOS: ``eos_token`` of the ``tokenizer_config.json`` beside tokenizer.json
  when it names one, else the first of ``COMMON_EOS`` in the vocabulary, else a one-line ValueError
  naming the key to set.
* A document gets exactly the specials the tokenizer's own post-processor adds to one sequence
  (Llama: ``<s>`` before it; GPT-2 / Qwen2: none), then EOD once: a post-processor that already
  ends a sequence with EOS does not get a second one.
* Special-token text inside a document (a literal ``</s>`` in the data) is encoded as ordinary text
  (``encode_special_tokens``), as SentencePiece treats its control symbols, so data can never fake
  a document boundary.
* ``vocab_size`` counts added tokens: it is the largest id + 1.
* Identity (``sha256``): the tokenizer.json bytes, combined with tokenizer_config.json's when one
  lies beside it (it decides EOD), so another tokenizer re-tokenises the data cache.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_lite.checkpoint_dirs import HF_TOKENIZER_CONFIG_FILE, find_tokenizer, tokenizer_companions
from megatron_lite.files import file_sha256

COMMON_EOS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<|im_end|>", "<eos>")
_PROBE = "a"  # a non-special text: what the post-processor puts around it are its specials


def is_hf_tokenizer(path: str | os.PathLike[str]) -> bool:
    """A tokenizer file is Hugging Face's when it is JSON (tokenizer.json), SentencePiece's otherwise."""
    return Path(path).suffix == ".json"


def resolve_tokenizer_path(path: str | os.PathLike[str]) -> Path:
    """The tokenizer file ``path`` names: the file itself, or a directory's tokenizer.json (an HF tokenizer
    or model dir) or tokenizer.model. ValueError when there is none."""
    path = Path(path)
    if path.is_dir():
        found = find_tokenizer(path)
        if found is None:
            raise ValueError(f"tokenizer {path}: the directory holds neither tokenizer.json nor tokenizer.model")
        return found
    if not path.is_file():
        raise ValueError(f"tokenizer {path} does not exist")
    return path


def tokenizer_sha256(path: str | os.PathLike[str]) -> str:
    """Identity of a tokenizer file: its sha256; with its tokenizer_config.json's folded in when it has one."""
    hashes = [file_sha256(file) for file in tokenizer_companions(resolve_tokenizer_path(path))]
    return hashes[0] if len(hashes) == 1 else hashlib.sha256("\n".join(hashes).encode()).hexdigest()


def _token_name(value: Any) -> str | None:
    """A tokenizer_config.json special-token entry: a string, or (older files) {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read_settings(path: Path) -> dict[str, Any]:
    config = path.with_name(HF_TOKENIZER_CONFIG_FILE)
    if not config.is_file():
        return {}
    try:
        settings = json.loads(config.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"{config}: not valid JSON ({error})") from None
    return settings if isinstance(settings, dict) else {}


class HFTokenizer:
    """A ``tokenizer.json`` (or a directory holding one) with the pipeline's EOD/BOS/PAD rules (module doc)."""

    kind = "hf"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = resolve_tokenizer_path(path)
        try:
            from tokenizers import Tokenizer as FastTokenizer
        except ImportError:
            raise ValueError(f"tokenizer {self.path}: a Hugging Face tokenizer needs the tokenizers package "
                             "(pip install tokenizers)") from None
        try:
            self._tok = FastTokenizer.from_file(str(self.path))
        except Exception as error:  # the Rust side raises plain Exception for malformed files
            raise ValueError(f"tokenizer {self.path}: not a Hugging Face tokenizer.json ({error})") from None
        self._tok.encode_special_tokens = True  # special-token text in data is text (module doc)
        self.sha256: str = tokenizer_sha256(self.path)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self._vocab_size = max(vocab.values()) + 1
        settings = _read_settings(self.path)
        self.eod_id: int = self._eos_id(settings)
        self.bos_id: int | None = self._named_id(settings, "bos_token")
        self.pad_token_id: int | None = self._named_id(settings, "pad_token")
        self.pad_id: int = self.pad_token_id if self.pad_token_id is not None else self.eod_id  # padding is masked
        self.prefix_ids, suffix_ids = self._post_processor_specials()
        self._strip_eod = suffix_ids[-1:] == [self.eod_id]  # the post-processor already ends with EOS

    def _named_id(self, settings: dict[str, Any], key: str) -> int | None:
        name = _token_name(settings.get(key))
        if name is None:
            return None
        token = self._tok.token_to_id(name)
        if token is None:
            raise ValueError(f"{self.path.with_name(HF_TOKENIZER_CONFIG_FILE)}: {key}={name!r} is not in the "
                             f"vocabulary of {self.path}")
        return int(token)

    def _eos_id(self, settings: dict[str, Any]) -> int:
        named = self._named_id(settings, "eos_token")
        if named is not None:
            return named
        for name in COMMON_EOS:
            token = self._tok.token_to_id(name)
            if token is not None:
                return int(token)
        raise ValueError(f"tokenizer {self.path}: no EOS token to end documents with (none of "
                         f"{', '.join(COMMON_EOS)} is in its vocabulary); set eos_token in "
                         f"{self.path.with_name(HF_TOKENIZER_CONFIG_FILE)}")

    def _post_processor_specials(self) -> tuple[list[int], list[int]]:
        """(ids the post-processor puts before one sequence, ids it puts after it)."""
        encoding = self._tok.encode(_PROBE, add_special_tokens=True)
        ids, mask = encoding.ids, encoding.special_tokens_mask
        lead = next((i for i, special in enumerate(mask) if not special), len(mask))
        trail = next((i for i, special in enumerate(reversed(mask)) if not special), 0)
        return list(ids[:lead]), list(ids[len(ids) - trail:])

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str) -> list[int]:
        """Plain text, no specials (segments that are concatenated: passkey filler, prompts' parts)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """Plain texts; one thread by default (preprocessing parallelises by process, as with SentencePiece)."""
        if num_threads > 1:
            return [encoding.ids for encoding in self._tok.encode_batch(list(texts), add_special_tokens=False)]
        return [self.encode(text) for text in texts]

    def encode_documents(self, texts: Sequence[str]) -> list[list[int]]:
        """Each document as the shards hold it, without the final EOD (appended by the caller): the
        post-processor's specials around the text, minus a trailing EOS it adds itself."""
        documents = []
        for text in texts:
            ids = self._tok.encode(text, add_special_tokens=True).ids
            documents.append(ids[:-1] if self._strip_eod else ids)
        return documents

    def encode_prompt(self, text: str) -> list[int]:
        """The start of a document: the post-processor's leading specials (BOS), then the text."""
        return self.prefix_ids + self.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def id_to_piece(self, token: int) -> str:
        return self._tok.id_to_token(int(token)) or ""

    # Worker processes get the path and reload the tokenizer instead of pickling the Rust object.
    def __getstate__(self) -> str:
        return str(self.path)

    def __setstate__(self, path: str) -> None:
        self.__init__(path)  # type: ignore[misc]

    def __repr__(self) -> str:
        return (f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, eod_id={self.eod_id}, "
                f"bos_id={self.bos_id}, pad_id={self.pad_id})")
