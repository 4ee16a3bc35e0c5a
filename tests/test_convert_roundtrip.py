"""Conversions through the library and the CLI: framework -> HF -> framework is bitwise identical,
HF GPT-NeoX (Pythia-style, v5 and v4 configs) imports with matching logits, --coca keeps every tensor,
and user errors (non-empty output, mismatched tensors, wrong scheme) are one clear ValueError."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import SCHEME_IDS, SCHEMES
from megatron_lite import config as config_lib
from megatron_lite.convert import convert_checkpoint
from megatron_lite.weights import load_model, save_consolidated
from test_convert_hf import TOLERANCE, converter_config, random_model, train_small_tokenizer
from script_loading import load_script

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_small_tokenizer(tmp_path_factory.mktemp("tokenizer") / "tokenizer.model").path


def consolidated_checkpoint(tmp_path: Path, scheme: str, constraint: str = "slack", tokenizer: Path | None = None,
                            **overrides: object) -> tuple[Path, dict[str, torch.Tensor]]:
    config = converter_config(scheme, constraint, **overrides)
    state = {name: tensor.clone() for name, tensor in random_model(config).state_dict().items()}
    return save_consolidated(state, config, tmp_path / "ckpt", tokenizer), state


def pythia_style_hf_model(path: Path, **config_overrides: object) -> torch.nn.Module:
    """A tiny stock GPTNeoXForCausalLM with partial rotary (0.25, as Pythia), saved with save_pretrained."""
    fields = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                  max_position_embeddings=64, hidden_act="gelu", use_parallel_residual=True, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    fields.update(config_overrides)
    model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**fields)).eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3 + (1.0 if "norm" in name and name.endswith("weight") else 0.0))
    model.save_pretrained(path)
    return model


def hf_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


# ----------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize(("scheme", "constraint"), SCHEMES, ids=SCHEME_IDS)
def test_framework_hf_framework_is_bitwise_identical(tmp_path: Path, tokenizer_path: Path, scheme: str, constraint: str) -> None:
    source, state = consolidated_checkpoint(tmp_path, scheme, constraint, tokenizer_path)
    convert_checkpoint(source, tmp_path / "hf", "hf")
    convert_checkpoint(tmp_path / "hf", tmp_path / "back", "megatron_lite")
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert back.keys() == state.keys()
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    assert config_lib.load(tmp_path / "back" / "config.yml") == config_lib.load(source / "config.yml")
    assert (tmp_path / "back" / "tokenizer.model").read_bytes() == tokenizer_path.read_bytes()


def test_tied_embeddings_round_trip(tmp_path: Path) -> None:
    source, state = consolidated_checkpoint(tmp_path, "rope", no_weight_tying=False)
    convert_checkpoint(source, tmp_path / "hf", "hf")
    assert "embed_out.weight" not in load_file(str(tmp_path / "hf" / "model.safetensors"))  # as save_pretrained writes it
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["tie_word_embeddings"] is True
    convert_checkpoint(tmp_path / "hf", tmp_path / "back", "safetensors")
    loaded = load_model(tmp_path / "back").model
    assert loaded.lm_head.weight is loaded.embed_in.weight and torch.equal(loaded.embed_in.weight, state["embed_in.weight"])


def test_dtype_option_casts_the_exported_weights(tmp_path: Path) -> None:
    source, state = consolidated_checkpoint(tmp_path, "coca")
    convert_checkpoint(source, tmp_path / "hf", "hf", dtype="bf16")
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert {tensor.dtype for tensor in weights.values()} == {torch.bfloat16}
    assert torch.equal(weights["gpt_neox.embed_in.weight"], state["embed_in.weight"].to(torch.bfloat16))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"


# ----------------------------------------------------------------------------------------------
# Hugging Face GPT-NeoX in


def test_pythia_style_import_matches_hf_logits(tmp_path: Path) -> None:
    hf_model = pythia_style_hf_model(tmp_path / "pythia")
    convert_checkpoint(tmp_path / "pythia", tmp_path / "ours", "megatron_lite")
    loaded = load_model(tmp_path / "ours")
    assert (loaded.config.model.position.scheme, loaded.config.model.rotary_dims) == ("rope", 4)
    ids = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours = loaded.model(ids)
    theirs = hf_logits(hf_model, ids)
    assert ours.std() > 1.0 and (ours - theirs).abs().max().item() <= TOLERANCE


def test_transformers_v4_style_checkpoint_imports(tmp_path: Path) -> None:
    """Legacy config keys (rotary_pct, rotary_emb_base, rope_scaling), the in-memory head name lm_head, an old buffer."""
    hf_model = pythia_style_hf_model(tmp_path / "v5", use_parallel_residual=False,
                                     rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 500.0,
                                                      "partial_rotary_factor": 0.5})
    legacy = tmp_path / "v4"
    legacy.mkdir()
    fields = json.loads((tmp_path / "v5" / "config.json").read_text())
    fields.pop("rope_parameters")
    fields.update(rotary_pct=0.5, rotary_emb_base=500.0, rope_scaling={"type": "dynamic", "factor": 2.0})
    (legacy / "config.json").write_text(json.dumps(fields))
    weights = load_file(str(tmp_path / "v5" / "model.safetensors"))
    weights["lm_head.weight"] = weights.pop("embed_out.weight")
    weights["gpt_neox.layers.0.attention.rotary_emb.inv_freq"] = torch.ones(4)  # old buffer: ignored
    save_file(weights, str(legacy / "model.safetensors"))
    convert_checkpoint(legacy, tmp_path / "ours", "megatron_lite")
    loaded = load_model(tmp_path / "ours")
    position = loaded.config.model.position
    assert (position.rotary_pct, position.rotary_emb_base, position.scaling.type, loaded.config.model.gpt_j_residual) == \
        (0.5, 500.0, "dynamic", False)
    ids = torch.randint(0, 512, (1, 100), generator=torch.Generator().manual_seed(5))  # beyond 64: dynamic NTK active
    with torch.no_grad():
        ours = loaded.model(ids)
    assert (ours - hf_logits(hf_model, ids)).abs().max().item() <= TOLERANCE


def test_coca_option_keeps_every_tensor_and_changes_only_the_scheme(tmp_path: Path) -> None:
    pythia_style_hf_model(tmp_path / "pythia", rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                               "partial_rotary_factor": 1.0})
    convert_checkpoint(tmp_path / "pythia", tmp_path / "rope", "megatron_lite")
    convert_checkpoint(tmp_path / "pythia", tmp_path / "coca", "megatron_lite", coca="strict")
    rope, coca = load_model(tmp_path / "rope"), load_model(tmp_path / "coca")
    assert (coca.config.model.position.scheme, coca.config.model.position.constraint) == ("coca", "strict")
    rope_state, coca_state = rope.model.state_dict(), coca.model.state_dict()
    assert all(torch.equal(rope_state[name], coca_state[name]) for name in rope_state)
    coca_config, rope_config = config_lib.to_dict(coca.config), config_lib.to_dict(rope.config)
    coca_config["model"]["position"].update(scheme="rope", constraint="slack")
    assert coca_config == rope_config
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():  # the function is not preserved: CoCA reads the K slot as T
        assert (rope.model(ids) - coca.model(ids)).abs().max().item() > 0.1


# ----------------------------------------------------------------------------------------------
# Errors


def test_non_empty_output_needs_force(tmp_path: Path) -> None:
    source, _ = consolidated_checkpoint(tmp_path, "alibi")
    output = tmp_path / "out"
    output.mkdir()
    (output / "stale.txt").write_text("old")
    with pytest.raises(ValueError, match=r"is not empty; pass --force"):
        convert_checkpoint(source, output, "hf")
    assert (output / "stale.txt").read_text() == "old"  # untouched
    convert_checkpoint(source, output, "hf", force=True)
    assert not (output / "stale.txt").exists() and (output / "model.safetensors").is_file()
    with pytest.raises(ValueError, match="contains INPUT"):
        convert_checkpoint(source, tmp_path, "safetensors", force=True)


def test_mismatched_tensors_are_listed_in_one_error(tmp_path: Path) -> None:
    source, _ = consolidated_checkpoint(tmp_path, "rope")
    convert_checkpoint(source, tmp_path / "hf", "hf")
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    del weights["gpt_neox.layers.1.mlp.dense_h_to_4h.bias"]
    weights["gpt_neox.layers.0.attention.extra.weight"] = torch.zeros(2)
    weights["gpt_neox.final_layer_norm.weight"] = torch.zeros(63)
    save_file(weights, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(ValueError) as error:
        convert_checkpoint(tmp_path / "hf", tmp_path / "back", "megatron_lite")
    message = str(error.value)
    assert "missing: layers.1.mlp.dense_h_to_4h.bias" in message
    assert "unexpected: layers.0.attention.extra.weight" in message
    assert "wrong shape: final_layer_norm.weight (63,) (expected (64,))" in message
    assert not (tmp_path / "back").exists()


def test_invalid_requests_name_the_value(tmp_path: Path) -> None:
    source, _ = consolidated_checkpoint(tmp_path, "alibi")
    with pytest.raises(ValueError, match="--coca converts a RoPE model; this one has model.position.scheme='alibi'"):
        convert_checkpoint(source, tmp_path / "out", "megatron_lite", coca="slack")
    with pytest.raises(ValueError, match="--to 'onnx'"):
        convert_checkpoint(source, tmp_path / "out", "onnx")
    with pytest.raises(ValueError, match="does not exist"):
        convert_checkpoint(tmp_path / "missing", tmp_path / "out", "hf")


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source, _ = consolidated_checkpoint(tmp_path, "coca")
    convert_cli = load_script("tools/convert_checkpoint.py")
    assert convert_cli.main([str(source), str(tmp_path / "hf"), "--to", "hf"]) == 0
    assert "trust_remote_code=True" in capsys.readouterr().out
    assert convert_cli.main([str(source), str(tmp_path / "hf"), "--to", "hf"]) == 2
    assert "pass --force" in capsys.readouterr().err
