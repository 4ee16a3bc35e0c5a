"""Config system: shipped YAMLs load, user errors name the key, overrides, round trip, docs."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from megatron_lite import config as config_lib
from megatron_lite.config.loading import merge_under, read_chain

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted(path for path in REPO.glob("configs/**/*.yml") if "data" not in path.relative_to(REPO / "configs").parts)
MIXES = sorted(REPO.glob("configs/data/*.yml"))


def test_configs_are_shipped() -> None:
    names = {path.relative_to(REPO / "configs").as_posix() for path in SHIPPED}
    for required in ("alibi_350m.yml", "rope_350m.yml", "coca_strict_350m.yml", "coca_350m.yml",
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
    for name in ("alibi", "rope", "coca_strict", "coca"):
        model = config_lib.load(REPO / f"configs/{name}_350m.yml").model
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


def write_yaml(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_base_chain_merges_under_the_file(tmp_path: Path) -> None:
    """Child keys win, mappings merge key by key, lists are replaced whole, chains resolve from each file's
    own directory, --set applies last."""
    write_yaml(tmp_path / "shared/root.yml", "model: {num_layers: 6, hidden_size: 64, num_attention_heads: 4,\n"
               "  position: {scheme: coca, constraint: strict, rotary_emb_base: 500}}\n"
               "train: {lr: 1.0e-3, stages: [{steps: 5, trainable: ['*']}, {steps: 5, trainable: ['*']}]}\n")
    write_yaml(tmp_path / "shared/middle.yml", "base: root.yml\nmodel: {num_layers: 3, position: {constraint: slack}}\n"
               "seed: 7\n")
    child = write_yaml(tmp_path / "runs/child.yml", "base: ../shared/middle.yml\nmodel: {num_layers: 2}\n"
                       "train: {stages: [{steps: 4, trainable: ['*']}]}\n")
    config = config_lib.load(child, ["seed=9"])
    assert config.model.num_layers == 2 and config.model.hidden_size == 64  # child over middle over root
    assert (config.model.position.scheme, config.model.position.constraint, config.model.position.rotary_emb_base) \
        == ("coca", "slack", 500.0)  # nested mapping merged across three files
    assert [stage.steps for stage in config.train.stages] == [4] and config.train.lr == 1e-3  # list replaced
    assert config.seed == 9
    assert [path.name for path, _ in read_chain(child, "missing")] == ["child.yml", "middle.yml", "root.yml"]


def test_base_merge_keeps_its_inputs() -> None:
    base = {"model": {"position": {"scheme": "rope", "rotary_pct": 0.5}}, "seed": 1}
    child = {"model": {"position": {"scheme": "coca"}}, "seed": None}
    assert merge_under(base, child) == {"model": {"position": {"scheme": "coca", "rotary_pct": 0.5}}, "seed": None}
    assert base == {"model": {"position": {"scheme": "rope", "rotary_pct": 0.5}}, "seed": 1}


def test_base_cycle_is_refused_in_one_line(tmp_path: Path) -> None:
    write_yaml(tmp_path / "a.yml", "base: b.yml\n")
    write_yaml(tmp_path / "b.yml", "base: ./a.yml\n")
    with pytest.raises(ValueError) as error:
        config_lib.load(tmp_path / "a.yml")
    assert str(error.value) == f"{tmp_path / 'b.yml'}: base='./a.yml' makes a cycle: {tmp_path / 'a.yml'} -> " \
                               f"{tmp_path / 'b.yml'} -> {tmp_path / 'a.yml'}"
    write_yaml(tmp_path / "self.yml", "base: self.yml\n")
    with pytest.raises(ValueError, match=r"self\.yml: base='self\.yml' makes a cycle: .*self\.yml -> .*self\.yml$"):
        config_lib.load(tmp_path / "self.yml")


@pytest.mark.parametrize("text, message", [
    ("base: nope.yml\n", r"child\.yml: base='nope\.yml': file .*nope\.yml does not exist$"),
    ("base: [a.yml]\n", r"child\.yml: base=\['a\.yml'\] \(list\): expected the path of a YAML file"),
    ("base: ''\n", r"child\.yml: base='' \(str\): expected the path of a YAML file"),
])
def test_bad_base_is_refused_in_one_line(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        config_lib.load(write_yaml(tmp_path / "child.yml", text))
    assert "\n" not in str(error.value)


def test_mix_files_take_a_base(tmp_path: Path) -> None:
    from megatron_lite.data.mix import group_weights, load_mix

    write_yaml(tmp_path / "base_mix.yml", "groups:\n  text: {weight: 3, sources: {a: {type: text, path: a.txt}}}\n"
               "  code: {weight: 1, sources: {b: {type: text, path: b.txt}}}\n")
    child = write_yaml(tmp_path / "mix.yml", "base: base_mix.yml\ngroups: {code: {weight: 3}}\n")
    mix = load_mix(child)
    assert group_weights(mix) == {"text": 0.5, "code": 0.5} and list(mix.groups["code"].sources) == ["b"]


def alias_bomb(levels: int) -> str:
    """``seed:`` a YAML list whose aliases expand to 9**levels leaves (a few hundred bytes as written)."""
    anchors = ["&l0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    anchors += [f"&l{level} [{', '.join([f'*l{level - 1}'] * 9)}]" for level in range(1, levels)]
    return f"seed: [{', '.join(anchors)}]\n"


def test_a_file_over_1_mib_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    """Per file: a large base is refused by name, also under a small child, config or mix."""
    from megatron_lite.data.mix import load_mix

    padding = yaml.safe_dump({"train": {"deepspeed": {"padding": list(range(200_000))}}})  # passthrough: loads today
    large = write_yaml(tmp_path / "large.yml", f"base: {REPO / 'configs/tiny/coca_slack.yml'}\n{padding}")
    assert large.stat().st_size > 1 << 20
    child = write_yaml(tmp_path / "child.yml", "base: large.yml\nseed: 7\n")
    with pytest.raises(ValueError) as error:
        config_lib.load(child)
    assert str(error.value) == f"{large}: {large.stat().st_size:,} bytes, over the limit of 1,048,576 for a config " \
                               "or mix file"
    mix = write_yaml(tmp_path / "mix.yml", "groups: {text: {weight: 1, sources: {a: {type: text, path: a.txt}}}}\n"
                     + "#" * (1 << 20))
    with pytest.raises(ValueError, match=rf"^{mix}: 1,048,6\d\d bytes, over the limit of 1,048,576"):
        load_mix(mix)


def test_an_alias_bomb_is_refused_before_it_is_built(tmp_path: Path) -> None:
    """9**7 leaves (today: a message of ~15 MB; at 9 levels memory runs out) in a 300-byte file."""
    bomb = write_yaml(tmp_path / "bomb.yml", alias_bomb(7))
    with pytest.raises(ValueError) as error:
        config_lib.load(bomb)
    assert str(error.value) == f"{bomb}:1:{alias_bomb(7).index('&l6') + 1}: refused: its aliases expand to more " \
                               "than 1,000,000 YAML nodes (an alias bomb?)"
    assert config_lib.load(write_yaml(tmp_path / "small.yml", alias_bomb(6) + "model: {vocab_size: 64}\n"),
                           ["seed=3"]).seed == 3  # 9**6 = 531,441 leaves: within the limit
    recursive = write_yaml(tmp_path / "recursive.yml", "seed: &a [1, *a]\n")
    with pytest.raises(ValueError, match=r"recursive\.yml:1:7: refused: an alias refers to a node that contains it"):
        config_lib.load(recursive)
    with pytest.raises(ValueError, match=r"^override 'seed=\[&l0 .*\.\.\..*': its aliases expand to more than"):
        config_lib.parse_override("seed=" + alias_bomb(7)[len("seed: "):])


@pytest.mark.parametrize(("override", "message"), [
    ("seed=" + "7" * ((1 << 20) + 1), r"^override 'seed=7+\.\.\.7+': the value is 1,048,577 bytes, over the "
                                      r"limit of 1,048,576$"),
    ("seed=" + "x" * 500_000, r"^seed='x+\.\.\.x+' \(str\): expected an integer$"),
    ("model.position.scheme=" + "x" * 500_000, r"^model\.position\.scheme='x+\.\.\.x+': must be one of"),
    ("model." + "k" * 500_000 + "=1", r"^unknown config key model\.'k+\.\.\.k+'; valid keys"),
    ("seed=" + "9" * 4000, r"^seed=9+\.\.\.9+: out of range \(a 64-bit integer\)$"),
], ids=["over 1 MiB", "not an integer", "not a choice", "unknown key", "an integer of 4,000 digits"])
def test_a_long_value_is_refused_or_shown_shortened(override: str, message: str) -> None:
    """Today each of these messages prints the whole value (up to 1 MiB, in one case after parsing it)."""
    with pytest.raises(ValueError) as error:
        config_lib.with_overrides(config_lib.Config(), [override])
    payload = max(set(override), key=override.count)  # the repeated character
    shown = sum(len(run) for run in re.findall(f"{payload}{{20,}}", str(error.value)))  # of the value
    assert shown <= 200 and re.search(message, str(error.value)), str(error.value)[:1000]


def test_config_cli_names_the_base_chain(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_lite.config.__main__ import main

    monkeypatch.chdir(REPO)
    assert main(["--config", "configs/tiny/coca_strict.yml"]) == 0
    first, *rest = capsys.readouterr().out.splitlines()
    assert first == "# base chain: configs/tiny/coca_strict.yml -> configs/tiny/coca_slack.yml (each file's keys " \
                    "over the next's)"
    assert yaml.safe_load("\n".join(rest))["model"]["position"]["constraint"] == "strict"


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


def test_the_reference_lists_experimental_keys_and_test_hooks_apart_in_short_cells() -> None:
    """A user's keys first; the experimental keys (and values) and the test hooks each in a section of their own,
    every key once; no table cell over 400 characters (measured figures belong on the performance page)."""
    page = config_lib.documentation_page()
    run_config = page[page.index("## Run config"):page.index("## Mix files")]
    users, rest = run_config.split("### Experimental keys")
    experimental, hooks = rest.split("### Test hooks")
    assert "| `train.loss_gemm` |" in users and "| `train.cuda_graphs` |" in users
    for key in ("train.compile_blocks_per_region", "train.compile_options", "train.compile_cpp_wrapper",
                "train.loss_gemm: input_dtype", "train.loss_gemm: fp32"):
        assert f"| `{key}` |" in experimental and f"| `{key}` |" not in users + hooks, key
    assert "| `train.fault_injection.kill_after_step` |" in hooks and "fault_injection" not in users + experimental
    cells = [(row.split(" | ")[0], cell) for row in page.splitlines() if row.startswith("| `")
             for cell in re.split(r"(?<!\\)\|", row)[1:-1]]
    assert not [(key, len(cell)) for key, cell in cells if len(cell.strip()) > 400]


def test_docs_name_the_current_hugging_face_cli() -> None:
    """huggingface_hub >= 1.0 ships `hf` (`hf download`, `hf auth login`); `huggingface-cli` is gone."""
    texts = {path: path.read_text() for path in [REPO / "README.md", *(REPO / "docs").glob("*.md"),
                                                 *(REPO / "configs").rglob("*.yml")]}
    assert not [str(path) for path, text in texts.items() if "huggingface-cli" in text]
    assert "hf download wikimedia/wikipedia --repo-type dataset" in texts[REPO / "configs/data/paper_mix.yml"]
