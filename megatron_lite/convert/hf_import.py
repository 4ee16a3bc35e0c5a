"""Read a Hugging Face model directory as megatron_lite weights: GPT-NeoX (e.g. Pythia), Llama, Mistral (full
attention), Qwen2, and our megatron_lite_gpt / megatron_lite_llama exports.

Weights come from ``model.safetensors`` (or its sharded index); legacy ``pytorch_model.bin`` files
are read with ``torch.load(weights_only=True)``, which refuses arbitrary pickled objects. Every
tensor is checked against the config: missing, unexpected and mis-shaped tensors are reported in
one ``ValueError``.

The config: when the directory holds ``megatron_lite_config.yml`` (written by our exporter) and
config.json still describes the same architecture, that training config is restored exactly
(round trips are lossless). Otherwise the model section is derived from config.json
(``hf_config.model_section_from_hf``), keeping the non-architecture settings of the yml when one
exists, and other sections take their defaults — set them with ``--set`` when training. A model
without a tokenizer keeps its bos/eos/pad ids in ``data.tokenizer`` (from config.json, else
generation_config.json), so an export writes them back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from megatron_lite import config as config_lib
from megatron_lite.config import Config
from megatron_lite.console import notice
from megatron_lite.convert.hf_config import hf_config_fields, model_section_from_hf
from megatron_lite.convert.hf_export import TRAINING_CONFIG_FILE, config_special_ids
from megatron_lite.convert.hf_names import from_hf_state
from megatron_lite.weights import read_weight_file
from megatron_lite.convert.hf_tokenizer import SENTENCEPIECE_FILE, TOKENIZER_JSON

GENERATION_CONFIG_FILE = "generation_config.json"
SPECIAL_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
# Model keys that describe training, not the architecture: kept from megatron_lite_config.yml.
TRAINING_ONLY_MODEL_KEYS = ("init_method", "output_layer_init_method", "checkpoint_activations", "attention", "norm")


def hf_weight_files(hf_dir: Path) -> list[Path]:
    """The weight files of an HF dir: the shards its index names, or its single file."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = hf_dir / index_name
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [hf_dir / shard for shard in shards]
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (hf_dir / single).is_file():
            return [hf_dir / single]
    raise ValueError(f"{hf_dir}: no model.safetensors, pytorch_model.bin or sharded index")


def load_hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in hf_weight_files(hf_dir):
        state.update(read_weight_file(path))
    return state


def _config_from_hf(hf_dir: Path, hf: dict[str, Any]) -> Config:
    model_section = model_section_from_hf(hf)
    training_file = hf_dir / TRAINING_CONFIG_FILE
    if not training_file.is_file():
        return config_lib.from_dict({"model": model_section})
    training = config_lib.load(training_file)
    derived = config_lib.from_dict({"model": model_section})
    if hf_config_fields(training.model) == hf_config_fields(derived.model):
        return training
    changed = sorted(key for key, value in hf_config_fields(derived.model).items()
                     if hf_config_fields(training.model).get(key) != value)
    notice(f"{hf_dir}: config.json differs from {TRAINING_CONFIG_FILE} in {', '.join(changed)}; "
           "config.json wins for the architecture", stacklevel=3)
    data = config_lib.to_dict(training)
    model_section.update({key: data["model"][key] for key in TRAINING_ONLY_MODEL_KEYS})
    data["model"] = model_section
    return config_lib.from_dict(data)


def read_hf_config(hf_dir: Path) -> Config:
    """The megatron_lite config of an HF model dir (see the module docstring)."""
    config_file = hf_dir / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{hf_dir}: no config.json, not a Hugging Face model directory")
    hf = json.loads(config_file.read_text())
    config = _config_from_hf(hf_dir, hf)
    special_ids = special_ids_from_hf(hf_dir, hf)
    # A tokenizer carries its own special ids; ids an export would write anyway (our 0/0/1) need no record.
    if hf_tokenizer_file(hf_dir) is not None or special_ids == config_special_ids(config):
        return config
    data = config_lib.to_dict(config)
    data["data"]["tokenizer"].update(special_ids)
    return config_lib.from_dict(data)


def special_ids_from_hf(hf_dir: Path, hf: dict[str, Any]) -> dict[str, Any]:
    """bos/eos/pad ids of a model without a tokenizer: config.json's, else generation_config.json's, else None."""
    generation_file = hf_dir / GENERATION_CONFIG_FILE
    generation = json.loads(generation_file.read_text()) if generation_file.is_file() else {}
    return {key: hf[key] if hf.get(key) is not None else generation.get(key) for key in SPECIAL_ID_KEYS}


def import_hf(path: str | Path) -> tuple[dict[str, torch.Tensor], Config, Path | None]:
    """(fp32-or-stored-dtype weights under megatron_lite names, config, tokenizer file or None: hf_tokenizer_file)."""
    hf_dir = Path(path)
    config = read_hf_config(hf_dir)
    state = from_hf_state(load_hf_weights(hf_dir), config.model, str(hf_dir))
    return state, config, hf_tokenizer_file(hf_dir)


def hf_tokenizer_file(hf_dir: Path) -> Path | None:
    """The tokenizer to carry: the original tokenizer.model of a dir our exporter wrote (its tokenizer.json
    is a conversion of it), else the model's tokenizer.json (what transformers loads; its
    tokenizer_config.json travels with it), else a lone tokenizer.model; None when there is none."""
    sentencepiece, fast = hf_dir / SENTENCEPIECE_FILE, hf_dir / TOKENIZER_JSON
    if sentencepiece.is_file() and ((hf_dir / TRAINING_CONFIG_FILE).is_file() or not fast.is_file()):
        return sentencepiece
    return fast if fast.is_file() else None
