"""The CoCA paper's Table 1 as data, and a run's Table 1 against it cell by cell.

The paper (arXiv 2309.08646, Table 1) trained 350M models at 512 tokens and read PG-19 through windows of
512 ... 32K tokens (1x ... 64x). A run of this repository trains at its own length L, so cells are matched by
the multiple kx, not by tokens. Each cell gives the perplexity and its ratio to the same row's 1x, the number
that says whether a model extrapolates whatever its level. Four of the paper's claims are then checked on the
run's own numbers, each with the criterion written next to it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

PAPER_TRAIN_LENGTH = 512
PAPER_MULTIPLES = (1, 2, 4, 8, 16, 32, 64)
OOM = None  # the paper's "OOM" cells
# (paper row, dynamic NTK at inference) -> perplexity at 1x ... 64x
PAPER_TABLE_1: dict[tuple[str, bool], tuple[float | None, ...]] = {
    ("ALiBi", False): (18.69, 21.27, 28.20, 35.66, 37.03, OOM, OOM),
    ("RoPE", False): (19.66, 411.50, 3276, 3026, 3028, math.inf, math.inf),
    ("RoPE", True): (19.66, 22.30, 38.00, 75.75, 138.13, 370.75, 380.75),
    ("CoCA", False): (20.11, 33.47, 69.06, 113.19, 157.38, 141.00, 171.63),
    ("CoCA", True): (20.11, 20.81, 25.88, 34.16, 55.75, 89.31, 101.13),
}
PAPER_PASSKEY_COCA_DYNAMIC = (1.00, 1.00, 0.96, 0.89, 0.50, 0.23, 0.08)
# our run names -> the paper's row (the paper's CoCA is the slack form; strict has no Table 1 row)
PAPER_ROW_OF = {"alibi": "ALiBi", "rope": "RoPE", "coca_slack": "CoCA"}
BREAK_RATIO = 2.0  # "blows up": perplexity at 2x at least twice its 1x (the paper's RoPE: 20.9x)


def _paper_cell(value: float | None) -> str:
    """As the paper prints a cell: OOM, inf, whole numbers from 1,000 up, else two decimals."""
    if value is None:
        return "OOM"
    if math.isinf(value):
        return "inf"
    return f"{value:g}" if value >= 1000 else f"{value:.2f}"


def paper_table_markdown() -> str:
    """The paper's Tables 1 and 2 as it prints them (Table 1 rows from ``PAPER_TABLE_1``)."""
    columns = [f"{PAPER_TRAIN_LENGTH * k // 1024}K" if PAPER_TRAIN_LENGTH * k >= 16384 else str(PAPER_TRAIN_LENGTH * k)
               for k in PAPER_MULTIPLES]
    lines = ["Paper, Table 1 (350M models trained on 512 tokens, PG-19, columns 512 ... 32K = 1x ... 64x):", "",
             "| model | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for (row, dynamic), values in PAPER_TABLE_1.items():
        name = f"{row} + dynamic NTK" if dynamic else row
        lines.append(f"| {name} | " + " | ".join(_paper_cell(value) for value in values) + " |")
    passkey = ", ".join(f"{value:.2f}" for value in PAPER_PASSKEY_COCA_DYNAMIC)
    lines += ["", f"Paper, Table 2 (passkey accuracy, CoCA + dynamic NTK, 512 ... 32K): {passkey}."]
    return "\n".join(lines) + "\n"


def _ratios(values: Sequence[float | None]) -> list[float | None]:
    first = values[0]
    if first is None or not first:
        return [None] * len(values)
    return [None if value is None else value / first for value in values]


def _cell(value: float | None, ratio: float | None) -> str:
    if value is None:
        return "–"
    if math.isinf(value):
        return "inf"
    shown = f"{value:.0f}" if value >= 1000 else f"{value:.1f}" if value >= 100 else f"{value:.2f}"
    return shown if ratio is None else f"{shown} ({ratio:.1f}x)" if ratio >= 10 else f"{shown} ({ratio:.2f}x)"


def run_rows(results: dict[str, Any], dynamic: str | None) -> dict[tuple[str, bool], list[float | None]]:
    """(run name, dynamic NTK) -> the run's perplexity at each of ``PAPER_MULTIPLES`` (None where not measured),
    for the runs with a paper row; ``dynamic``: the scaling of the dynamic NTK rows (e.g. dynamic:4), if any."""
    length = results["train_length"]
    by_cell = {(row["model"], row["scaling"], row["window"]): row["ppl"] for row in results.get("perplexity", [])}
    found: dict[tuple[str, bool], list[float | None]] = {}
    for name in results["training"]:
        if name not in PAPER_ROW_OF:
            continue
        for scaling, is_dynamic in (("none", False), (dynamic, True)):
            if scaling is None:
                continue
            values = [by_cell.get((name, scaling, length * k)) for k in PAPER_MULTIPLES]
            if (PAPER_ROW_OF[name], is_dynamic) in PAPER_TABLE_1 and any(value is not None for value in values):
                found[(name, is_dynamic)] = values
    return found


def _claims(rows: dict[tuple[str, bool], list[float | None]]) -> list[list[str]]:
    """The paper's four extrapolation claims on its own numbers and on the run's: [claim, paper, run, verdict]."""
    def ratio_at(values: Sequence[float | None] | None, k: int) -> float | None:
        return None if values is None else _ratios(values)[PAPER_MULTIPLES.index(k)]

    def below_everywhere(lower: Sequence[float | None] | None,
                         higher: Sequence[float | None] | None) -> tuple[int, int] | None:
        """(windows past 1x where ``lower`` is below ``higher``, windows both measured); None: none measured."""
        if lower is None or higher is None:
            return None
        pairs = [(a, b) for a, b in zip(lower[1:], higher[1:]) if a is not None and b is not None]
        return (sum(a < b for a, b in pairs), len(pairs)) if pairs else None

    def windows(count: tuple[int, int] | None) -> str:
        return "–" if count is None else f"{count[0]} of {count[1]} windows"

    paper = {key: list(values) for key, values in PAPER_TABLE_1.items()}
    rope, coca = rows.get(("rope", False)), rows.get(("coca_slack", False))
    coca_dynamic = rows.get(("coca_slack", True))
    checks = []
    paper_rope, run_rope = ratio_at(paper[("RoPE", False)], 2), ratio_at(rope, 2)
    checks.append([f"RoPE blows up just past its training length: ppl(2x) >= {BREAK_RATIO:g} x ppl(1x)",
                   f"{paper_rope:.1f}x", "–" if run_rope is None else f"{run_rope:.2f}x",
                   _verdict(None if run_rope is None else run_rope >= BREAK_RATIO)])
    paper_coca, run_coca = ratio_at(paper[("CoCA", False)], 2), ratio_at(coca, 2)
    if run_coca is None or run_rope is None:
        contrast = "not measured"
    elif run_rope < BREAK_RATIO:
        contrast = "not tested: RoPE did not blow up"
    else:
        contrast = _verdict(run_coca < BREAK_RATIO)
    checks.append([f"where RoPE blows up, CoCA does not: its ppl(2x) < {BREAK_RATIO:g} x ppl(1x)", f"{paper_coca:.2f}x",
                   "–" if run_coca is None else f"{run_coca:.2f}x", contrast])
    paper_below = below_everywhere(paper[("CoCA", False)], paper[("RoPE", False)])
    run_below = below_everywhere(coca, rope)
    checks.append(["CoCA's perplexity below RoPE's at every window past 1x", windows(paper_below),
                   windows(run_below), _verdict(None if run_below is None else run_below[0] == run_below[1])])
    paper_ntk = below_everywhere(paper[("CoCA", True)], paper[("CoCA", False)])
    run_ntk = below_everywhere(coca_dynamic, coca)
    checks.append(["dynamic NTK lowers CoCA's perplexity at every window past 1x", windows(paper_ntk),
                   windows(run_ntk), _verdict(None if run_ntk is None else run_ntk[0] == run_ntk[1])])
    return checks


def _verdict(holds: bool | None) -> str:
    return "not measured" if holds is None else ("reproduced" if holds else "not reproduced")


def comparison_section(results: dict[str, Any], dynamic: str | None) -> str | None:
    """Markdown: the run's Table 1 rows beside the paper's at the same multiples of the training length, then the
    paper's claims checked; None when the run has no perplexity for a model with a paper row. ``dynamic``: the
    scaling of the run's dynamic NTK rows (e.g. dynamic:4), if any."""
    rows = run_rows(results, dynamic)
    if not rows:
        return None
    length = results["train_length"]
    header = ["model", "source", *[f"{k}x" for k in PAPER_MULTIPLES]]
    table = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for (name, is_dynamic), values in rows.items():
        label = PAPER_ROW_OF[name] + (" + dynamic NTK" if is_dynamic else "")
        paper_values = PAPER_TABLE_1[(PAPER_ROW_OF[name], is_dynamic)]
        for source, cells in (("paper", paper_values), ("this run", values)):
            table.append(f"| {label} | {source} | " + " | ".join(
                _cell(value, ratio) for value, ratio in zip(cells, _ratios(cells))) + " |")
    training = results["training"]
    scale = "; ".join(f"{info.get('display_name', name)}: {info.get('parameters', 0):,} parameters, "
                      f"{info.get('tokens', 0):,} tokens" for name, info in training.items() if name in PAPER_ROW_OF)
    claims = ["| claim | paper | this run | |", "|---|---|---|---|",
              *("| " + " | ".join(row) + " |" for row in _claims(rows))]
    factor = f" Dynamic NTK rows: factor {dynamic.partition(':')[2]} here." if dynamic is not None else ""
    intro = (f"Columns are multiples of each training length: this run's {length:,} tokens, the paper's 512. Each "
             f"cell: perplexity (its ratio to the row's own 1x). The paper: 350M-parameter models; this run: {scale}. "
             f"CoCA is the slack form here, as in the paper.{factor}")
    return (f"## Against the paper's Table 1, cell by cell\n\n{intro}\n\n" + "\n".join(table)
            + "\n\nThe paper's claims, on its numbers and on this run's:\n\n" + "\n".join(claims))
