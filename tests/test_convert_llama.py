"""LLaMA-family Hugging Face models in and out: tiny ``LlamaForCausalLM`` and ``Qwen2ForCausalLM`` built by
transformers from random configs (no download), each saved with a tokenizer.json made here, import with
equal logits (GQA, rope scaling, qkv biases, tied embeddings), generate greedily like transformers (also
through tools/generate.py), export back bitwise, and convert to CoCA with an export that loads as remote code
and matches our logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_lite.convert import convert_checkpoint
from megatron_lite.weights import load_model

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
safetensors_torch = pytest.importorskip("safetensors.torch")

REPO = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-5
VOCAB = 320  # model rows; the tokenizer has TOKENS (byte-level BPE needs 256 bytes + specials)
TOKENS = 300
TEXT = ("the quick brown fox jumps over the lazy dog while seven wizards quietly judge boxing matches. "
        "def add(x, y):\n    return x + y\n") * 20
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
CASES = {
    "llama_gqa": ("llama", {}),
    "llama_linear": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
    "llama3_scaling": ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0,
                                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 16}}),
    "llama_head_dim": ("llama", {"head_dim": 24, "num_key_value_heads": 1}),
    "qwen2_tied": ("qwen2", {"tie_word_embeddings": True, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
}


def write_tokenizer(out: Path, add_bos: bool) -> None:
    """A byte-level BPE tokenizer.json (+ tokenizer_config.json) trained here; with ``add_bos`` its
    post-processor puts <s> before every text, as Llama's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENS, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([TEXT], trainer)
    if add_bos:
        tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
                                                           "tokenizer_class": "PreTrainedTokenizerFast"}))


HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
              "mistral": ("MistralConfig", "MistralForCausalLM")}


def make_hf_model(kind: str, overrides: dict, out: Path, seed: int = 0, tokenizer: bool = True) -> torch.nn.Module:
    """A random tiny model saved by ``save_pretrained`` (with a tokenizer unless told otherwise); weights scaled
    up so that every layout error moves the logits."""
    config_class, model_class = (getattr(transformers, name) for name in HF_CLASSES[kind])
    torch.manual_seed(seed)
    model = model_class(config_class(**{**BASE, **overrides})).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
            else:
                parameter.normal_(0.0, 0.08)
    out.mkdir(parents=True)
    model.save_pretrained(out)
    if tokenizer:
        write_tokenizer(out, add_bos=kind == "llama")
    return model


def hf_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def imported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    kind, overrides = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    hf_model = make_hf_model(kind, overrides, root / "hf")
    convert_checkpoint(root / "hf", root / "ours", "megatron_lite")
    return request.param, root, hf_model


def test_import_has_equal_logits(imported) -> None:
    _, root, hf_model = imported
    ours = load_model(root / "ours").model
    ids = torch.randint(3, TOKENS, (2, 40), generator=torch.Generator().manual_seed(1))  # beyond 16: llama3 scaling acts
    got, want = ours(ids)[..., :VOCAB], hf_logits(hf_model, ids)
    assert (got - want).abs().max().item() <= TOLERANCE


def test_export_back_is_bitwise(imported, tmp_path: Path) -> None:
    name, root, _ = imported
    convert_checkpoint(root / "ours", tmp_path / "back", "hf")
    original = safetensors_torch.load_file(str(root / "hf" / "model.safetensors"))
    exported = safetensors_torch.load_file(str(tmp_path / "back" / "model.safetensors"))
    assert exported.keys() == original.keys()
    for key, tensor in original.items():
        assert torch.equal(exported[key], tensor), key
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["model_type"] == ("qwen2" if name.startswith("qwen2") else "llama") and "auto_map" not in config
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    ids = torch.randint(3, TOKENS, (1, 20), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(hf_logits(reloaded, ids), hf_logits(imported[2], ids), rtol=0, atol=0)


def hf_greedy_text(root: Path, hf_model: torch.nn.Module, prompt: str, new_tokens: int) -> str:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(root / "hf" / "tokenizer.json"))
    prompt_ids = tokenizer.encode(prompt).ids
    padding_rows = list(range(tokenizer.get_vocab_size(), VOCAB))  # ours never generates them either
    with torch.no_grad():
        output = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=new_tokens, do_sample=False,
                                   eos_token_id=2, pad_token_id=0, suppress_tokens=padding_rows)
    new = output[0, len(prompt_ids):].tolist()
    new = new[:new.index(2)] if 2 in new else new
    return tokenizer.decode(new, skip_special_tokens=False)


def test_greedy_generation_equals_transformers_also_through_the_tool(imported) -> None:
    _, root, hf_model = imported
    prompt = "the quick brown"
    expected = hf_greedy_text(root, hf_model, prompt, 12)
    result = subprocess.run([sys.executable, str(REPO / "tools" / "generate.py"), str(root / "ours"), "--prompt", prompt,
                             "--temperature", "0", "--max-new-tokens", "12"],
                            capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.rstrip("\n") == prompt + expected


@pytest.mark.parametrize("constraint", ["slack", "strict"])
def test_coca_conversion_exports_remote_code_that_matches_our_logits(tmp_path: Path, constraint: str) -> None:
    make_hf_model("llama", {}, tmp_path / "hf")
    convert_checkpoint(tmp_path / "hf", tmp_path / "coca", "megatron_lite", coca=constraint)
    ours = load_model(tmp_path / "coca").model
    assert ours.config.position.scheme == "coca" and ours.config.kv_heads == 2
    result = convert_checkpoint(tmp_path / "coca", tmp_path / "coca_hf", "hf")
    assert result.needs_remote_code
    remote = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "coca_hf", trust_remote_code=True).eval()
    ids = torch.randint(3, TOKENS, (2, 24), generator=torch.Generator().manual_seed(3))
    assert (ours(ids)[..., :VOCAB] - hf_logits(remote, ids)[..., :VOCAB]).abs().max().item() <= TOLERANCE
    original = safetensors_torch.load_file(str(tmp_path / "hf" / "model.safetensors"))
    exported = safetensors_torch.load_file(str(tmp_path / "coca_hf" / "model.safetensors"))
    assert all(torch.equal(exported[key], tensor) for key, tensor in original.items())  # the K projection is now T


@pytest.mark.parametrize(("overrides", "message"), [
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"mlp_bias": True}, "mlp_bias=true"),
    ({"attention_bias": True}, "attention_bias=true"),
])
def test_unsupported_llama_variants_are_one_line_errors(tmp_path: Path, overrides: dict, message: str) -> None:
    make_hf_model("llama", overrides, tmp_path / "hf")
    with pytest.raises(ValueError, match=message):
        convert_checkpoint(tmp_path / "hf", tmp_path / "ours", "megatron_lite")


# transformers computes rotary angles in float32 even in a float64 model (~5e-7 off ours here); every
# setting these tests guard moves the logits by > 0.1.
FLOAT64_TOLERANCE = 1e-5
YARN_SETTINGS = {
    "attention_factor_untruncated": {"attention_factor": 1.5, "truncate": False},
    "mscale_pair": {"mscale": 1.0, "mscale_all_dim": 0.5},  # DeepSeek-style: attention factor from the pair
}


def float64_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        output = model.double()(ids)
    return (output.logits if hasattr(output, "logits") else output)[..., :VOCAB]


@pytest.mark.parametrize("settings", list(YARN_SETTINGS.values()), ids=list(YARN_SETTINGS))
def test_yarn_settings_import_and_export_as_transformers_computes_them(tmp_path: Path, settings: dict) -> None:
    """YaRN's attention_factor (or the mscale pair it comes from) and truncate: false are imported (float64
    logits equal transformers') and exported (the stock model reloaded from our export computes the same)."""
    rope = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 16,
            **settings}
    hf_model = make_hf_model("llama", {"rope_parameters": rope}, tmp_path / "hf")
    convert_checkpoint(tmp_path / "hf", tmp_path / "ours", "megatron_lite")
    ids = torch.randint(3, TOKENS, (2, 60), generator=torch.Generator().manual_seed(5))
    want = float64_logits(hf_model, ids)
    assert (float64_logits(load_model(tmp_path / "ours").model, ids) - want).abs().max().item() <= FLOAT64_TOLERANCE
    convert_checkpoint(tmp_path / "ours", tmp_path / "back", "hf")
    written = json.loads((tmp_path / "back" / "config.json").read_text())["rope_parameters"]
    assert written["truncate"] is settings.get("truncate", True) and "attention_factor" in written
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert (float64_logits(reloaded, ids) - want).abs().max().item() <= FLOAT64_TOLERANCE


@pytest.mark.parametrize(("kind", "overrides"), [
    ("mistral", {"sliding_window": 64}),  # = max_position_embeddings: acts on every longer input
    ("mistral", {"sliding_window": 16}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}),
], ids=["mistral_window_at_max_positions", "mistral_window_16", "qwen2_window_16"])
def test_sliding_windows_are_refused_in_one_line(tmp_path: Path, kind: str, overrides: dict) -> None:
    make_hf_model(kind, overrides, tmp_path / "hf")
    with pytest.raises(ValueError, match=f"sliding_window={overrides['sliding_window']}: sliding-window attention is "
                                         "not supported"):
        convert_checkpoint(tmp_path / "hf", tmp_path / "ours", "megatron_lite")


def test_mistral_without_a_window_imports_and_a_window_at_max_positions_would_matter(tmp_path: Path) -> None:
    """sliding_window: null is full attention: equal float64 logits beyond max_position_embeddings (64). The
    same weights with a window of 64 give other logits there, which is why such a window is refused."""
    hf_model = make_hf_model("mistral", {"sliding_window": None}, tmp_path / "hf")
    convert_checkpoint(tmp_path / "hf", tmp_path / "ours", "megatron_lite")
    ids = torch.randint(3, TOKENS, (1, 96), generator=torch.Generator().manual_seed(6))
    want = float64_logits(hf_model, ids)
    assert (float64_logits(load_model(tmp_path / "ours").model, ids) - want).abs().max().item() <= FLOAT64_TOLERANCE
    windowed = transformers.MistralForCausalLM(transformers.MistralConfig(**{**BASE, "sliding_window": 64})).eval()
    windowed.load_state_dict(hf_model.state_dict())
    assert (float64_logits(windowed, ids) - want)[:, 64:].abs().max().item() > 0.1


@pytest.mark.parametrize("source", ["config.json", "generation_config.json"])
def test_special_ids_without_a_tokenizer_survive_import_and_export(tmp_path: Path, source: str) -> None:
    """A model saved without a tokenizer keeps bos/eos/pad = 1/2/0 (not megatron_lite's 0/0/1), read from
    config.json or, where it names none, generation_config.json; the export computes the same logits."""
    hf_model = make_hf_model("llama", {"pad_token_id": 0}, tmp_path / "hf", tokenizer=False)
    if source == "generation_config.json":
        config_file = tmp_path / "hf" / "config.json"
        fields = json.loads(config_file.read_text())
        config_file.write_text(json.dumps({key: value for key, value in fields.items() if not key.endswith("token_id")}))
    convert_checkpoint(tmp_path / "hf", tmp_path / "ours", "megatron_lite")
    convert_checkpoint(tmp_path / "ours", tmp_path / "back", "hf")
    for name in ("config.json", "generation_config.json"):
        written = json.loads((tmp_path / "back" / name).read_text())
        assert [written[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")] == [1, 2, 0], name
    ids = torch.randint(3, TOKENS, (1, 20), generator=torch.Generator().manual_seed(7))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert (float64_logits(reloaded, ids) - float64_logits(hf_model, ids)).abs().max().item() <= FLOAT64_TOLERANCE


class RunsCodeWhenUnpickled:
    """What a hostile pytorch_model.bin can hold: unpickling it runs a shell command (creates ``marker``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.marker}",)


def test_pickled_pytorch_model_bin_is_read_only_when_it_holds_only_tensors(tmp_path: Path) -> None:
    """A legacy pytorch_model.bin (torch.save of the state dict) imports; one that would run code is refused by
    tools/convert_checkpoint.py in one line, and the code does not run."""
    hf_model = make_hf_model("llama", {}, tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").unlink()
    weights = tmp_path / "hf" / "pytorch_model.bin"
    torch.save(hf_model.state_dict(), weights)
    convert_checkpoint(tmp_path / "hf", tmp_path / "ours", "megatron_lite")
    ids = torch.randint(3, TOKENS, (1, 12), generator=torch.Generator().manual_seed(4))
    assert (load_model(tmp_path / "ours").model(ids)[..., :VOCAB] - hf_logits(hf_model, ids)).abs().max() <= TOLERANCE

    marker = tmp_path / "code_ran"
    torch.save({**hf_model.state_dict(), "payload": RunsCodeWhenUnpickled(marker)}, weights)
    result = subprocess.run([sys.executable, str(REPO / "tools" / "convert_checkpoint.py"), str(tmp_path / "hf"),
                             str(tmp_path / "refused"), "--to", "megatron_lite"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {weights}: a pickled checkpoint that may run code (it "
                                                   "names posix.system, not only tensors): not loaded;"), result.stderr
    assert not marker.exists() and not (tmp_path / "refused").exists()


def test_sharded_checkpoints_convert_shard_by_shard_and_back_bitwise(tmp_path: Path) -> None:
    """save_pretrained's sharded layout (index + shards) becomes sharded consolidated weights that load_model
    reads, and exports back to the same HF shards, tensor for tensor."""
    hf_model = make_hf_model("llama", {}, tmp_path / "hf")
    hf_model.save_pretrained(tmp_path / "hf", max_shard_size="60KB")
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 2
    convert_checkpoint(tmp_path / "hf", tmp_path / "ours", "megatron_lite", force=True)
    assert (tmp_path / "ours" / "model.safetensors.index.json").is_file()
    ids = torch.randint(3, TOKENS, (1, 12), generator=torch.Generator().manual_seed(4))
    assert (load_model(tmp_path / "ours").model(ids)[..., :VOCAB] - hf_logits(hf_model, ids)).abs().max() <= TOLERANCE
    convert_checkpoint(tmp_path / "ours", tmp_path / "back", "hf")
    original_index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    exported_index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())["weight_map"]
    assert exported_index.keys() == original_index.keys()
    for name, file in original_index.items():
        original = safetensors_torch.load_file(str(tmp_path / "hf" / file))[name]
        assert torch.equal(safetensors_torch.load_file(str(tmp_path / "back" / exported_index[name]))[name], original)


PEAK_MEMORY_SCRIPT = """
import resource, sys
from megatron_lite.convert import convert_checkpoint
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
convert_checkpoint(sys.argv[1], sys.argv[2], "megatron_lite")
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


@pytest.mark.slow
def test_conversion_holds_about_one_shard_in_memory(tmp_path: Path) -> None:
    """A 400 MB model in 8 shards converts with the process's peak memory growing by far less than the model:
    it is never whole in memory (a whole-model conversion grows it by >= 400 MB)."""
    from safetensors.torch import save_file

    config = {**BASE, "model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8,
              "hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 8, "num_key_value_heads": 8}
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    weight_map, total = {}, 0
    shapes = {"self_attn.q_proj.weight": (1024, 1024), "self_attn.k_proj.weight": (1024, 1024),
              "self_attn.v_proj.weight": (1024, 1024), "self_attn.o_proj.weight": (1024, 1024),
              "mlp.gate_proj.weight": (2816, 1024), "mlp.up_proj.weight": (2816, 1024), "mlp.down_proj.weight": (1024, 2816),
              "input_layernorm.weight": (1024,), "post_attention_layernorm.weight": (1024,)}
    for layer in range(8):
        tensors = {f"model.layers.{layer}.{name}": torch.zeros(shape) for name, shape in shapes.items()}
        if layer == 7:
            tensors |= {"model.embed_tokens.weight": torch.zeros(VOCAB, 1024), "model.norm.weight": torch.zeros(1024),
                        "lm_head.weight": torch.zeros(VOCAB, 1024)}
        file = f"model-{layer + 1:05d}-of-00008.safetensors"
        save_file(tensors, str(out / file))
        weight_map |= {name: file for name in tensors}
        total += sum(tensor.numel() * 4 for tensor in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    result = subprocess.run([sys.executable, "-c", PEAK_MEMORY_SCRIPT, str(out), str(tmp_path / "ours")],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    growth = int(result.stdout.split()[-1])
    assert total > 400e6 and growth < total / 2, (growth, total)
