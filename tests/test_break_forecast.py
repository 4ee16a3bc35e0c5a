"""The break forecast: a power law fitted to the in-training curve's excess ratio, and tools/forecast_break.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from script_loading import load_script

from megatron_lite.repro.break_forecast import (MIN_R_SQUARED, PowerLaw, describe_crossing, fit_power_law, forecast,
                                                forecast_window, load_curves)


def _rows(law: PowerLaw, tokens: list[int], multiple: int = 16, wobble: float = 0.0) -> list[dict]:
    """Evaluation rows whose ratio follows ``law`` (times 1 +- wobble, alternating), with a step-0 row at 1.0."""
    rows = [{"step": 0, "tokens_seen": 0, f"extrapolation_ratio_x{multiple}": 1.0}]
    for index, count in enumerate(tokens, start=1):
        excess = law.coefficient * count ** law.exponent * (1 + wobble * (-1) ** index)
        rows.append({"step": index, "tokens_seen": count, f"extrapolation_ratio_x{multiple}": 1 + excess})
    return rows


def test_the_fit_recovers_a_power_law_and_its_crossing() -> None:
    law = PowerLaw(coefficient=2e-6, exponent=0.8, r_squared=1.0, points=0)
    tokens = [400_000 * step for step in range(1, 11)]
    fit = fit_power_law(tokens, [law.coefficient * t ** law.exponent for t in tokens])
    assert fit is not None and fit.points == 10
    assert fit.exponent == pytest.approx(0.8, rel=1e-9) and fit.coefficient == pytest.approx(2e-6, rel=1e-6)
    assert fit.r_squared == pytest.approx(1.0)
    crossing = fit.tokens_to_reach(2.0)  # 2e-6 * t^0.8 = 1
    assert crossing == pytest.approx((1 / 2e-6) ** (1 / 0.8), rel=1e-6)
    assert PowerLaw(1.0, -0.5, 1.0, 5).tokens_to_reach(2.0) is None  # a shrinking excess never gets there
    assert fit_power_law([1, 2, 3], [0.1, 0.2, 0.3]) is None  # too few points
    assert fit_power_law([5, 5, 5, 5], [0.1, 0.2, 0.3, 0.4]) is None  # one token count: no slope
    with pytest.raises(ValueError, match="must be > 0"):
        fit_power_law([1, 2, 3, 4], [0.1, 0.0, 0.3, 0.4])


def test_a_window_forecast_projects_leaves_out_warm_up_and_prefers_an_observed_crossing() -> None:
    law = PowerLaw(coefficient=2e-6, exponent=0.8, r_squared=1.0, points=0)
    tokens = [400_000 * step for step in range(1, 11)]
    rows = _rows(law, tokens)
    rows[1]["extrapolation_ratio_x16"] = 0.98  # a warm-up dip below 1: no log, left out
    (item,) = forecast(rows)
    assert item.multiple == 16 and item.last_tokens == 4_000_000 and item.observed_tokens is None
    assert item.fit is not None and item.fit.points == 9  # step 0 (no tokens) and the dip left out
    assert item.projected_tokens == pytest.approx((1 / 2e-6) ** (1 / 0.8), rel=1e-6)
    late = forecast_window(rows, 16, fit_from_fraction=0.5)  # only evaluations from 2M tokens on
    assert late is not None and late.fit is not None and late.fit.points == 6
    crossed = forecast_window(rows, 16, threshold=1.2)  # 1 + 2e-6 * t^0.8 passes 1.2 at ~1.8M tokens
    first = next(row["tokens_seen"] for row in rows if row["extrapolation_ratio_x16"] >= 1.2)
    assert crossed is not None and crossed.observed_tokens == first and crossed.projected_tokens is None
    assert describe_crossing(item) == "projected 13.3M (3.3x the last)"
    # a curve held just under 2 where its fitted line crosses 2 inside the data: said so, not projected
    law_inside = PowerLaw(coefficient=1 / 3e6 ** 0.8, exponent=0.8, r_squared=1.0, points=0)  # 2 at 3M tokens
    held = [{**row, "extrapolation_ratio_x16": min(row["extrapolation_ratio_x16"], 1.99)}
            for row in _rows(law_inside, tokens)]
    inside = forecast_window(held, 16)
    assert inside is not None and inside.observed_tokens is None and describe_crossing(inside) == (
        "the fit's line at 3.3M, not observed")
    assert forecast_window(rows, 8) is None  # no such window in the rows
    with pytest.raises(ValueError, match="threshold=1"):
        forecast_window(rows, 16, threshold=1.0)
    with pytest.raises(ValueError, match="fit_from_fraction=1"):
        forecast_window(rows, 16, fit_from_fraction=1.0)


def test_swings_without_a_trend_project_nothing() -> None:
    tokens = [400_000 * step for step in range(1, 11)]
    flat = _rows(PowerLaw(0.1, 0.0, 1.0, 0), tokens, wobble=0.5)  # excess 0.05 / 0.15, no growth
    (item,) = forecast(flat)
    assert item.fit is not None and item.fit.r_squared < MIN_R_SQUARED and item.projected_tokens is None


def _write_metrics(run: Path, rows: list[dict]) -> None:
    run.mkdir(parents=True)
    training = [{"step": step, "loss": 5.0, "tokens_seen": 0} for step in (1, 2)]  # rows without the curve's keys
    lines = [json.dumps(row | {"extrapolation_ppl_x1": 100.0}) for row in rows] + [json.dumps(r) for r in training]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_curves_load_from_a_run_dir_a_metrics_file_and_a_results_json(tmp_path: Path) -> None:
    rows = _rows(PowerLaw(2e-6, 0.8, 1.0, 0), [400_000 * step for step in range(1, 6)])
    _write_metrics(tmp_path / "rope", rows)
    assert list(load_curves(tmp_path / "rope")) == ["rope"]
    assert len(load_curves(tmp_path / "rope" / "metrics.jsonl")["rope"]) == 6
    results = tmp_path / "out" / "results.json"
    results.parent.mkdir()
    results.write_text(json.dumps({"training": {"rope": {"extrapolation_curve": rows},
                                                "alibi": {"extrapolation_curve": []}}}))
    assert list(load_curves(tmp_path / "out")) == ["rope"]  # a model without a curve is left out
    for bad, message in ((tmp_path / "missing", "no such file"), (tmp_path, "neither a run directory"),
                         (tmp_path / "out" / "results.json", None)):
        if message is None:
            results.write_text(json.dumps({"training": {"alibi": {"extrapolation_curve": []}}}))
            message = "no in-training extrapolation evaluations"
        with pytest.raises(ValueError, match=message):
            load_curves(bad)


def test_the_tool_prints_a_table_per_model_and_one_line_errors(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    tool = load_script("tools/forecast_break.py")
    tokens = [400_000 * step for step in range(1, 11)]
    _write_metrics(tmp_path / "rope", _rows(PowerLaw(2e-6, 0.8, 1.0, 0), tokens))
    assert tool.main([str(tmp_path / "rope")]) == 0
    out = capsys.readouterr().out
    projected = (1 / 2e-6) ** (1 / 0.8)
    assert "## rope" in out and "| x16 |" in out and f"projected {projected / 1e6:,.1f}M" in out, out
    assert tool.main([str(tmp_path / "rope"), "--json"]) == 0
    (item,) = json.loads(capsys.readouterr().out)["rope"]
    assert math.isclose(item["fit"]["exponent"], 0.8, rel_tol=1e-9)
    assert tool.main([str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nothing'}: no such file or directory"
