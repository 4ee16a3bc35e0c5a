"""tools/bench_train.py on a toy budget: identical dimensions for HF and ours, every ratio reported;
the compiled-vs-eager rows on ONE scheme with the dynamo-only "eager" backend (seconds, not the
~15-40 s of an inductor compile per scheme)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_lite.bench.train_bench import (
    COMPILE_SCHEMES,
    MODELS,
    TrainBenchSettings,
    format_report,
    run_cpu_comparison,
)
from script_loading import load_script
from training_helpers import REPO

TINY = dict(config_path=str(REPO / "configs/tiny/rope.yml"), batch_size=2, rounds=1, steps_per_round=1,
            warmup_steps=1)


def test_cpu_comparison_reports_every_model_and_ratio(tmp_path: Path) -> None:
    settings = TrainBenchSettings(**TINY, compile_schemes=[])
    result = run_cpu_comparison(settings, progress=lambda line: None)
    assert [r["model"] for r in result.records] == list(MODELS)
    parameters = {r["parameters"] for r in result.records}
    assert len(parameters) == 1  # HF GPTNeoX and our three schemes have identical dimensions
    assert all(r["tokens_per_sec"] > 0 for r in result.records)
    assert set(result.ratios) == {"ours_rope_vs_hf", "coca_slack_vs_rope", "coca_strict_vs_rope"}
    assert result.compile_records == [] and result.compile_ratios == {}
    report = format_report(result)
    assert "ours_rope_vs_hf" in report and "GPU: not measured" in report
    assert "Compiled vs eager: not measured (--no-compile)" in report
    (tmp_path / "out.json").write_text(json.dumps(result.__dict__))  # JSON-serialisable as the tool writes it


def test_our_models_run_the_configs_loss_head() -> None:
    """train.fused_loss and train.loss_gemm reach the benchmarked model as the training engine sets them."""
    from megatron_lite import config as config_lib
    from megatron_lite.bench.train_bench import _build

    config = config_lib.load(TINY["config_path"], ["train.fused_loss=false", "train.loss_gemm=input_dtype"])
    model, is_hf = _build("ours_rope", config)
    assert not is_hf and (model.lm_head.fused, model.lm_head.gemm) == (False, "input_dtype")


def test_compiled_vs_eager_rows(tmp_path: Path) -> None:
    assert list(COMPILE_SCHEMES) == ["none", "learned", "sinusoidal", "alibi", "rope", "coca_slack", "coca_strict"]
    settings = TrainBenchSettings(**TINY, compile_schemes=["coca_strict"], compile_backend="eager",
                                  compile_warmup_steps=1)
    lines: list[str] = []
    result = run_cpu_comparison(settings, progress=lines.append)
    assert any(line.startswith("compile round 1/1: coca_strict/eager") for line in lines)
    [record] = result.compile_records
    assert record["scheme"] == "coca_strict"
    assert record["eager_tokens_per_sec"] > 0 and record["compiled_tokens_per_sec"] > 0
    assert result.compile_ratios["coca_strict"] == pytest.approx(
        record["compiled_tokens_per_sec"] / record["eager_tokens_per_sec"])
    report = format_report(result)
    assert "| scheme | eager tokens/s | compiled tokens/s | compiled/eager | target |" in report
    assert "| coca_strict | " in report and "≥ 1.00" in report
    (tmp_path / "out.json").write_text(json.dumps(result.__dict__))


class _Stop(BaseException):
    pass


def test_cli_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flags reach the settings (the run itself is covered above)."""
    cli = load_script("tools/bench_train.py")
    seen: list[TrainBenchSettings] = []

    def capture(settings: TrainBenchSettings, progress: object) -> None:
        seen.append(settings)
        raise _Stop

    monkeypatch.setattr(cli, "run_cpu_comparison", capture)
    for argv, schemes in (([], list(COMPILE_SCHEMES)), (["--no-compile"], []),
                          (["--compile-schemes", "rope", "alibi"], ["rope", "alibi"])):
        with pytest.raises(_Stop):
            cli.main(["--no-gpu", *argv])
        assert seen[-1].compile_schemes == schemes and seen[-1].compile_backend == "inductor"
    with pytest.raises(SystemExit):
        cli.main(["--compile-schemes", "bogus"])
    with pytest.raises(ValueError, match="compile schemes"):  # checked before anything runs
        run_cpu_comparison(TrainBenchSettings(**TINY, compile_schemes=["bogus"]), progress=lambda line: None)
