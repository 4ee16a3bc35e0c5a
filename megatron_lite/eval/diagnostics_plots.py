"""Plots of ``megatron_lite.eval.diagnostics`` results (docs/diagnostics.md): the anomalous fraction as a
layer x head heatmap per length, attention mass vs distance in and beyond the training length, and the
magnitude-weighted distribution of the initial angles Theta_j."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from megatron_lite.eval.report import plots_available, pyplot as _pyplot

def layer_head_grid(rows: list[dict[str, Any]], length: int, key: str) -> list[list[float]]:
    """(layers, heads) values of ``key`` at one length (NaN where null)."""
    chosen = [row for row in rows if row["length"] == length]
    layers, heads = max(r["layer"] for r in chosen) + 1, max(r["head"] for r in chosen) + 1
    grid = [[math.nan] * heads for _ in range(layers)]
    for row in chosen:
        grid[row["layer"]][row["head"]] = math.nan if row[key] is None else row[key]
    return grid


def plot_anomalous_heatmap(result: dict[str, Any], path: Path) -> None:
    """One layer x head panel per length, colour = anomalous fraction (shared scale)."""
    plt = _pyplot()
    lengths = result["lengths"]
    grids = [layer_head_grid(result["rows"], length, "anomalous_fraction") for length in lengths]
    top = max((v for grid in grids for line in grid for v in line if not math.isnan(v)), default=1.0) or 1.0
    layers, heads = len(grids[0]), len(grids[0][0])
    size = (1.5 + min(0.4 * heads + 0.5, 4.0) * len(lengths), 1.6 + min(0.45 * layers, 8.0))
    figure, axes = plt.subplots(1, len(lengths), figsize=size, squeeze=False, sharey=True, constrained_layout=True)
    for index, (ax, length, grid) in enumerate(zip(axes[0], lengths, grids)):
        image = ax.imshow(grid, vmin=0.0, vmax=top, cmap="magma", aspect="auto")
        for layer, line in enumerate(grid):
            for head, value in enumerate(line):
                ax.text(head, layer, f"{value:.2f}", ha="center", va="center", fontsize=6,
                        color="white" if value < top / 2 else "black")
        ax.set_xticks(range(heads))
        ax.set_yticks(range(layers))
        ax.set_title(f"L = {length}", fontsize=9)
        ax.set_xlabel("head")
        if index == 0:
            ax.set_ylabel("layer")
    figure.colorbar(image, ax=axes[0].tolist(), shrink=0.9, label="anomalous fraction")
    figure.suptitle(f"{result['model']['scheme']}: triples with Theta > pi and m - n < tau "
                    f"(train length {result['model']['train_length']})", fontsize=10)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def mass_curve(rows: list[dict[str, Any]], length: int, layer: int | None = None) -> list[float]:
    """Mass per distance bin at one length, averaged over heads (and layers when ``layer`` is None)."""
    chosen = [r["mass_by_distance"] for r in rows if r["length"] == length and layer in (None, r["layer"])]
    return [sum(values) / len(chosen) for values in zip(*chosen)]


def bin_positions(num_bins: int) -> list[float]:
    """x of each distance bin on a log axis: its first distance, with d = 0 drawn at 0.5."""
    return [0.5] + [float(2 ** (b - 1)) for b in range(1, num_bins)]


def plot_mass_vs_distance(result: dict[str, Any], path: Path) -> None:
    """Left: layer-averaged mass per log2 distance bin, one curve per length; right: per layer at the longest."""
    plt = _pyplot()
    rows, lengths, train_length = result["rows"], result["lengths"], result["model"]["train_length"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for length in lengths:
        curve = mass_curve(rows, length)
        style = "-" if length <= train_length else "--"
        left.plot(bin_positions(len(curve)), curve, style, marker="o", markersize=3,
                  label=f"L = {length} ({length / train_length:g}x)")
    longest = lengths[-1]
    for layer in range(result["model"]["num_layers"]):
        curve = mass_curve(rows, longest, layer)
        right.plot(bin_positions(len(curve)), curve, marker="o", markersize=3, label=f"layer {layer}")
    for ax, title in ((left, "all layers and heads"), (right, f"L = {longest}, heads averaged")):
        ax.set_xscale("log", base=2)
        ax.axvline(train_length, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel("distance m - n (bin start; 0 drawn at 0.5)")
        ax.set_ylabel("attention mass in bin")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    figure.suptitle(f"{result['model']['scheme']}: attention mass by distance (dotted: training length)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_theta_histogram(result: dict[str, Any], path: Path) -> None:
    """Magnitude-weighted Theta distribution per layer (heads averaged) at the training length (or the shortest)."""
    plt = _pyplot()
    length = min(result["lengths"], key=lambda n: abs(n - result["model"]["train_length"]))
    edges = result["theta_bin_edges"]
    centres = [(a + b) / 2 for a, b in zip(edges, edges[1:])]
    figure, ax = plt.subplots(figsize=(7, 4))
    for layer in range(result["model"]["num_layers"]):
        hists = [r["theta_histogram"] for r in result["rows"]
                 if r["length"] == length and r["layer"] == layer and r["theta_histogram"] is not None]
        if hists:
            ax.plot(centres, [sum(v) / len(hists) for v in zip(*hists)], marker=".", label=f"layer {layer}")
    ax.axvline(math.pi, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("initial angle Theta_j (rad, ccw from k to q)")
    ax.set_ylabel("|q_j||k_j|-weighted share")
    ax.set_title(f"{result['model']['scheme']}: Theta distribution at L = {length} (dotted: pi)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_plots(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """The mass-vs-distance plot always; the angle plots for rotary schemes. None without matplotlib."""
    if not plots_available():
        return []
    written = [out_dir / "attention_mass_vs_distance.png"]
    plot_mass_vs_distance(result, written[0])
    if result["model"]["rotary"]:
        written += [out_dir / "anomalous_fraction_heatmap.png", out_dir / "theta_histogram.png"]
        plot_anomalous_heatmap(result, written[1])
        plot_theta_histogram(result, written[2])
    return written
