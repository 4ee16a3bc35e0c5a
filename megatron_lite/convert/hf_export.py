"""Write a megatron_lite model as a Hugging Face model directory.

    config.json                  GPT-NeoX or Llama/Qwen2 fields (+ position_scheme, coca_constraint, auto_map for remote code)
    generation_config.json       bos/eos = <|endoftext|>, pad = <|pad|> (the tokenizer's ids; without a tokenizer
                                 those data.tokenizer records, else 0/0/1)
    model.safetensors            weights under GPTNeoXForCausalLM names (per-head fused [q | k-or-t | v]) or
                                 LlamaForCausalLM names (q/k/v/o projections)
    tokenizer.json, tokenizer_config.json (+ tokenizer.model)  (when the checkpoint has a tokenizer: SentencePiece
                                 converted, or its Hugging Face tokenizer.json copied; hf_tokenizer.py)
    megatron_lite_config.yml     the full training config, so --to megatron_lite restores it exactly
    configuration_megatron_lite.py, modeling_megatron_lite.py  (remote-code schemes only)

GPT-NeoX family: RoPE and no-position models load as the stock ``GPTNeoXForCausalLM``. LLaMA family: RoPE
models load as the stock ``LlamaForCausalLM`` (``Qwen2ForCausalLM`` with q/k/v biases). Every other scheme
(CoCA, ALiBi, ...) needs ``trust_remote_code=True`` and runs the self-contained modeling file.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from megatron_lite import config as config_lib
from megatron_lite.config import Config
from megatron_lite.convert.hf_config import hf_config_fields, uses_stock_model
from megatron_lite.convert.hf_llama import stock_model_type
from megatron_lite.convert.hf_names import cast, to_hf_state, untie
from megatron_lite.convert.hf_tokenizer import write_hf_tokenizer
from megatron_lite.weights import save_safetensors

HF_WEIGHTS_FILE = "model.safetensors"
TRAINING_CONFIG_FILE = "megatron_lite_config.yml"
REMOTE_DIR = Path(__file__).parent / "hf_remote"
REMOTE_CONFIG_MODULE = "configuration_megatron_lite"
REMOTE_MODELING_MODULE = "modeling_megatron_lite"
AUTO_MAP = {
    "AutoConfig": f"{REMOTE_CONFIG_MODULE}.MegatronLiteConfig",
    "AutoModel": f"{REMOTE_MODELING_MODULE}.MegatronLiteModel",
    "AutoModelForCausalLM": f"{REMOTE_MODELING_MODULE}.MegatronLiteForCausalLM",
}
LLAMA_AUTO_MAP = {
    "AutoConfig": f"{REMOTE_CONFIG_MODULE}.MegatronLiteLlamaConfig",
    "AutoModel": f"{REMOTE_MODELING_MODULE}.MegatronLiteLlamaModel",
    "AutoModelForCausalLM": f"{REMOTE_MODELING_MODULE}.MegatronLiteLlamaForCausalLM",
}
DEFAULT_SPECIAL_IDS = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1}  # megatron_lite's fixed ids
HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def config_special_ids(config: Config) -> dict[str, Any]:
    """The special ids of a model without a tokenizer file: those ``data.tokenizer`` records (an imported HF
    model's), or megatron_lite's fixed ids when it records none."""
    tokenizer = config.data.tokenizer
    recorded = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                "pad_token_id": tokenizer.pad_token_id}
    return recorded if any(value is not None for value in recorded.values()) else dict(DEFAULT_SPECIAL_IDS)


def build_llama_config(config: Config, fields: dict[str, Any]) -> Any:
    """``LlamaConfig`` / ``Qwen2Config`` (stock) or ``MegatronLiteLlamaConfig`` (remote code)."""
    if not uses_stock_model(config.model):
        from megatron_lite.convert.hf_remote.configuration_megatron_lite import MegatronLiteLlamaConfig

        hf_config = MegatronLiteLlamaConfig(**fields, architectures=["MegatronLiteLlamaForCausalLM"])
        hf_config.auto_map = dict(LLAMA_AUTO_MAP)
        return hf_config
    if stock_model_type(config.model) == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**fields, architectures=["Qwen2ForCausalLM"])
    from transformers import LlamaConfig

    return LlamaConfig(**fields, architectures=["LlamaForCausalLM"])


def build_hf_config(config: Config, special_ids: dict[str, Any], dtype: torch.dtype) -> Any:
    """The HF config object for ``config.model``: stock GPT-NeoX / Llama / Qwen2, or our remote-code classes."""
    fields = hf_config_fields(config.model) | special_ids | {"dtype": HF_DTYPE_NAMES[dtype]}
    if config.model.is_llama:
        return build_llama_config(config, fields)
    if uses_stock_model(config.model):
        from transformers import GPTNeoXConfig

        hf_config = GPTNeoXConfig(**fields, architectures=["GPTNeoXForCausalLM"])
    else:
        from megatron_lite.convert.hf_remote.configuration_megatron_lite import MegatronLiteConfig

        hf_config = MegatronLiteConfig(**fields, architectures=["MegatronLiteForCausalLM"])
        hf_config.auto_map = dict(AUTO_MAP)
    # The v4 keys too, set after __init__ (which consumes them): GPT-NeoX-family loaders that read
    # rotary_pct / rotary_emb_base default them to 0.25 / 10000 when they are missing.
    hf_config.rotary_pct = config.model.position.rotary_pct if config.model.uses_rotary else 0.0
    hf_config.rotary_emb_base = fields["rope_parameters"]["rope_theta"]  # the base HF computes with (ntk: scaled)
    return hf_config


def write_hf_metadata(config: Config, out: Path, tokenizer_path: str | Path | None, dtype: torch.dtype) -> None:
    """Everything of the HF directory but the weights: config.json, generation_config.json, the tokenizer,
    the remote-code files when needed and megatron_lite_config.yml."""
    from transformers import GenerationConfig

    special_ids = write_hf_tokenizer(tokenizer_path, out) if tokenizer_path is not None else config_special_ids(config)
    if not uses_stock_model(config.model):
        for module in (REMOTE_CONFIG_MODULE, REMOTE_MODELING_MODULE):
            shutil.copyfile(REMOTE_DIR / f"{module}.py", out / f"{module}.py")
    build_hf_config(config, special_ids, dtype).save_pretrained(out)
    GenerationConfig(**special_ids).save_pretrained(out)
    config_lib.save(config, out / TRAINING_CONFIG_FILE)


def export_hf(
    state: dict[str, torch.Tensor],
    config: Config,
    out_dir: str | Path,
    tokenizer_path: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write the HF directory of an in-memory state into ``out_dir`` (which must exist; the caller stages it).
    ``tools/convert_checkpoint.py`` streams large checkpoints instead (convert/sharded.py)."""
    out = Path(out_dir)
    hf_state = untie(cast(to_hf_state(state, config.model), dtype))
    write_hf_metadata(config, out, tokenizer_path, dtype)
    save_safetensors(hf_state, out / HF_WEIGHTS_FILE, metadata={"format": "pt"})
    return out
