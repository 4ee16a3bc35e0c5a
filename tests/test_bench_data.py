"""tools/bench_data.py on a toy budget: the jsonl export keeps every document, and every figure is reported."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_lite import config as config_lib
from megatron_lite.bench.data_bench import export_mix_to_jsonl, format_report, run_benchmark
from megatron_lite.data.mix import load_mix
from megatron_lite.data.sources import Document, read_source
from training_helpers import make_corpus, tiny_train_config


def test_jsonl_export_repeats_every_document(tmp_path: Path) -> None:
    config = config_lib.from_dict(tiny_train_config(make_corpus(tmp_path / "corpus"), tmp_path / "cache"))
    exported = load_mix(export_mix_to_jsonl(config, tmp_path / "jsonl", repeat=2))
    original = load_mix(config.data.mix)
    assert {g: exported.groups[g].weight for g in exported.groups} == {g: original.groups[g].weight for g in original.groups}
    for group_name, group in original.groups.items():
        for name, source in group.sources.items():
            texts = [r.text for r in read_source(source, name) if isinstance(r, Document)]
            copy = exported.groups[group_name].sources[name]
            assert copy.type == "jsonl" and not copy.deduplicate
            assert [r.text for r in read_source(copy, name) if isinstance(r, Document)] == texts * 2


def test_benchmark_reports_preprocessing_index_and_loader(tmp_path: Path) -> None:
    config = config_lib.from_dict(tiny_train_config(make_corpus(tmp_path / "corpus"), tmp_path / "cache"))
    result = run_benchmark(config, synthetic_tokens=50_000, index_samples=2_000, loader_seconds=0.2,
                           progress=lambda line: None)
    runs = result["preprocess"]["runs"]
    assert set(runs) == {"1", "2"} and runs["1"]["tokens"] == runs["2"]["tokens"] > 0
    assert result["preprocess"]["speedup"] > 0 and result["loader"]["loader_samples_per_s"] > 0
    report = format_report(result)
    assert "preprocess speed-up, 2 vs 1 workers" in report and "loader / training consumption" in report
    json.dumps(result)
