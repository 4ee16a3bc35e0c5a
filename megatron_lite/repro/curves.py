"""The reproduction's in-training extrapolation curves (train.extrapolation_eval, megatron_lite.training.extrapolation):
one table and one plot comparing the models' ppl(kx) / ppl(1x) against tokens seen.

Each model's curve is its ``training[scheme]["extrapolation_curve"]`` in results.json (its metrics rows). The
question they answer: does a model's ratio past the training length grow as it trains (RoPE's break, if the
budget reaches it), and does CoCA's stay lower at the same tokens?
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_lite.eval.report import format_ppl, markdown_table, pyplot
from megatron_lite.repro import break_forecast
from megatron_lite.repro.break_forecast import RATIO_PREFIX


def model_curves(results: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Model -> its evaluations in step order; only the models that have any."""
    curves = {name: info.get("extrapolation_curve") or [] for name, info in results["training"].items()}
    return {name: rows for name, rows in curves.items() if rows}


def ratio_multiples(curves: dict[str, list[dict[str, Any]]]) -> list[int]:
    """The window multiples (> 1) with a ratio under the models' own scaling."""
    return break_forecast.ratio_multiples([row for rows in curves.values() for row in rows])


def _ratio(row: dict[str, Any] | None, multiple: int) -> str:
    value = None if row is None else row.get(f"{RATIO_PREFIX}{multiple}")
    return "–" if value is None else f"{value:.3f}"


def curve_section(results: dict[str, Any]) -> str | None:
    """Markdown: per evaluation (tokens seen), each model's ppl(1x) and ratios at 2x and the largest window."""
    curves = model_curves(results)
    multiples = ratio_multiples(curves)
    if not curves or not multiples:
        return None
    shown = sorted({multiples[0], multiples[-1]})
    labels = {name: results["training"][name]["display_name"] for name in curves}
    by_tokens = {name: {row["tokens_seen"]: row for row in rows} for name, rows in curves.items()}
    header = ["tokens seen"] + [f"{labels[name]} {column}" for name in curves
                                for column in ["ppl 1x", *(f"x{multiple}/x1" for multiple in shown)]]
    body = []
    for tokens in sorted({tokens for rows in by_tokens.values() for tokens in rows}):
        line = [f"{tokens:,}"]
        for name in curves:
            row = by_tokens[name].get(tokens)
            line.append(format_ppl(row.get("extrapolation_ppl_x1")) if row else "–")
            line += [_ratio(row, multiple) for multiple in shown]
        body.append(line)
    rows = next(iter(curves.values()))
    seconds = [row["extrapolation_seconds"] for rows in curves.values() for row in rows]
    return ("## Extrapolation while training\n\n"
            f"Perplexity on the same {rows[-1]['extrapolation_scored_tokens']:,} held-out tokens through windows of "
            f"1x-{multiples[-1]}x the training length (`train.extrapolation_eval`), every evaluation of the run: "
            "xK/x1 > 1 means the context past the training length hurts (RoPE's break, where it appears), < 1 that "
            f"it helps. {len(seconds)} evaluations, {sum(seconds):,.1f} s in all (not counted as training time). "
            "Every window and scaling is in results.json (`training.<model>.extrapolation_curve`) and "
            "extrapolation_curves.png.\n\n" + markdown_table(header, body) + "\n\n" + _forecast_section(curves, labels))


def _forecast_section(curves: dict[str, list[dict[str, Any]]], labels: dict[str, str]) -> str:
    """Each model's power-law forecast of when its ratio reaches 2 (megatron_lite.repro.break_forecast)."""
    threshold = break_forecast.DEFAULT_THRESHOLD
    header = ["model", *break_forecast.forecast_header(threshold)]
    body = [[labels[name], *cells] for name, rows in curves.items()
            for cells in break_forecast.forecast_table_rows(break_forecast.forecast(rows))]
    return ("### When would the ratio reach 2?\n\n"
            "ratio - 1 fitted as a power of tokens seen (least squares in log-log space, evaluations after the first "
            f"{break_forecast.DEFAULT_FIT_FROM_FRACTION:.0%} of the tokens with a ratio > 1; "
            "`tools/forecast_break.py`), "
            f"continued to a ratio of {threshold:g}: an extrapolation of a noisy curve, a hypothesis for a longer run "
            f"to test, not a measurement; no projection where R^2 < {break_forecast.MIN_R_SQUARED:g}.\n\n"
            + markdown_table(header, body))


def plot_curves(results: dict[str, Any], path: Path) -> bool:
    """ppl(1x) and every ppl(kx)/ppl(1x) against tokens seen, one panel each, one line per model; False without
    curves."""
    curves = model_curves(results)
    multiples = ratio_multiples(curves)
    if not curves or not multiples:
        return False
    plt = pyplot()
    panels = ["extrapolation_ppl_x1", *(f"{RATIO_PREFIX}{multiple}" for multiple in multiples)]
    columns = min(3, len(panels))
    rows_of_panels = -(-len(panels) // columns)
    figure, axes_grid = plt.subplots(rows_of_panels, columns, figsize=(4.2 * columns, 3.3 * rows_of_panels),
                                     squeeze=False)
    for index, key in enumerate(panels):
        axes = axes_grid[index // columns][index % columns]
        for name, rows in curves.items():
            points = [(row["tokens_seen"], row[key]) for row in rows if row.get(key) is not None]
            axes.plot([t for t, _ in points], [v for _, v in points], marker="o", markersize=3,
                      label=results["training"][name]["display_name"])
        if key == panels[0]:
            axes.set_yscale("log")
            axes.set_title("perplexity at 1x (training length)", fontsize=9)
        else:
            axes.axhline(1.0, color="grey", linewidth=0.8)
            axes.set_title(f"ppl({key.removeprefix(RATIO_PREFIX)}x) / ppl(1x)", fontsize=9)
        axes.set_xlabel("tokens seen", fontsize=8)
        axes.grid(alpha=0.3)
        axes.legend(fontsize=7)
    for index in range(len(panels), rows_of_panels * columns):
        axes_grid[index // columns][index % columns].axis("off")
    figure.suptitle("Extrapolation while training")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True
