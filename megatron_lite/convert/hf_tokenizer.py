"""The SentencePiece tokenizer as a Hugging Face fast tokenizer (``tokenizer.json``).

``AutoTokenizer.from_pretrained(OUTPUT)`` then loads ``PreTrainedTokenizerFast`` (v5:
``TokenizersBackend``) offline, without sentencepiece and without remote code. The tokenizers-library
pipeline reproduces our SentencePiece settings (see megatron_lite/data/tokenizer.py):

* normalizer: only " " -> "▁" (identity normalisation, no dummy prefix, whitespace kept);
* model: BPE over the SentencePiece vocabulary with merges ordered by piece score (SentencePiece
  merges the highest-scoring adjacent pair first; the same order as ranks), ``byte_fallback`` so
  characters outside the vocabulary become ``<0xNN>`` pieces, never ``<unk>``;
* decoder: "▁" -> " ", byte pieces -> bytes, fuse; nothing stripped, so decode(encode(x)) == x.

Ids equal SentencePiece's (tests compare them on prose, code, whitespace runs and rare Unicode).
Two differences, both HF conventions: the text "<|endoftext|>" is matched as the special token
(SentencePiece treats control symbols in text as plain characters; pass
``split_special_tokens=True`` to HF to get that behaviour), and like SentencePiece itself the text
character "▁" decodes as a space. The original ``tokenizer.model`` is copied alongside.

A checkpoint whose tokenizer already is a Hugging Face ``tokenizer.json`` (imported from an HF model,
or trained on data tokenised with one) is exported as it is: the file copied, with the
tokenizer_config.json it came with (else one written from its EOS/BOS/PAD), and the model config's
special ids taken from it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import sentencepiece as spm

from megatron_lite.checkpoint_dirs import copy_tokenizer
from megatron_lite.data.hf_tokenizer import HFTokenizer
from megatron_lite.data.tokenizer import Tokenizer, load_tokenizer

SPACE_MARKER = "▁"
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG_JSON = "tokenizer_config.json"
SENTENCEPIECE_FILE = "tokenizer.model"


def _merges(processor: spm.SentencePieceProcessor) -> list[tuple[str, str]]:
    """Every (left, right) split of a normal piece into two normal pieces, highest piece score first
    (ties: pieces in id order), as transformers' ``generate_merges`` orders them."""
    normal = {
        processor.id_to_piece(index): index
        for index in range(processor.get_piece_size())
        if not (processor.is_control(index) or processor.is_unknown(index) or processor.is_byte(index))
    }
    ranked = []
    for piece, index in normal.items():
        splits = [(piece[:cut], piece[cut:]) for cut in range(1, len(piece)) if piece[:cut] in normal and piece[cut:] in normal]
        splits.sort(key=lambda pair: (normal[pair[0]], normal[pair[1]]))
        ranked += [(left, right, processor.get_score(index)) for left, right in splits]
    ranked.sort(key=lambda item: (item[2], len(item[0]), len(item[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


def build_fast_tokenizer(model_file: str | Path) -> Any:
    """A ``tokenizers.Tokenizer`` equivalent to the SentencePiece BPE model in ``model_file``."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers import decoders, normalizers
    from tokenizers.models import BPE

    processor = spm.SentencePieceProcessor(model_file=str(model_file))
    vocab = {processor.id_to_piece(index): index for index in range(processor.get_piece_size())}
    unk_piece = processor.id_to_piece(processor.unk_id()) if processor.unk_id() >= 0 else None
    fast = FastTokenizer(BPE(vocab=vocab, merges=_merges(processor), unk_token=unk_piece, byte_fallback=True, fuse_unk=True))
    fast.normalizer = normalizers.Replace(" ", SPACE_MARKER)
    fast.decoder = decoders.Sequence([decoders.Replace(SPACE_MARKER, " "), decoders.ByteFallback(), decoders.Fuse()])
    specials = [processor.id_to_piece(i) for i in range(processor.get_piece_size()) if processor.is_control(i) or processor.is_unknown(i)]
    fast.add_special_tokens([AddedToken(piece, special=True, normalized=False) for piece in specials])
    return fast


def write_hf_tokenizer(model_file: str | Path, out_dir: Path) -> dict[str, int | None]:
    """tokenizer.json + tokenizer_config.json (+ tokenizer.model for SentencePiece); returns the special ids
    for the model config."""
    tokenizer = load_tokenizer(model_file)
    if isinstance(tokenizer, HFTokenizer):
        return _copy_hf_tokenizer(tokenizer, out_dir)
    return _write_sentencepiece(tokenizer, out_dir)


def _copy_hf_tokenizer(tokenizer: HFTokenizer, out_dir: Path) -> dict[str, int | None]:
    """The tokenizer.json as it is, with its own tokenizer_config.json or one naming its EOS/BOS/PAD."""
    written = copy_tokenizer(tokenizer.path, out_dir)
    if not any(path.name == TOKENIZER_CONFIG_JSON for path in written):
        settings: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                                    "eos_token": tokenizer.id_to_piece(tokenizer.eod_id),
                                    "clean_up_tokenization_spaces": False}
        if tokenizer.bos_id is not None:
            settings["bos_token"] = tokenizer.id_to_piece(tokenizer.bos_id)
        if tokenizer.pad_token_id is not None:
            settings["pad_token"] = tokenizer.id_to_piece(tokenizer.pad_token_id)
        (out_dir / TOKENIZER_CONFIG_JSON).write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n")
    bos = tokenizer.bos_id if tokenizer.bos_id is not None else (tokenizer.prefix_ids or [tokenizer.eod_id])[0]
    return {"bos_token_id": bos, "eos_token_id": tokenizer.eod_id, "pad_token_id": tokenizer.pad_token_id}


def _write_sentencepiece(tokenizer: Tokenizer, out_dir: Path) -> dict[str, int | None]:
    """Our SentencePiece model as tokenizer.json (build_fast_tokenizer), with the original beside it."""
    model_file = tokenizer.path
    build_fast_tokenizer(model_file).save(str(out_dir / TOKENIZER_JSON))
    shutil.copyfile(model_file, out_dir / SENTENCEPIECE_FILE)
    eos_piece, pad_piece = tokenizer.id_to_piece(tokenizer.eod_id), tokenizer.id_to_piece(tokenizer.pad_id)
    processor = spm.SentencePieceProcessor(model_file=str(model_file))
    settings: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos_piece,
        "bos_token": eos_piece,  # documents are separated by EOD only (GPT-NeoX convention)
        "pad_token": pad_piece,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    if processor.unk_id() >= 0:
        settings["unk_token"] = processor.id_to_piece(processor.unk_id())
    (out_dir / TOKENIZER_CONFIG_JSON).write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n")
    return {"bos_token_id": tokenizer.eod_id, "eos_token_id": tokenizer.eod_id, "pad_token_id": tokenizer.pad_id}
