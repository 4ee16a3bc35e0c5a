"""Tensor names and layouts: megatron_lite ``GPT.state_dict()`` <-> Hugging Face ``GPTNeoXForCausalLM``.

The two layouts are the same tensors under different names. Both fuse the attention input
projection per head: ``query_key_value`` is (3 * hidden, hidden) whose rows, viewed as
(heads, 3, head_dim), hold head h's [q | k-or-t | v] (megatron_lite views the output as
(B, T, heads, 3 * head_dim) and splits the last dim; HF GPT-NeoX does the same and ``chunk``s it).
So no tensor is permuted; only names change:

    megatron_lite                      Hugging Face (transformers v5)
    embed_in.weight                    gpt_neox.embed_in.weight
    position.embedding.weight          gpt_neox.embed_positions.weight        (learned scheme only)
    layers.N.<...>                     gpt_neox.layers.N.<...>
    final_layer_norm.<...>             gpt_neox.final_layer_norm.<...>
    lm_head.weight                     embed_out.weight

The head: transformers v5 calls the module ``lm_head`` in memory, but ``save_pretrained`` reverts
its conversion mapping (``conversion_mapping.py``: ``^embed_out.`` -> ``lm_head.``) and writes
``embed_out.weight``, the name of transformers v4 and of every Pythia checkpoint on the Hub. We
write that name too (v4 and v5 both load it, and the remote-code model names its head
``embed_out``), and read either name.

The LLaMA family (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, our ``megatron_lite_llama`` remote code) keeps
HF's names inside a block, so again only prefixes change and nothing is permuted (HF Llama checkpoints
already use the rotate-half rotary layout that megatron_lite uses):

    megatron_lite                      Hugging Face
    embed_in.weight                    model.embed_tokens.weight
    position.embedding.weight          model.embed_positions.weight           (learned scheme only)
    layers.N.<...>                     model.layers.N.<...>   (self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj)
    final_layer_norm.weight            model.norm.weight
    lm_head.weight                     lm_head.weight
"""

from __future__ import annotations

import torch

from megatron_lite.config import ModelConfig
from megatron_lite.weights import check_tensors, expected_shapes

HF_PREFIX = "gpt_neox."
FRAMEWORK_POSITION_TABLE = "position.embedding.weight"
HF_POSITION_TABLE = "gpt_neox.embed_positions.weight"
LM_HEAD = "lm_head.weight"
HF_LM_HEAD = "embed_out.weight"  # on disk (what save_pretrained writes)
HF_IN_MEMORY_LM_HEAD = "lm_head.weight"  # transformers v5 module name, found in some files
# Buffers older GPT-NeoX checkpoints saved next to the weights; they carry no learned state.
IGNORED_HF_SUFFIXES = (".attention.bias", ".attention.masked_bias", "rotary_emb.inv_freq")


# LLaMA family: megatron_lite name -> HF name for the tensors outside the blocks.
LLAMA_PREFIX = "model."
LLAMA_TOP_LEVEL = {"embed_in.weight": "model.embed_tokens.weight", "final_layer_norm.weight": "model.norm.weight",
                   LM_HEAD: LM_HEAD, FRAMEWORK_POSITION_TABLE: "model.embed_positions.weight"}
LLAMA_TOP_LEVEL_FROM_HF = {hf: ours for ours, hf in LLAMA_TOP_LEVEL.items()}


def framework_to_hf_name(name: str, llama: bool = False) -> str:
    if llama:
        return LLAMA_TOP_LEVEL.get(name, LLAMA_PREFIX + name)
    if name == LM_HEAD:
        return HF_LM_HEAD
    if name == FRAMEWORK_POSITION_TABLE:
        return HF_POSITION_TABLE
    return HF_PREFIX + name


def hf_to_framework_name(name: str, llama: bool = False) -> str:
    if llama:
        if name in LLAMA_TOP_LEVEL_FROM_HF:
            return LLAMA_TOP_LEVEL_FROM_HF[name]
        return name[len(LLAMA_PREFIX):] if name.startswith(LLAMA_PREFIX) else name
    if name in (HF_LM_HEAD, HF_IN_MEMORY_LM_HEAD):
        return LM_HEAD
    if name == HF_POSITION_TABLE:
        return FRAMEWORK_POSITION_TABLE
    if name.startswith(HF_PREFIX):
        return name[len(HF_PREFIX):]
    return name  # left as is: the shape check reports it as unexpected


def rename_to_hf(state: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """HF names, unchecked (one shard of a model may hold any subset); a tied LM head is left out, as
    ``save_pretrained`` does."""
    tied = not model.no_weight_tying
    return {framework_to_hf_name(name, model.is_llama): tensor for name, tensor in state.items()
            if not (tied and name == LM_HEAD)}


def rename_from_hf(hf_state: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """megatron_lite names, unchecked; old buffers dropped; a tied head, which ``save_pretrained`` does not
    store, restored from the embedding where that is present."""
    state = {hf_to_framework_name(name, model.is_llama): tensor for name, tensor in hf_state.items()
             if not name.endswith(IGNORED_HF_SUFFIXES)}
    if not model.no_weight_tying and LM_HEAD not in state and "embed_in.weight" in state:
        state[LM_HEAD] = state["embed_in.weight"]
    return state


def to_hf_state(state: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """A whole model's HF names, checked against ``model``."""
    check_tensors(state, expected_shapes(model), "megatron_lite weights")
    return rename_to_hf(state, model)


def from_hf_state(hf_state: dict[str, torch.Tensor], model: ModelConfig, source: str) -> dict[str, torch.Tensor]:
    """A whole model's megatron_lite names, checked against ``model``."""
    state = rename_from_hf(hf_state, model)
    check_tensors(state, expected_shapes(model), source)
    return state


def cast(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating tensors in ``dtype``, contiguous, on the CPU; a tensor listed twice (tied) is converted once."""
    converted: dict[int, torch.Tensor] = {}
    out = {}
    for name, tensor in state.items():
        key = id(tensor)
        if key not in converted:
            moved = tensor.detach().to("cpu")
            converted[key] = (moved.to(dtype) if moved.is_floating_point() else moved).contiguous()
        out[name] = converted[key]
    return out


def untie(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Own storage for every tensor: safetensors refuses tensors sharing storage (a tied head, or the
    views into one flat buffer that DeepSpeed's consolidation returns)."""
    seen: set[int] = set()
    out = {}
    for name, tensor in state.items():
        pointer = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if pointer in seen else tensor
        seen.add(pointer)
    return out
