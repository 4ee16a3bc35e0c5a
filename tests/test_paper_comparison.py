"""A reproduction's Table 1 against the paper's, cell by cell (megatron_lite/repro/paper_comparison.py): cells
matched by multiples of each training length, ratios to the row's own 1x, the paper's claims checked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron_lite.repro.paper_comparison import comparison_section, paper_table_markdown, run_rows
from megatron_lite.repro.report import tables_markdown

REPO = Path(__file__).resolve().parents[1]


def _results(ppl: dict[tuple[str, str], list[float]], length: int = 128) -> dict[str, Any]:
    """A results.json holding only what the comparison reads: perplexity at 1x, 2x, 4x ... per (model, scaling)."""
    rows = [{"model": model, "scaling": scaling, "window": length * 2 ** index, "ppl": value}
            for (model, scaling), values in ppl.items() for index, value in enumerate(values)]
    names = {"rope": "RoPE", "coca_slack": "CoCA (slack)", "coca_strict": "CoCA (strict)"}
    training = {model: {"display_name": names[model], "parameters": 41_600_000, "tokens": 47_000_000}
                for model, _ in ppl}
    return {"train_length": length, "perplexity": rows, "training": training}


def test_the_papers_table_is_printed_as_the_paper_prints_it() -> None:
    table = paper_table_markdown()
    assert "| model | 512 | 1024 | 2048 | 4096 | 8192 | 16K | 32K |" in table
    assert "| RoPE | 19.66 | 411.50 | 3276 | 3026 | 3028 | inf | inf |" in table
    assert "| ALiBi | 18.69 | 21.27 | 28.20 | 35.66 | 37.03 | OOM | OOM |" in table
    assert "| CoCA + dynamic NTK | 20.11 | 20.81 | 25.88 | 34.16 | 55.75 | 89.31 | 101.13 |" in table
    assert "1.00, 1.00, 0.96, 0.89, 0.50, 0.23, 0.08" in table


def test_a_run_where_rope_blows_up_and_coca_does_not_reproduces_the_claims() -> None:
    results = _results({("rope", "none"): [20.0, 300.0, 2000.0], ("coca_slack", "none"): [21.0, 30.0, 60.0],
                        ("coca_slack", "dynamic:4"): [21.0, 22.0, 25.0], ("coca_strict", "none"): [21.0, 25.0, 40.0]})
    section = comparison_section(results, "dynamic:4")
    assert section is not None
    assert "| RoPE | this run | 20.00 (1.00x) | 300.0 (15.0x) | 2000 (100.0x) | – | – | – | – |" in section
    assert "| RoPE | paper | 19.66 (1.00x) | 411.5 (20.9x) | 3276 (166.6x) |" in section
    assert "| CoCA + dynamic NTK | this run | 21.00 (1.00x) | 22.00 (1.05x) | 25.00 (1.19x) |" in section
    assert "strict" not in section  # the paper's Table 1 has no row for the strict form
    claims = section.split("The paper's claims")[1]
    assert "| RoPE blows up just past its training length: ppl(2x) >= 2 x ppl(1x) | 20.9x | 15.00x | reproduced |" \
        in claims
    assert "| 1.66x | 1.43x | reproduced |" in claims
    assert "| CoCA's perplexity below RoPE's at every window past 1x | 6 of 6 windows | 2 of 2 windows | reproduced |" \
        in claims
    assert "| dynamic NTK lowers CoCA's perplexity at every window past 1x | 6 of 6 windows | 2 of 2 windows | " \
           "reproduced |" in claims


def test_a_run_where_rope_holds_leaves_the_contrast_untested() -> None:
    results = _results({("rope", "none"): [200.0, 206.0], ("coca_slack", "none"): [195.0, 204.0]})
    claims = comparison_section(results, None).split("The paper's claims")[1]
    assert "| 20.9x | 1.03x | not reproduced |" in claims
    assert "| 1.66x | 1.05x | not tested: RoPE did not blow up |" in claims
    assert "| 6 of 6 windows | – | not measured |" in claims  # no dynamic NTK rows in this run
    assert run_rows(_results({("coca_strict", "none"): [1.0, 2.0]}), None) == {}


def test_the_cpu_pairs_tables_carry_the_comparison() -> None:
    results = json.loads((REPO / "benchmarks/runs/2026-11-27_cpu-tiny-pair-curve_cpu/results.json").read_text())
    tables = tables_markdown(results, 4.0)
    assert tables.index("## Against the paper's Table 1, cell by cell") < tables.index("## For comparison")
    assert "this run's 128 tokens, the paper's 512" in tables
    assert "| RoPE | this run | 191.5 (1.00x) | 198.2 (1.03x) |" in tables
