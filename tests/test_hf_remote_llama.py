"""Remote code for the LLaMA family (``MegatronLiteLlamaForCausalLM``): a megatron_lite ``architecture: llama``
model saved under HF Llama tensor names loads with ``trust_remote_code=True`` and matches our logits (fp32,
<= 1e-5) for every position scheme, grouped-query attention, an explicit head_dim with q/k/v biases, tied
embeddings, partial rotary and every rope type; greedy ``generate`` through HF's KV cache equals ours, also
for a left-padded batch. With RoPE the remote model also equals the stock LlamaForCausalLM / Qwen2ForCausalLM.

config.json and the tensor names come from the exporter's functions (hf_config_fields, to_hf_state).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import tiny_config
from megatron_lite.config import Config
from megatron_lite.convert.hf_config import hf_config_fields
from megatron_lite.convert.hf_export import LLAMA_AUTO_MAP
from megatron_lite.convert.hf_names import to_hf_state
from megatron_lite.eval.generation import generate
from megatron_lite.model import GPT

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402  (after the transformers skip)

from megatron_lite.convert.hf_remote import modeling_megatron_lite as remote  # noqa: E402
from megatron_lite.convert.hf_remote.configuration_megatron_lite import MegatronLiteLlamaConfig  # noqa: E402
from megatron_lite.model.rope import llama3_inv_freq  # noqa: E402
from test_convert_hf import random_model  # noqa: E402

REMOTE_DIR = Path(remote.__file__).parent
VOCAB_SIZE = 250  # padded to 256 rows
TRAIN_LENGTH = 16  # tiny_config seq_length: sequences of 40 tokens exercise dynamic NTK and the scalings
TOLERANCE = 1e-5
STOCK_TOLERANCE = 1e-4
YARN_EXPLICIT = {"type": "yarn", "factor": 4.0, "attention_factor": 1.3, "truncate": False}  # HF's non-defaults
EOS_ID, PAD_ID = 0, 1  # megatron_lite's fixed ids


def llama_config(scheme: str, constraint: str = "slack", **overrides: Any) -> Config:
    """tiny_config as llama: 2 layers, hidden 64, 4 query heads, 2 key/value heads, SwiGLU width 96."""
    base: dict[str, Any] = {"architecture": "llama", "num_key_value_heads": 2, "intermediate_size": 96}
    return tiny_config(scheme, constraint, vocab_size=VOCAB_SIZE, **(base | overrides))


def hf_llama_state(model: GPT) -> dict[str, torch.Tensor]:
    """HF names (the exporter's), own storage per tensor; a tied head is left out, as save_pretrained does."""
    return {name: tensor.detach().clone().contiguous() for name, tensor in to_hf_state(model.state_dict(), model.config).items()}


def save_remote(model: GPT, out: Path) -> Path:
    """The exporter's files for ``model`` as remote code, whatever its scheme (a rope model too, which the
    exporter itself writes for the stock class): config.json with auto_map, model.safetensors, the modules."""
    out.mkdir(parents=True)
    special_ids = {"bos_token_id": EOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    hf_config = MegatronLiteLlamaConfig(**hf_config_fields(model.config), **special_ids,
                                        architectures=["MegatronLiteLlamaForCausalLM"])
    hf_config.auto_map = dict(LLAMA_AUTO_MAP)
    hf_config.save_pretrained(out)
    save_file(hf_llama_state(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in ("configuration_megatron_lite.py", "modeling_megatron_lite.py"):
        shutil.copyfile(REMOTE_DIR / name, out / name)
    return out


def load_remote(path: Path) -> torch.nn.Module:
    hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True,
                                                                       output_loading_info=True)
    assert type(hf_model).__name__ == "MegatronLiteLlamaForCausalLM"
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return hf_model.eval()


def ours_as_hf_generates(tokens_BT: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """Our eos-aware greedy output as HF writes it: after a row's eos, pad ids instead of eos ids."""
    new_BN = tokens_BT[:, prompt_length:]
    is_eos = new_BN == EOS_ID
    after_eos = (is_eos.cumsum(dim=1) - is_eos.long()) > 0
    return torch.cat([tokens_BT[:, :prompt_length], new_BN.masked_fill(after_eos, PAD_ID)], dim=1)


def greedy(model: GPT, prompt_BT: torch.Tensor, new_tokens: int) -> torch.Tensor:
    return ours_as_hf_generates(generate(model, prompt_BT, new_tokens, eos_token_id=EOS_ID), prompt_BT.shape[1])


# ----------------------------------------------------------------------------------------------

CASES: list[tuple[str, str, str, dict[str, Any]]] = [
    # id, scheme, constraint, overrides (all grouped-query: 4 query heads, 2 key/value heads, unless set)
    ("none", "none", "slack", {}),
    ("learned", "learned", "slack", {}),
    ("sinusoidal", "sinusoidal", "slack", {}),
    ("alibi", "alibi", "slack", {}),
    ("rope", "rope", "slack", {}),
    ("coca_slack", "coca", "slack", {}),
    ("coca_strict", "coca", "strict", {}),
    ("coca_slack_mha", "coca", "slack", {"num_key_value_heads": 4}),
    ("coca_slack_mqa", "coca", "slack", {"num_key_value_heads": 1}),
    ("coca_strict_headdim24_qkvbias", "coca", "strict", {"kv_channels": 24, "qkv_bias": True}),
    ("alibi_headdim24_qkvbias", "alibi", "slack", {"kv_channels": 24, "qkv_bias": True}),
    ("rope_tied", "rope", "slack", {"no_weight_tying": False}),
    ("coca_slack_tied", "coca", "slack", {"no_weight_tying": False}),
    ("rope_pct0.5", "rope", "slack", {"position.rotary_pct": 0.5}),
    ("coca_slack_pct0.5", "coca", "slack", {"position.rotary_pct": 0.5}),
    ("coca_strict_pct0.5", "coca", "strict", {"position.rotary_pct": 0.5}),
    ("rope_linear", "rope", "slack", {"position.scaling": {"type": "linear", "factor": 2.0}}),
    ("rope_ntk", "rope", "slack", {"position.scaling": {"type": "ntk", "factor": 4.0}}),
    ("coca_slack_dynamic", "coca", "slack", {"position.scaling": {"type": "dynamic", "factor": 4.0}}),
    ("coca_strict_dynamic", "coca", "strict", {"position.scaling": {"type": "dynamic", "factor": 4.0}}),
    ("rope_yarn", "rope", "slack", {"position.scaling": {"type": "yarn", "factor": 4.0}}),
    ("coca_strict_yarn", "coca", "strict", {"position.scaling": {"type": "yarn", "factor": 4.0}}),
    ("coca_slack_yarn_attention_factor_untruncated", "coca", "slack", {"position.scaling": YARN_EXPLICIT}),
    ("rope_llama3", "rope", "slack", {"position.scaling": {"type": "llama3", "factor": 4.0}}),
    ("coca_slack_llama3_pct0.5", "coca", "slack", {"position.scaling": {"type": "llama3", "factor": 4.0},
                                                   "position.rotary_pct": 0.5}),
]


@pytest.mark.parametrize(("scheme", "constraint", "overrides"), [case[1:] for case in CASES],
                         ids=[case[0] for case in CASES])
def test_remote_llama_logits_and_generation_match_framework(
    tmp_path: Path, scheme: str, constraint: str, overrides: dict[str, Any]
) -> None:
    model = random_model(llama_config(scheme, constraint, **overrides))
    hf_model = load_remote(save_remote(model, tmp_path / "hf"))
    if model.config.qkv_bias:
        assert hf_model.model.layers[0].self_attn.q_proj.bias is not None
    assert hf_model.model.layers[0].self_attn.o_proj.bias is None
    if not model.config.no_weight_tying:
        assert hf_model.lm_head.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()

    ids = torch.randint(3, VOCAB_SIZE, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids), hf_model(ids).logits
    assert ours.std() > 1.0  # far from degenerate, so a 1e-5 match means something
    assert (ours - theirs).abs().max().item() <= TOLERANCE

    # Greedy through HF's KV cache (prompts longer than the training length exercise dynamic NTK, whose
    # base both fix from the final length).
    prompt = ids[:, :20]
    assert torch.equal(hf_model.generate(prompt, max_new_tokens=6, do_sample=False), greedy(model, prompt, 6))


@pytest.mark.parametrize(("scheme", "constraint"), [("coca", "slack"), ("alibi", "slack")], ids=["coca_slack", "alibi"])
def test_left_padded_batch_generation_equals_unpadded(tmp_path: Path, scheme: str, constraint: str) -> None:
    """A short prompt left-padded beside a long one generates what it generates alone (positions from the
    attention mask, padded keys hidden in prefill and in every cached decode step)."""
    model = random_model(llama_config(scheme, constraint))
    hf_model = load_remote(save_remote(model, tmp_path / "hf"))
    generator = torch.Generator().manual_seed(3)
    long = torch.randint(3, VOCAB_SIZE, (1, 12), generator=generator)
    short = torch.randint(3, VOCAB_SIZE, (1, 8), generator=generator)
    batch = torch.cat([long, torch.cat([torch.full((1, 4), PAD_ID), short], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :4] = 0
    generated = hf_model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(generated[0:1], greedy(model, long, 6))
    assert torch.equal(generated[1:2, 4:], greedy(model, short, 6))


@pytest.mark.parametrize(("stock", "overrides"), [
    ("LlamaForCausalLM", {}),
    ("LlamaForCausalLM", {"no_weight_tying": False, "position.scaling": {"type": "llama3", "factor": 4.0}}),
    ("Qwen2ForCausalLM", {"kv_channels": 24, "qkv_bias": True}),
    ("LlamaForCausalLM", {"position.scaling": YARN_EXPLICIT}),
], ids=["llama", "llama_tied_llama3", "qwen2_headdim24", "llama_yarn_attention_factor_untruncated"])
def test_remote_rope_model_equals_stock_model(tmp_path: Path, stock: str, overrides: dict[str, Any]) -> None:
    """Same file loaded by the stock class (model_type switched): same tensor names, same logits."""
    model = random_model(llama_config("rope", **overrides))
    out = save_remote(model, tmp_path / "hf")
    hf_model = load_remote(out)
    fields = hf_config_fields(model.config)
    if stock == "Qwen2ForCausalLM":
        assert model.config.qkv_bias  # Qwen2: biases on q/k/v, none on o_proj, as qkv_bias
        stock_config = transformers.Qwen2Config(**fields)
    else:
        stock_config = transformers.LlamaConfig(**fields)
    stock_config.save_pretrained(tmp_path / "stock")
    (tmp_path / "stock" / "model.safetensors").symlink_to(out / "model.safetensors")
    stock_model, info = getattr(transformers, stock).from_pretrained(tmp_path / "stock", output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert set(hf_model.state_dict()) == set(stock_model.state_dict())
    ids = torch.randint(3, VOCAB_SIZE, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, remote_logits, stock_logits = model(ids), hf_model(ids).logits, stock_model.eval()(ids).logits
    assert (remote_logits - ours).abs().max().item() <= TOLERANCE
    # The stock rotary tables come from float32 angles (ours and the remote code's from float64): ~2e-5 here.
    assert (stock_logits - ours).abs().max().item() <= STOCK_TOLERANCE


@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_llama3_frequencies_equal_hf_and_framework(partial: float) -> None:
    """Llama-3.1's own settings (head_dim 128, theta 500000, factor 8, 8192, 1, 4): all three bands occur."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "original_max_position_embeddings": 8192,
              "low_freq_factor": 1.0, "high_freq_factor": 4.0, "partial_rotary_factor": partial}
    config = MegatronLiteLlamaConfig(hidden_size=512, num_attention_heads=4, num_key_value_heads=4, head_dim=128,
                                     max_position_embeddings=131072, rope_parameters=params, position_scheme="rope")
    ours, attention_factor = remote.inverse_frequencies(config, seq_len=100000)
    theirs, their_factor = ROPE_INIT_FUNCTIONS["llama3"](config)
    dims = int(128 * partial)
    assert ours.dtype == torch.float64 and ours.shape == (dims // 2,) and attention_factor == their_factor == 1.0
    torch.testing.assert_close(ours.float(), theirs, rtol=2e-6, atol=0.0)  # HF computes in float32
    assert torch.equal(ours, llama3_inv_freq(dims, 500000.0, 8.0, 8192, 1.0, 4.0))
    base = remote.base_inverse_frequencies(dims, 500000.0)
    assert (ours == base).any() and (ours == base / 8).any() and ((ours != base) & (ours != base / 8)).any()


def test_config_validates_and_round_trips(tmp_path: Path) -> None:
    config = MegatronLiteLlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                     qkv_bias=True, position_scheme="coca", coca_constraint="strict")
    config.save_pretrained(tmp_path)
    loaded = MegatronLiteLlamaConfig.from_pretrained(tmp_path)
    assert (loaded.model_type, loaded.position_scheme) == ("megatron_lite_llama", "coca")
    assert loaded.coca_constraint == "strict"
    assert (loaded.qkv_bias, loaded.head_dim, loaded.num_key_value_heads, loaded.attention_bias) == (True, 24, 2, False)
    for bad in ({"position_scheme": "xpos"}, {"coca_constraint": "loose"}, {"num_key_value_heads": 3}):
        with pytest.raises(ValueError):
            MegatronLiteLlamaConfig(hidden_size=64, num_attention_heads=4, **bad)
