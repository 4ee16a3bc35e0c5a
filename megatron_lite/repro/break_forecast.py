"""When will a model's extrapolation break? A power law fitted to its in-training curve, projected to a threshold.

The in-training curve (``train.extrapolation_eval``) gives, at each evaluation, ppl(kx) / ppl(1x) against tokens
seen. Where that ratio climbs as the model trains, its excess ``ratio - 1`` has so far grown roughly as a power of
the tokens (the runs in docs/reproduction.md: R^2 0.6-0.98 in log-log space where the ratio climbs). Fitted per
window by least squares on (log tokens, log excess), the law says how fast the climb is (the exponent) and,
continued, after how many tokens the ratio would reach a threshold (2 by default: perplexity doubling past the
training length), which helps size a longer run. It is an extrapolation of a noisy curve, not a result: the
report prints the points, R^2 and how far past the last evaluation the projection reaches, and an observed
crossing wins over any projection.

Evaluations in the first ``fit_from_fraction`` of the run's tokens (warm-up, where the ratio is flat or swings)
and any with a ratio <= 1 (no excess to take the log of) are left out of the fit; a fit with R^2 below
``MIN_R_SQUARED`` (no trend, only swings) projects nothing.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RATIO_PREFIX = "extrapolation_ratio_x"
DEFAULT_THRESHOLD = 2.0
DEFAULT_FIT_FROM_FRACTION = 0.1
MIN_POINTS = 4
MIN_R_SQUARED = 0.5


@dataclass(frozen=True)
class PowerLaw:
    """excess(tokens) = coefficient * tokens ** exponent, fitted in log-log space over ``points`` evaluations."""

    coefficient: float
    exponent: float
    r_squared: float
    points: int

    def tokens_to_reach(self, ratio: float) -> float | None:
        """Tokens at which the law's ratio (1 + excess) reaches ``ratio``; None where the excess does not grow."""
        if self.exponent <= 0:
            return None
        return math.exp((math.log(ratio - 1.0) - math.log(self.coefficient)) / self.exponent)


@dataclass(frozen=True)
class WindowForecast:
    """One window's forecast: the fit (None with fewer than MIN_POINTS usable evaluations), the last ratio, and
    when the ratio reached the threshold (``observed_tokens``) or would (``projected_tokens``)."""

    multiple: int
    fit: PowerLaw | None
    last_tokens: int
    last_ratio: float
    observed_tokens: int | None
    projected_tokens: float | None


def fit_power_law(tokens: Sequence[float], excess: Sequence[float]) -> PowerLaw | None:
    """Least squares on (log tokens, log excess); None with fewer than MIN_POINTS points or one distinct token count.
    Every token count and excess must be > 0."""
    if len(tokens) != len(excess):
        raise ValueError(f"{len(tokens)} token counts but {len(excess)} excess values")
    if any(value <= 0 for value in (*tokens, *excess)):
        raise ValueError("token counts and excess values must be > 0 (log-log fit)")
    if len(tokens) < MIN_POINTS or len(set(tokens)) < 2:
        return None
    xs = [math.log(value) for value in tokens]
    ys = [math.log(value) for value in excess]
    slope, intercept = statistics.linear_regression(xs, ys)
    # a straight line's R^2 is the squared correlation; a constant excess is fitted exactly (slope 0)
    r_squared = statistics.correlation(xs, ys) ** 2 if len(set(ys)) > 1 else 1.0
    return PowerLaw(coefficient=math.exp(intercept), exponent=slope, r_squared=r_squared, points=len(xs))


def ratio_multiples(rows: Sequence[dict[str, Any]]) -> list[int]:
    """The window multiples (> 1) with a ratio under the model's own scaling, in order."""
    suffixes = {key.removeprefix(RATIO_PREFIX) for row in rows for key in row if key.startswith(RATIO_PREFIX)}
    return sorted(int(suffix) for suffix in suffixes if suffix.isdigit())


def forecast_window(rows: Sequence[dict[str, Any]], multiple: int, threshold: float = DEFAULT_THRESHOLD,
                    fit_from_fraction: float = DEFAULT_FIT_FROM_FRACTION) -> WindowForecast | None:
    """The forecast for one window from a run's evaluation rows (``tokens_seen`` and ``extrapolation_ratio_x<k>``,
    in step order); None where no row has that window's ratio."""
    if threshold <= 1:
        raise ValueError(f"threshold={threshold}: must be > 1 (a ratio ppl(kx) / ppl(1x))")
    if not 0 <= fit_from_fraction < 1:
        raise ValueError(f"fit_from_fraction={fit_from_fraction}: must be in [0, 1)")
    key = f"{RATIO_PREFIX}{multiple}"
    points = [(int(row["tokens_seen"]), float(row[key])) for row in rows if row.get(key) is not None]
    if not points:
        return None
    last_tokens, last_ratio = points[-1]
    fit_from = fit_from_fraction * last_tokens
    fitted = [(tokens, ratio - 1.0) for tokens, ratio in points if tokens > 0 and tokens >= fit_from and ratio > 1]
    fit = fit_power_law([tokens for tokens, _ in fitted], [excess for _, excess in fitted])
    observed = next((tokens for tokens, ratio in points if ratio >= threshold), None)
    trend = fit is not None and fit.r_squared >= MIN_R_SQUARED
    projected = fit.tokens_to_reach(threshold) if observed is None and trend else None
    return WindowForecast(multiple=multiple, fit=fit, last_tokens=last_tokens, last_ratio=last_ratio,
                          observed_tokens=observed, projected_tokens=projected)


def forecast(rows: Sequence[dict[str, Any]], threshold: float = DEFAULT_THRESHOLD,
             fit_from_fraction: float = DEFAULT_FIT_FROM_FRACTION) -> list[WindowForecast]:
    """Every window's forecast, smallest multiple first."""
    forecasts = (forecast_window(rows, multiple, threshold, fit_from_fraction) for multiple in ratio_multiples(rows))
    return [item for item in forecasts if item is not None]


def describe_crossing(item: WindowForecast) -> str:
    """'observed at 9.0M', 'projected 17.3M (1.4x the last)', 'the fit's line at 11.0M, not observed' (a line
    crossing inside the data that the curve itself has not made: it swings around the line), 'not growing', 'no
    trend' or 'too few points'."""
    if item.observed_tokens is not None:
        return f"observed at {format_tokens(item.observed_tokens)}"
    if item.fit is None:
        return f"too few points (< {MIN_POINTS} with ratio > 1)"
    if item.fit.r_squared < MIN_R_SQUARED:
        return f"no trend (R^2 < {MIN_R_SQUARED:g})"
    if item.projected_tokens is None:
        return "not growing"
    if item.projected_tokens <= item.last_tokens:
        return f"the fit's line at {format_tokens(item.projected_tokens)}, not observed"
    return (f"projected {format_tokens(item.projected_tokens)} "
            f"({item.projected_tokens / item.last_tokens:,.1f}x the last)")


def format_tokens(tokens: float) -> str:
    """1.2K, 17.3M, 4.1B."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if tokens >= scale:
            return f"{tokens / scale:,.1f}{suffix}"
    return f"{tokens:,.0f}"


FORECAST_HEADER = ["window", "ratio at the last evaluation", "fitted points", "exponent", "R^2",
                   "ratio {threshold:g} reached"]


def forecast_table_rows(forecasts: Sequence[WindowForecast]) -> list[list[str]]:
    """One row per window, in FORECAST_HEADER's columns."""
    body = []
    for item in forecasts:
        fit = item.fit
        body.append([f"x{item.multiple}", f"{item.last_ratio:.3f} at {format_tokens(item.last_tokens)}",
                     "–" if fit is None else str(fit.points), "–" if fit is None else f"{fit.exponent:.2f}",
                     "–" if fit is None else f"{fit.r_squared:.2f}", describe_crossing(item)])
    return body


def forecast_header(threshold: float) -> list[str]:
    return [column.format(threshold=threshold) for column in FORECAST_HEADER]


def load_curves(path: Path) -> dict[str, list[dict[str, Any]]]:
    """Name -> evaluation rows from a run directory or its metrics.jsonl (named after the run), or a
    reproduction's results.json (every model's ``training.<model>.extrapolation_curve``) or a JSON of
    ``{model: {"extrapolation_curve": [...]}}``; only the curves with any rows."""
    from megatron_lite.training.extrapolation import curve_rows
    from megatron_lite.training.metrics import read_metrics

    if path.is_dir():
        if (path / "metrics.jsonl").is_file():
            path = path / "metrics.jsonl"
        elif (path / "results.json").is_file():
            path = path / "results.json"
        else:
            raise ValueError(f"{path}: neither a run directory (metrics.jsonl) nor a reproduction's (results.json)")
    if not path.is_file():
        raise ValueError(f"{path}: no such file or directory")
    if path.suffix == ".jsonl":
        curves = {path.parent.name: curve_rows(read_metrics(path))}
    else:
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not JSON ({error})") from None
        models = data.get("training", data) if isinstance(data, dict) else None
        if not isinstance(models, dict):
            raise ValueError(f"{path}: expected a results.json or a JSON object of models")
        curves = {name: info.get("extrapolation_curve") or [] for name, info in models.items()
                  if isinstance(info, dict)}
    found = {name: rows for name, rows in curves.items() if rows}
    if not found:
        raise ValueError(f"{path}: no in-training extrapolation evaluations (train.extrapolation_eval was off?)")
    return found
