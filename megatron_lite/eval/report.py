"""Markdown tables (the paper's Tables 1-3 layout: rows = model x scaling, columns = context window)
and PNG plots (perplexity vs window on log axes like the paper's Figure 1; passkey length x depth
heatmaps; needle-suite task x length heatmaps) from ``results.json`` rows."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from megatron_lite.console import notice

NUM_DEPTH_BINS = 10
LINE_STYLES = ["-", "--", ":", "-.", (0, (5, 1)), (0, (3, 1, 1, 1))]
MARKERS = ["o", "s", "^", "v", "D", "x"]


def _row_keys(rows: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """(model, scaling) pairs in first-seen order."""
    keys: list[tuple[str, str]] = []
    for row in rows:
        key = (row["model"], row["scaling"])
        if key not in keys:
            keys.append(key)
    return keys


def format_ppl(value: float | None) -> str:
    if value is None or value != value:
        return "–"
    if value < 100:
        return f"{value:.2f}"
    if value < 1e5:
        return f"{value:,.0f}" if value >= 1000 else f"{value:.1f}"
    return f"{value:.2e}"


def format_percent(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.0f}"


def markdown_table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines)


def _grid(rows: Sequence[dict[str, Any]], column: str, cell: Any, models: dict[str, Any]) -> str:
    columns = sorted({row[column] for row in rows})
    by_key = {(row["model"], row["scaling"], row[column]): row for row in rows}
    header = ["model", "scheme", "train length", "scaling", *[f"{c:,}" for c in columns]]
    body = []
    for model, scaling in _row_keys(rows):
        info = models.get(model, {})
        body.append([model, str(info.get("scheme", "")), str(info.get("train_length", "")), scaling]
                    + [cell(by_key.get((model, scaling, c))) for c in columns])
    return markdown_table(header, body)


def perplexity_table(rows: Sequence[dict[str, Any]], models: dict[str, Any]) -> str:
    return _grid(rows, "window", lambda row: format_ppl(row["ppl"]) if row else "–", models)


def bits_per_byte_table(rows: Sequence[dict[str, Any]], models: dict[str, Any]) -> str:
    return _grid(rows, "window", lambda row: format_bits(row.get("bits_per_byte")) if row else "–", models)


def format_bits(value: float | None) -> str:
    return "–" if value is None or value != value else f"{value:.4f}"


def passkey_table(rows: Sequence[dict[str, Any]], models: dict[str, Any]) -> str:
    return _grid(rows, "length", lambda row: format_percent(row["accuracy"]) if row else "–", models)


def passkey_distance_table(rows: Sequence[dict[str, Any]], models: dict[str, Any]) -> str:
    def cell(row: dict[str, Any] | None) -> str:
        if row is None:
            return "–"
        return f"{format_percent(row['accuracy_inside'])} / {format_percent(row['accuracy_outside'])}"

    return _grid(rows, "length", cell, models)


def needle_table(rows: Sequence[dict[str, Any]], models: dict[str, Any]) -> str:
    """Rows = model x scaling x task (and the mean over tasks), columns = prompt length; cells = score %."""
    lengths = sorted({row["length"] for row in rows})
    by_key = {(row["model"], row["scaling"], row["task"], row["length"]): row["score"] for row in rows}
    header = ["model", "train length", "scaling", "task", *[f"{n:,}" for n in lengths]]
    body = []
    for model, scaling in _row_keys(rows):
        tasks = list(dict.fromkeys(r["task"] for r in rows if (r["model"], r["scaling"]) == (model, scaling)))
        prefix = [model, str(models.get(model, {}).get("train_length", "")), scaling]
        for task in tasks:
            body.append(prefix + [task] + [format_percent(by_key.get((model, scaling, task, n))) for n in lengths])
        means = []
        for n in lengths:
            scores = [by_key[(model, scaling, task, n)] for task in tasks if (model, scaling, task, n) in by_key]
            means.append(format_percent(sum(scores) / len(scores)) if scores else "–")
        body.append(prefix + ["**mean**"] + means)
    return markdown_table(header, body)


def format_length(value: int | None) -> str:
    return "none" if value is None else f"{value:,}"


def effective_context_table(rows: Sequence[dict[str, Any]], models: dict[str, Any]) -> str:
    header = ["model", "scheme", "scaling", "effective length", "train length", "reference length",
              "reference score %", "threshold %"]
    body = [[row["model"], str(models.get(row["model"], {}).get("scheme", "")), row["scaling"],
             format_length(row["length"]), f"{row['training_length']:,}",
             "–" if row["reference_length"] is None else f"{row['reference_length']:,}",
             format_percent(row["reference_score"]), format_percent(row["threshold"])] for row in rows]
    return markdown_table(header, body)


def tables_markdown(results: dict[str, Any]) -> str:
    settings, models = results.get("settings", {}), results.get("models", {})
    parts = []
    if results["perplexity"]:
        first, budget = results["perplexity"][0], settings.get("max_doc_chars")
        kept = (f"cut to {budget:,} characters (>= {settings.get('max_doc_tokens'):,} tokens)" if budget
                else f"truncated to {settings.get('max_doc_tokens'):,} tokens")
        parts.append(f"### Sliding-window perplexity (stride {settings.get('stride')}; {first['documents']} documents "
                     f"{kept}, {first['documents_skipped']} shorter skipped; columns = context window in tokens)\n\n"
                     + perplexity_table(results["perplexity"], models))
        parts.append("### Bits per byte (NLL in bits over the UTF-8 bytes of the scored text"
                     + (f"; texts cut to {budget:,} characters before tokenising" if budget else "")
                     + "; columns = context window in tokens)\n\n" + bits_per_byte_table(results["perplexity"], models))
    if results["passkey"]:
        cases = results["passkey"][0]["cases"]
        parts.append(f"### Passkey retrieval accuracy, % ({cases} cases per length; columns = prompt length in "
                     "tokens)\n\n" + passkey_table(results["passkey"], models))
        parts.append("### Passkey accuracy by passkey distance, % (inside / outside the training window; – = no "
                     "case)\n\n" + passkey_distance_table(results["passkey"], models))
    if results.get("needles"):
        cases = results["needles"][0]["cases"]
        depths = ", ".join(f"{d:g}" for d in settings.get("needle_depths", []))
        parts.append(f"### Needle suite score, % (RULER string_match_all: share of the expected strings in the "
                     f"output; {cases} cases per task x length over depths {depths}; {settings.get('needle_haystack')} "
                     "haystack; columns = prompt length in tokens)\n\n" + needle_table(results["needles"], models))
        parts.append("### Effective context length (longest length, from the reference length up without a "
                     "break, whose mean needle score is >= max(0.9 x the score at the reference length, 50%); "
                     "reference = the training length, or the longest evaluated length below it; none: "
                     "reference score < 50%)\n\n" + effective_context_table(results["effective_context"], models))
    return "\n\n".join(parts) + "\n"


# ----------------------------------------------------------------------------------------------
# Plots


@functools.cache
def plots_available() -> bool:
    """matplotlib importable; else one notice per process (a bare GPU node has none: the tables and
    results.json hold every number, the plots are skipped)."""
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        notice("matplotlib is not installed: no plots (the tables and results.json hold every number)")
        return False
    return True


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_perplexity(results: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    rows = results["perplexity"]
    figure, axes = plt.subplots(figsize=(8.5, 4.5))
    keys = _row_keys(rows)
    models = list(dict.fromkeys(model for model, _ in keys))
    scalings = list(dict.fromkeys(scaling for _, scaling in keys))
    colors = plt.get_cmap("tab10").colors
    for model, scaling in keys:  # colour = model, line style and marker = scaling
        points = sorted((r["window"], r["ppl"]) for r in rows if r["model"] == model and r["scaling"] == scaling)
        style = scalings.index(scaling)
        axes.plot([w for w, _ in points], [p for _, p in points], color=colors[models.index(model) % len(colors)],
                  linestyle=LINE_STYLES[style % len(LINE_STYLES)], marker=MARKERS[style % len(MARKERS)],
                  markersize=4, label=f"{model} ({scaling})")
    for train_length in sorted({info["train_length"] for info in results.get("models", {}).values()}):
        axes.axvline(train_length, color="grey", linestyle="--", linewidth=0.8)
    from matplotlib.ticker import FormatStrFormatter, NullFormatter

    windows = sorted({row["window"] for row in rows})
    axes.set_xscale("log", base=2)
    axes.set_xticks(windows, [f"{w:,}" for w in windows], rotation=45 if len(windows) > 5 else 0)
    axes.xaxis.set_minor_formatter(NullFormatter())
    axes.set_yscale("log")
    values = [row["ppl"] for row in rows if row["ppl"] == row["ppl"]]
    if values and max(values) / min(values) < 10:  # less than a decade: label the minor ticks too
        axes.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        axes.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    axes.set_xlabel("context window (tokens); dashed: training length")
    axes.set_ylabel("perplexity (log scale)")
    axes.set_title("Sliding-window perplexity")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def depth_bin(depth: float) -> int:
    return min(int(depth * NUM_DEPTH_BINS), NUM_DEPTH_BINS - 1)


def _heatmap_panels(keys: Sequence[tuple[str, str]], panel_size: tuple[float, float], label: str, path: Path,
                    draw: Callable[[Any, str, str], Any]) -> None:
    """One heatmap panel per (model, scaling), four to a row, one shared 0..1 colour bar; ``draw(axes,
    model, scaling)`` fills a panel and returns its image."""
    plt = pyplot()
    num_columns = min(len(keys), 4)
    num_rows = (len(keys) + num_columns - 1) // num_columns
    figure, axes_grid = plt.subplots(num_rows, num_columns, figsize=(panel_size[0] * num_columns + 1,
                                                                     panel_size[1] * num_rows),
                                     squeeze=False, constrained_layout=True)
    image = None
    for index, (model, scaling) in enumerate(keys):
        axes = axes_grid[index // num_columns][index % num_columns]
        image = draw(axes, model, scaling)
        axes.set_title(f"{model} ({scaling})", fontsize=8)
        axes.set_xlabel("prompt length (tokens)", fontsize=7)
    for index in range(len(keys), num_rows * num_columns):
        axes_grid[index // num_columns][index % num_columns].axis("off")
    if image is not None:
        figure.colorbar(image, ax=axes_grid, shrink=0.8, label=label)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _score_colormap() -> Any:
    return pyplot().get_cmap("RdYlGn").with_extremes(bad="lightgrey")  # grey: nothing in that cell


def plot_passkey_heatmap(cases: Sequence[dict[str, Any]], path: Path) -> None:
    """One panel per model x scaling: accuracy by prompt length (x) and key depth decile (y)."""
    import numpy as np

    lengths = sorted({case["length"] for case in cases})

    def draw(axes: Any, model: str, scaling: str) -> Any:
        correct = np.zeros((NUM_DEPTH_BINS, len(lengths)))
        total = np.zeros((NUM_DEPTH_BINS, len(lengths)))
        for case in cases:
            if case["model"] == model and case["scaling"] == scaling:
                cell = (depth_bin(case["depth"]), lengths.index(case["length"]))
                correct[cell] += case["correct"]
                total[cell] += 1
        accuracy = np.divide(correct, total, out=np.full_like(correct, np.nan), where=total > 0)
        image = axes.imshow(accuracy, vmin=0, vmax=1, cmap=_score_colormap(), aspect="auto", origin="lower")
        axes.set_xticks(range(len(lengths)), [f"{n:,}" for n in lengths], rotation=45, fontsize=7)
        axes.set_yticks([0, NUM_DEPTH_BINS - 1], ["0-0.1", "0.9-1"], fontsize=7)
        axes.set_ylabel("key depth", fontsize=7)
        return image

    _heatmap_panels(_row_keys(cases), (3.0, 2.8), "passkey accuracy (grey: no case)", path, draw)


def plot_needle_heatmap(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """One panel per model x scaling: needle score by prompt length (x) and task (y; last row = mean)."""
    import numpy as np

    lengths = sorted({row["length"] for row in rows})
    tasks = list(dict.fromkeys(row["task"] for row in rows))

    def draw(axes: Any, model: str, scaling: str) -> Any:
        score = np.full((len(tasks) + 1, len(lengths)), np.nan)  # (tasks + mean, lengths)
        for row in rows:
            if (row["model"], row["scaling"]) == (model, scaling):
                score[tasks.index(row["task"]), lengths.index(row["length"])] = row["score"]
        with np.errstate(all="ignore"):
            score[-1] = np.nanmean(score[:-1], axis=0) if np.isfinite(score[:-1]).any() else np.nan
        image = axes.imshow(score, vmin=0, vmax=1, cmap=_score_colormap(), aspect="auto", origin="upper")
        axes.set_xticks(range(len(lengths)), [f"{n:,}" for n in lengths], rotation=45, fontsize=7)
        axes.set_yticks(range(len(tasks) + 1), [*tasks, "mean"], fontsize=7)
        return image

    _heatmap_panels(_row_keys(rows), (3.4, 0.4 * len(tasks) + 1.8), "needle score (grey: not evaluated)", path, draw)


def write_reports(results: dict[str, Any], passkey_cases: Sequence[dict[str, Any]], out_dir: Path) -> list[Path]:
    """tables.md and the PNGs for whatever results exist; returns the paths written."""
    written = [out_dir / "tables.md"]
    written[0].write_text(tables_markdown(results))
    if not plots_available():
        return written
    if results["perplexity"]:
        written.append(out_dir / "perplexity_vs_window.png")
        plot_perplexity(results, written[-1])
    if passkey_cases:
        written.append(out_dir / "passkey_heatmap.png")
        plot_passkey_heatmap(passkey_cases, written[-1])
    if results.get("needles"):
        written.append(out_dir / "needles_heatmap.png")
        plot_needle_heatmap(results["needles"], written[-1])
    return written
