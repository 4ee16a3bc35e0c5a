"""Markdown tables (the paper's Tables 1-3 layout: rows = model x scaling, columns = context window)
and PNG plots (perplexity vs window on log axes like the paper's Figure 1; passkey length x depth
heatmaps) from ``results.json`` rows."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Sequence
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


def tables_markdown(results: dict[str, Any]) -> str:
    settings, models = results.get("settings", {}), results.get("models", {})
    parts = []
    if results["perplexity"]:
        first = results["perplexity"][0]
        parts.append(f"### Sliding-window perplexity (stride {settings.get('stride')}; {first['documents']} documents "
                     f"truncated to {settings.get('max_doc_tokens'):,} tokens, {first['documents_skipped']} shorter "
                     "skipped; columns = context window in tokens)\n\n"
                     + perplexity_table(results["perplexity"], models))
        budget = settings.get("max_doc_chars")
        parts.append("### Bits per byte (NLL in bits over the UTF-8 bytes of the scored text"
                     + (f"; texts cut to {budget:,} characters before tokenising" if budget else "")
                     + "; columns = context window in tokens)\n\n" + bits_per_byte_table(results["perplexity"], models))
    if results["passkey"]:
        cases = results["passkey"][0]["cases"]
        parts.append(f"### Passkey retrieval accuracy, % ({cases} cases per length; columns = prompt length in "
                     "tokens)\n\n" + passkey_table(results["passkey"], models))
        parts.append("### Passkey accuracy by passkey distance, % (inside / outside the training window; – = no "
                     "case)\n\n" + passkey_distance_table(results["passkey"], models))
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


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_perplexity(results: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
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


def plot_passkey_heatmap(cases: Sequence[dict[str, Any]], path: Path) -> None:
    """One panel per model x scaling: accuracy by prompt length (x) and key depth decile (y)."""
    import numpy as np

    plt = _pyplot()
    keys = _row_keys(cases)
    lengths = sorted({case["length"] for case in cases})
    num_columns = min(len(keys), 4)
    num_rows = (len(keys) + num_columns - 1) // num_columns
    figure, axes_grid = plt.subplots(num_rows, num_columns, figsize=(3.0 * num_columns + 1, 2.8 * num_rows),
                                     squeeze=False, constrained_layout=True)
    colormap = plt.get_cmap("RdYlGn").with_extremes(bad="lightgrey")  # grey: no case drawn in that cell
    image = None
    for index, (model, scaling) in enumerate(keys):
        correct = np.zeros((NUM_DEPTH_BINS, len(lengths)))
        total = np.zeros((NUM_DEPTH_BINS, len(lengths)))
        for case in cases:
            if case["model"] == model and case["scaling"] == scaling:
                cell = (depth_bin(case["depth"]), lengths.index(case["length"]))
                correct[cell] += case["correct"]
                total[cell] += 1
        accuracy = np.divide(correct, total, out=np.full_like(correct, np.nan), where=total > 0)
        axes = axes_grid[index // num_columns][index % num_columns]
        image = axes.imshow(accuracy, vmin=0, vmax=1, cmap=colormap, aspect="auto", origin="lower")
        axes.set_xticks(range(len(lengths)), [f"{n:,}" for n in lengths], rotation=45, fontsize=7)
        axes.set_yticks([0, NUM_DEPTH_BINS - 1], ["0-0.1", "0.9-1"], fontsize=7)
        axes.set_title(f"{model} ({scaling})", fontsize=8)
        axes.set_xlabel("prompt length (tokens)", fontsize=7)
        axes.set_ylabel("key depth", fontsize=7)
    for index in range(len(keys), num_rows * num_columns):
        axes_grid[index // num_columns][index % num_columns].axis("off")
    if image is not None:
        figure.colorbar(image, ax=axes_grid, shrink=0.8, label="passkey accuracy (grey: no case)")
    figure.savefig(path, dpi=110)
    plt.close(figure)


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
    return written
