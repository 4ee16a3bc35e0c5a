"""tools/bench_train.py on a toy budget: identical dimensions for HF and ours, every ratio reported."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_lite.bench.train_bench import MODELS, TrainBenchSettings, format_report, run_cpu_comparison
from training_helpers import REPO


def test_cpu_comparison_reports_every_model_and_ratio(tmp_path: Path) -> None:
    settings = TrainBenchSettings(config_path=str(REPO / "configs/tiny/rope.yml"), batch_size=2, rounds=1,
                                  steps_per_round=1, warmup_steps=1)
    result = run_cpu_comparison(settings, progress=lambda line: None)
    assert [r["model"] for r in result.records] == list(MODELS)
    parameters = {r["parameters"] for r in result.records}
    assert len(parameters) == 1  # HF GPTNeoX and our three schemes have identical dimensions
    assert all(r["tokens_per_sec"] > 0 for r in result.records)
    assert set(result.ratios) == {"ours_rope_vs_hf", "coca_slack_vs_rope", "coca_strict_vs_rope"}
    report = format_report(result)
    assert "ours_rope_vs_hf" in report and "GPU: not measured" in report
    (tmp_path / "out.json").write_text(json.dumps(result.__dict__))  # JSON-serialisable as the tool writes it
