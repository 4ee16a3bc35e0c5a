"""Export to Hugging Face: logits of every scheme (and RoPE scalings) match the framework, generation
with the KV cache matches ours, tensor names are those of the stock GPTNeoXForCausalLM, and the
tokenizer loads with AutoTokenizer and reproduces SentencePiece ids.

The helpers at the top are shared with tests/test_convert_roundtrip.py.
"""

from __future__ import annotations

import ast
import json
import random
from pathlib import Path

import pytest
import torch

from conftest import SCHEME_IDS, SCHEMES, tiny_config
from megatron_lite.config import Config
from megatron_lite.convert import export_hf
from megatron_lite.data.sample_corpus import stdlib_dir
from megatron_lite.data.tokenizer import Tokenizer, train_tokenizer
from megatron_lite.eval.generation import generate
from megatron_lite.model import GPT, build_model

transformers = pytest.importorskip("transformers")

VOCAB_SIZE = 400  # tokenizer pieces; the model pads to 512 rows
TRAIN_LENGTH = 16  # tiny_config seq_length: sequences of 40 tokens exercise dynamic NTK
TOLERANCE = 1e-4
TOKENIZER_TEXTS = [
    "def f(x):\n\tif x:\n\t\treturn  x  \n\n\n    # four spaces, then a tab:\t\n",
    "  leading spaces\ttab\t\ttabs\n   trailing   ",
    "Unicode: café naïve Ærøskøbing ß Ελληνικά 中文字符 emoji 😀🐍 e\u0301 \u200b",
    "windows\r\nline\rends, a NUL \x00 and DEL \x7f",
    "numbers 1234567890 3.14159 0xFF 1e-5",
    "",
    " ",
]


def train_small_tokenizer(path: Path) -> Tokenizer:
    code = [(stdlib_dir() / name).read_text(encoding="utf-8") for name in ("textwrap.py", "json/decoder.py")]
    rng = random.Random(0)
    words = "the of and to in is was for on that with as by at from it an were are which".split()
    prose = [" ".join(rng.choice(words) for _ in range(60)) + ".\n" for _ in range(40)]
    return train_tokenizer(code + prose, path, vocab_size=VOCAB_SIZE)


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_small_tokenizer(tmp_path_factory.mktemp("tokenizer") / "tokenizer.model").path


def converter_config(scheme: str, constraint: str = "slack", **overrides: object) -> Config:
    return tiny_config(scheme, constraint, vocab_size=VOCAB_SIZE, **overrides)


def random_model(config: Config, seed: int = 0) -> GPT:
    """A model with large random weights, so that every tensor and layout error moves the logits."""
    model = build_model(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator) * (0.3 if parameter.dim() > 1 else 0.2)
            parameter.copy_(noise + (1.0 if "norm" in name and name.endswith("weight") else 0.0))
    return model


def export(model: GPT, config: Config, out: Path, tokenizer: Path | None = None) -> Path:
    out.mkdir(parents=True)
    return export_hf(model.state_dict(), config, out, tokenizer)


def load_hf(path: Path, remote: bool) -> torch.nn.Module:
    """Stock schemes must load without remote code; the others only with it."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=remote).eval()


def imported_modules(path: Path) -> set[str]:
    """Top-level packages a Python file imports ("." for its own directory)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add("." if node.level else node.module.split(".")[0])
    return found


# ----------------------------------------------------------------------------------------------

SCALED_CASES = [
    ("rope", "slack", {"type": "dynamic", "factor": 4.0}),
    ("coca", "slack", {"type": "dynamic", "factor": 4.0}),
    ("coca", "strict", {"type": "dynamic", "factor": 4.0}),
    ("rope", "slack", {"type": "linear", "factor": 2.0}),
    ("rope", "slack", {"type": "ntk", "factor": 4.0}),
    ("rope", "slack", {"type": "yarn", "factor": 4.0}),
    ("coca", "strict", {"type": "yarn", "factor": 4.0}),
    ("coca", "slack", {"type": "ntk", "factor": 2.0}),
]
CASES = [(scheme, constraint, None, 1.0) for scheme, constraint in SCHEMES] + [
    (scheme, constraint, scaling, 1.0) for scheme, constraint, scaling in SCALED_CASES
] + [("rope", "slack", None, 0.25), ("coca", "slack", None, 0.5), ("coca", "strict", None, 0.5)]
CASE_IDS = SCHEME_IDS + [f"{s}_{c}_{sc['type']}" if s == "coca" else f"{s}_{sc['type']}" for s, c, sc in SCALED_CASES] + [
    "rope_pct0.25", "coca_slack_pct0.5", "coca_strict_pct0.5"]


@pytest.mark.parametrize(("scheme", "constraint", "scaling", "rotary_pct"), CASES, ids=CASE_IDS)
def test_exported_logits_and_generation_match_framework(
    tmp_path: Path, scheme: str, constraint: str, scaling: dict | None, rotary_pct: float
) -> None:
    overrides: dict[str, object] = {"position.rotary_pct": rotary_pct}
    if scaling is not None:
        overrides["position.scaling"] = scaling
    config = converter_config(scheme, constraint, **overrides)
    model = random_model(config)
    stock = scheme in ("none", "rope")
    hf_model = load_hf(export(model, config, tmp_path / "hf"), remote=not stock)
    expected_class = "GPTNeoXForCausalLM" if stock else "MegatronLiteForCausalLM"
    assert type(hf_model).__name__ == expected_class

    ids = torch.randint(0, VOCAB_SIZE, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids), hf_model(ids).logits
    assert ours.std() > 1.0  # the logits are far from degenerate, so a 1e-4 match means something
    assert (ours - theirs).abs().max().item() <= TOLERANCE

    # Greedy generation through HF's KV cache; prompts longer than the training length exercise
    # dynamic NTK. Ours fixes the dynamic base from the final length, so does the remote code;
    # the stock model re-derives it every step (HF #25104), so only its shape is checked.
    prompt = ids[:, :20]
    generated = hf_model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert generated.shape == (2, 26)
    if not (stock and scaling is not None and scaling["type"] == "dynamic"):
        assert torch.equal(generated, generate(model, prompt, max_new_tokens=6))


def test_remote_code_model_equals_framework_with_cache_and_padding(tmp_path: Path) -> None:
    """ALiBi through a left-padded batch: padded rows see only their own tokens, like an unpadded run."""
    config = converter_config("alibi")
    model = random_model(config)
    hf_model = load_hf(export(model, config, tmp_path / "hf"), remote=True)
    ids = torch.randint(3, VOCAB_SIZE, (1, 12), generator=torch.Generator().manual_seed(2))
    padded = torch.cat([torch.full((1, 4), 1), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 12, dtype=torch.long)], dim=1)
    with torch.no_grad():
        padded_logits = hf_model(padded, attention_mask=mask).logits[:, 4:]
    assert (padded_logits - model(ids)).abs().max().item() <= TOLERANCE


def test_stock_export_has_the_names_save_pretrained_writes(tmp_path: Path) -> None:
    """Same names as a fresh stock model's save_pretrained (v5 writes the head as embed_out.weight), and
    loading our file then saving it again reproduces every tensor bitwise."""
    from safetensors import safe_open

    config = converter_config("rope", **{"position.rotary_pct": 0.25})
    out = export(random_model(config), config, tmp_path / "ours")
    hf_model = load_hf(out, remote=False)
    transformers.GPTNeoXForCausalLM(hf_model.config).save_pretrained(tmp_path / "fresh")
    hf_model.save_pretrained(tmp_path / "resaved")
    with safe_open(out / "model.safetensors", "pt") as ours, safe_open(tmp_path / "fresh" / "model.safetensors", "pt") as fresh, \
            safe_open(tmp_path / "resaved" / "model.safetensors", "pt") as resaved:
        assert set(ours.keys()) == set(fresh.keys()) == set(resaved.keys())
        assert {"gpt_neox.layers.1.attention.query_key_value.weight", "embed_out.weight"} <= set(ours.keys())
        for name in ours.keys():
            assert torch.equal(ours.get_tensor(name), resaved.get_tensor(name)), name
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "gpt_neox" and "auto_map" not in written
    for key, value in {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 256,
                       "vocab_size": 512, "use_parallel_residual": True, "layer_norm_eps": 1e-5, "hidden_act": "gelu",
                       "max_position_embeddings": 128, "position_scheme": "rope"}.items():
        assert written[key] == value, key
    assert written["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    assert written["rotary_pct"] == 0.25  # the v4 key, for loaders that default it to 0.25
    assert not (out / "modeling_megatron_lite.py").exists()


def test_gpt_neox_export_names_its_base_for_loaders_that_read_v4_keys(tmp_path: Path) -> None:
    """config.json carries rotary_emb_base beside rope_parameters: a GPT-NeoX loader that reads only the v4
    keys (rotary_emb_base, rotary_pct) gets base 500000, not its default 10000, and float64 logits equal ours."""
    config = converter_config("rope", **{"position.rotary_emb_base": 500000.0, "position.rotary_pct": 0.5})
    model = random_model(config)
    out = export(model, config, tmp_path / "hf")
    fields = json.loads((out / "config.json").read_text())
    assert fields["rotary_emb_base"] == 500000.0
    v4_fields = {key: value for key, value in fields.items() if key != "rope_parameters"}
    v4_style = transformers.GPTNeoXForCausalLM.from_pretrained(out, config=transformers.GPTNeoXConfig(**v4_fields))
    ids = torch.randint(0, VOCAB_SIZE, (2, 40), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ours = model.double()(ids)
        for hf_model in (v4_style, load_hf(out, remote=False)):
            assert (hf_model.eval().double()(ids).logits - ours).abs().max().item() <= 1e-5  # HF angles are float32


@pytest.mark.parametrize(("scheme", "expected"), [("none", 0.0), ("alibi", 0.0), ("learned", 0.0), ("coca", 0.5)])
def test_exported_rotary_pct_is_zero_without_rotary(tmp_path: Path, scheme: str, expected: float) -> None:
    config = converter_config(scheme, **{"position.rotary_pct": 0.5})
    written = json.loads((export(random_model(config), config, tmp_path / "hf") / "config.json").read_text())
    assert written["rotary_pct"] == expected
    loaded = transformers.AutoConfig.from_pretrained(tmp_path / "hf", trust_remote_code=scheme not in ("none",))
    assert loaded.rope_parameters["partial_rotary_factor"] == (0.0 if scheme == "none" else 0.5)


def test_remote_code_export_is_self_contained(tmp_path: Path) -> None:
    config = converter_config("coca", "strict", **{"position.scaling": {"type": "dynamic", "factor": 2.0}})
    out = export(random_model(config), config, tmp_path / "hf")
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "megatron_lite_gpt"
    assert (written["position_scheme"], written["coca_constraint"]) == ("coca", "strict")
    assert written["auto_map"]["AutoModelForCausalLM"] == "modeling_megatron_lite.MegatronLiteForCausalLM"
    assert written["rope_parameters"]["rope_type"] == "dynamic" and written["rope_parameters"]["factor"] == 2.0
    assert written["max_position_embeddings"] == TRAIN_LENGTH  # HF's dynamic NTK is relative to this field
    for name in ("configuration_megatron_lite.py", "modeling_megatron_lite.py"):  # the receiver may lack megatron_lite
        assert imported_modules(out / name) <= {"__future__", "math", "torch", "transformers", "."}, name
    with pytest.raises(ValueError, match="trust_remote_code"):
        transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=False)


@pytest.mark.parametrize("scheme", ["rope", "coca"])
def test_exported_tokenizer_matches_sentencepiece(tmp_path: Path, tokenizer_path: Path, scheme: str) -> None:
    """AutoTokenizer reads config.json first, so remote-code exports pass trust_remote_code there too."""
    config = converter_config(scheme)
    out = export(random_model(config), config, tmp_path / "hf", tokenizer_path)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=scheme == "coca")
    ours = Tokenizer(tokenizer_path)
    assert (hf_tokenizer.eos_token_id, hf_tokenizer.pad_token_id, hf_tokenizer.unk_token_id) == (0, 1, 2)
    assert [hf_tokenizer.convert_ids_to_tokens(i) for i in range(3)] == ["<|endoftext|>", "<|pad|>", "<unk>"]
    samples = TOKENIZER_TEXTS + [(stdlib_dir() / name).read_text(encoding="utf-8")[:4000] for name in ("difflib.py", "string.py")]
    for text in samples:
        ids = hf_tokenizer(text)["input_ids"]
        assert ids == ours.encode(text), text[:40]
        assert hf_tokenizer.decode(ids) == text
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["pad_token_id"]) == (0, 1)
