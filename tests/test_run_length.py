"""megatron_lite.repro.run_length: one source for the paper run's length and speed.

The docs' marked figures equal what the module computes; the module's measurement is the newest run record of the
users' command (tests/test_run_records.py checks the record against its raw files); "350M" is the model's counted
size; the paper_mix.yml estimate follows the mix file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from megatron_lite import config as config_lib
from megatron_lite.repro import run_length
from megatron_lite.repro.run_length import MARKED, MEASURED, RunLength, doc_figures, render

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def figures() -> dict[str, str]:
    return doc_figures()


@pytest.mark.parametrize("doc", run_length.DOCS, ids=lambda path: path.name)
def test_the_docs_figures_are_the_codes(doc: Path, figures: dict[str, str]) -> None:
    text = doc.read_text()
    assert MARKED.search(text), f"{doc.name} carries no run_length figure"
    assert render(text, figures) == text, \
        f"{doc.name} differs from the code: python -m megatron_lite.repro.run_length --write"


def test_the_figures_the_issue_named_are_in_the_docs(figures: dict[str, str]) -> None:
    guide = (REPO / "docs" / "run_at_scale.md").read_text()
    for name in ("size", "mfu", "runs_table", "speed_table", "mix_table", "paper_steps", "users_steps"):
        assert f"<!-- run_length:{name} -->" in guide, name
    reproduction = (REPO / "docs" / "reproduction.md").read_text()
    for name in ("paper_hours_8", "mfu"):
        assert f"<!-- run_length:{name} -->" in reproduction, name
    # what the docs said before this module, and disagreed on
    for stale in ("381,470", "8–13 h", "~20 h per model", "assumed 40%", "**Estimate, not a measurement**"):
        assert stale not in guide + reproduction, stale


def test_render_replaces_only_marked_figures_and_names_unknown_ones() -> None:
    text = "a <!-- run_length:x -->old<!-- /run_length --> b\n<!-- run_length:t -->\nold\n<!-- /run_length -->\n"
    assert render(text, {"x": "1", "t": "| a |\n|---|"}) == \
        "a <!-- run_length:x -->1<!-- /run_length --> b\n<!-- run_length:t -->\n| a |\n|---|\n<!-- /run_length -->\n"
    with pytest.raises(ValueError, match="run_length:x"):
        render(text, {"t": ""})


def test_350m_is_the_counted_model() -> None:
    config = config_lib.load(REPO / "configs" / "coca_350m.yml")
    size = run_length.model_size(config.model)
    assert (size.parameters, size.without_input_embedding) == (404_809_728, 353_560_576)
    assert size.parameters - size.without_input_embedding == config.model.padded_vocab_size * config.model.hidden_size
    assert size.flops_per_token == 6 * 353_560_576 + 12 * 24 * 1024 * 512
    assert "404.8M" in size.name and "353.6M" in size.name


def test_the_measurement_is_the_recorded_gpu_run() -> None:
    """MEASURED is read from its record, whose raw gpu_check.json holds the users' command's row."""
    record = run_length.RUNS / MEASURED.record
    results = json.loads((record / "gpu_check.json").read_text())
    (row,) = [row for row in results["users_command"]["rows"] if row["command"] == MEASURED.command]
    assert row["command"].startswith("deepspeed --num_gpus 1 train.py --config configs/coca_350m.yml")
    assert MEASURED.mfu == pytest.approx(row["mfu"], abs=5e-5)
    assert MEASURED.tokens_per_sec == pytest.approx(row["tokens_per_sec"], abs=1)
    assert MEASURED.first_step_s == pytest.approx(row["first_step_s"], abs=0.05)
    device = next(r["value"] for r in results["env"]["rows"] if r["item"] == "device")
    assert device == MEASURED.device
    assert f"{MEASURED.mfu:.1%}" in (REPO / "docs" / "performance.md").read_text()


def test_the_printed_measurement_states_its_vocabulary_and_the_scaling_assumed() -> None:
    text = MEASURED.describe()
    for said in (f"vocabulary {MEASURED.vocab_size:,}", f"{MEASURED.parameters:,} parameters", "the data bundle's",
                 "8 GPUs assumed to scale linearly", f"benchmarks/runs/{MEASURED.record}", MEASURED.commit):
        assert said in text, said
    table = doc_figures()["speed_table"]
    assert f"vocabulary {MEASURED.vocab_size:,}: {MEASURED.parameters:,} parameters" in table
    for record in (MEASURED.record, run_length.BASELINE.record):
        assert f"../benchmarks/runs/{record}/" in table


def test_a_missing_record_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such run record"):
        run_length.load_measurement(tmp_path / "2026-01-01_nothing_h200")


def test_run_length_and_hours_arithmetic() -> None:
    run = RunLength(100_000_000_000, 131_072)
    assert (run.steps, run.tokens) == (762_940, 762_940 * 131_072)
    hours = run_length.plan_hours(run.tokens, 2_272_358_400, 0.25)
    assert hours["8xH100/H200"]["hours"] == pytest.approx(hours["1xH100/H200"]["hours"] / 8)
    assert hours["1xA100"]["hours"] == pytest.approx(run.tokens * 2_272_358_400 / (312e12 * 0.25) / 3600)
    runs = run_length.paper_runs()
    assert runs.epochs == 2 and runs.paper.tokens_requested == 100_000_000_000 and runs.tokens_per_step == 131_072


def test_the_mix_estimate_follows_paper_mix_yml() -> None:
    mix = yaml.safe_load(run_length.PAPER_MIX.read_text())
    caps = {name: source["max_documents"] for group in mix["groups"].values()
            for name, source in group["sources"].items()}
    sizes = {size.source: size for size in run_length.paper_mix_sizes()}
    assert set(sizes) == set(caps)
    for name, size in sizes.items():
        assert size.documents <= caps[name], name
    assert sizes["wikipedia"].documents == 6_407_814 < caps["wikipedia"]  # every article: the cap is above
    assert sizes["pile"].documents == caps["pile"]
    total = run_length.paper_mix_tokens()
    assert 40e9 < total < 80e9  # the order of the paper's ~50B sample
    # sized so that each group holds its weight's share: train.train_epochs: 2 reads every group about twice
    code = sum(size.tokens for size in sizes.values() if size.group == "code")
    assert code / total == pytest.approx(run_length.code_weight(), abs=0.01)


def test_users_command_length_is_the_trainers_arithmetic() -> None:
    """train.py's own rule (training/data.total_steps_for): ceil(epochs x training tokens / tokens per step)."""
    runs = run_length.paper_runs()
    config = config_lib.load(REPO / "configs" / "coca_350m.yml")
    training = run_length.paper_mix_tokens() * (1 - config.data.validation_fraction)
    assert runs.users_command.steps == -(-round(config.train.train_epochs * training) // 131_072)
    assert re.fullmatch(r"[\d,]+000", doc_figures()["users_steps"])  # an estimate: rounded
