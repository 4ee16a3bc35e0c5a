"""Config system: shipped YAMLs load, user errors name the key, overrides, round trip, docs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from megatron_lite import config as config_lib

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted(path for path in REPO.glob("configs/**/*.yml") if "data" not in path.relative_to(REPO / "configs").parts)
MIXES = sorted(REPO.glob("configs/data/*.yml"))


def test_configs_are_shipped() -> None:
    names = {path.relative_to(REPO / "configs").as_posix() for path in SHIPPED}
    for required in ("alibi_350m.yml", "rope_350m.yml", "coca_slack_350m.yml", "coca_strict_350m.yml", "coca_350m.yml",
                     "tiny/alibi.yml", "tiny/rope.yml", "tiny/coca_slack.yml", "tiny/coca_strict.yml"):
        assert required in names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_shipped_yaml_loads(path: Path) -> None:
    config = config_lib.load(path)
    assert config.model.hidden_size % config.model.num_attention_heads == 0


@pytest.mark.parametrize("path", MIXES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_shipped_mix_loads(path: Path) -> None:
    from megatron_lite.data.mix import group_weights, load_mix

    assert abs(sum(group_weights(load_mix(path)).values()) - 1) < 1e-9


def test_paper_configs_match_the_paper() -> None:
    for name in ("alibi", "rope", "coca_slack", "coca_strict", "coca"):
        model = config_lib.load(REPO / f"configs/{name}_350m.yml" if name != "coca" else REPO / "configs/coca_350m.yml").model
        assert (model.num_layers, model.hidden_size, model.num_attention_heads, model.ffn_size, model.seq_length) == (24, 1024, 16, 4096, 512)
        assert model.gpt_j_residual and model.no_weight_tying and model.activation == "gelu" and model.norm == "layernorm"
        assert model.padded_vocab_size % 128 == 0 and model.vocab_size == 50000
    assert config_lib.load(REPO / "configs/coca_350m.yml").model.position.constraint == "slack"


def write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "config.yml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    "data, message",
    [
        ({"model": {"hiden_size": 64}}, r"unknown config key model\.hiden_size; did you mean model\.hidden_size\?"),
        ({"model": {"position": {"shceme": "rope"}}}, r"model\.position\.shceme; did you mean model\.position\.scheme"),
        ({"modle": {}}, r"unknown config key modle; did you mean model\?"),
        ({"model": {"hidden_size": "big"}}, r"model\.hidden_size='big' \(str\): expected an integer"),
        ({"model": {"hidden_size": 64.5}}, r"model\.hidden_size=64\.5"),
        ({"model": {"gpt_j_residual": "yes"}}, r"model\.gpt_j_residual='yes'"),
        ({"model": {"position": {"scheme": "xpos"}}}, r"model\.position\.scheme='xpos': must be one of"),
        ({"model": {"position": {"constraint": "loose", "scheme": "coca"}}}, r"model\.position\.constraint='loose'"),
        ({"model": {"hidden_size": 100, "num_attention_heads": 16}}, r"model\.num_attention_heads=16: must divide model\.hidden_size=100"),
        ({"model": {"hidden_size": 96, "num_attention_heads": 4, "position": {"rotary_pct": 0.125}}},
         r"model\.position\.rotary_pct=0\.125: gives 3 rotary dims"),
        ({"model": {"hidden_size": 64, "num_attention_heads": 4, "position": {"rotary_pct": 0.1}}},
         r"model\.position\.rotary_pct=0\.1: gives 1 rotary dims"),
        ({"model": {"num_layers": 0}}, r"model\.num_layers=0: must be positive"),
        ({"model": {"position": {"scaling": {"type": "dynamic", "factor": 0.5}}}}, r"model\.position\.scaling\.factor=0\.5"),
        ({"model": {"attention": {"backend": "triton"}}}, r"model\.attention\.backend='triton'"),
        ({"model": {"seq_length": 512, "max_position_embeddings": 256}}, r"model\.max_position_embeddings=256"),
        ({"precision": "fp8"}, r"precision='fp8'"),
        ({"precision": "fp32", "model": {"attention": {"backend": "flash"}}}, r"backend=flash needs precision bf16 or fp16"),
        ({"model": {"position": 3}}, r"model\.position=3 \(int\): expected a mapping"),
        ({"data": {"validation_fraction": 1.5}}, r"data\.validation_fraction=1\.5"),
        ({"data": {"tokenizr": {}}}, r"data\.tokenizr; did you mean data\.tokenizer"),
    ],
)
def test_user_errors_name_the_key(tmp_path: Path, data: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config_lib.load(write(tmp_path, data))


def test_missing_file_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        config_lib.load(tmp_path / "nope.yml")


def test_yaml_exponent_without_dot_is_a_float(tmp_path: Path) -> None:
    path = tmp_path / "config.yml"
    path.write_text("model:\n  layernorm_epsilon: 1e-6\n")  # PyYAML reads this as a string
    assert config_lib.load(path).model.layernorm_epsilon == 1e-6


def test_dotted_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, {"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4}})
    config = config_lib.load(path, ["model.position.scheme=coca", "model.position.constraint=strict",
                                    "model.position.scaling.type=dynamic", "model.position.scaling.factor=4",
                                    "model.attention.backend=chunked", "precision=bf16"])
    assert config.model.position.scheme == "coca" and config.model.position.constraint == "strict"
    assert config.model.position.scaling.factor == 4.0 and config.model.attention.backend == "chunked"
    assert config.precision == "bf16"
    with pytest.raises(ValueError, match=r"model\.position\.schem; did you mean model\.position\.scheme"):
        config_lib.load(path, ["model.position.schem=rope"])
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        config_lib.load(path, ["model.position.scheme"])
    with pytest.raises(ValueError, match="is not a section"):
        config_lib.load(path, ["model.num_layers.x=1"])
    with pytest.raises(ValueError, match=r"override 'model.hidden_size=\[3': the value is not valid YAML"):
        config_lib.load(path, ["model.hidden_size=[3"])


def test_save_load_round_trip(tmp_path: Path) -> None:
    original = config_lib.load(REPO / "configs/coca_strict_350m.yml", ["model.position.scaling.type=yarn",
                                                                      "model.position.scaling.factor=8"])
    config_lib.save(original, tmp_path / "saved.yml")
    assert config_lib.load(tmp_path / "saved.yml") == original


def test_ignored_settings_warn(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="scaling.type=dynamic is ignored"):
        config_lib.from_dict({"model": {"position": {"scheme": "alibi", "scaling": {"type": "dynamic", "factor": 2}}}})


def test_every_key_is_documented_and_docs_are_current() -> None:
    def walk(cls: type) -> None:
        for item in dataclasses.fields(cls):
            assert item.metadata.get("help"), f"{cls.__name__}.{item.name} has no help text"
            if dataclasses.is_dataclass(item.default_factory) if item.default_factory is not dataclasses.MISSING else False:
                walk(item.default_factory)

    from megatron_lite.config import GroupConfig, MixConfig, SourceConfig

    walk(config_lib.Config)
    for cls in (MixConfig, GroupConfig, SourceConfig):
        walk(cls)
    assert (REPO / "docs/config.md").read_text() == config_lib.documentation_page(), \
        "run: python -m megatron_lite.config --doc > docs/config.md"


def test_docs_name_the_current_hugging_face_cli() -> None:
    """huggingface_hub >= 1.0 ships `hf` (`hf download`, `hf auth login`); `huggingface-cli` is gone."""
    texts = {path: path.read_text() for path in [REPO / "README.md", *(REPO / "docs").glob("*.md"),
                                                 *(REPO / "configs").rglob("*.yml")]}
    assert not [str(path) for path, text in texts.items() if "huggingface-cli" in text]
    assert "hf download wikimedia/wikipedia --repo-type dataset" in texts[REPO / "configs/data/paper_mix.yml"]
