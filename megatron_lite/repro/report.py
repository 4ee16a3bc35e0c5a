"""results.json, tables.md (the CoCA paper's Tables 1-3 layout) and plots of the tiny reproduction.

Table 1: sliding-window perplexity, rows ALiBi, RoPE, RoPE + dynamic NTK, CoCA, CoCA + dynamic NTK
(slack and strict), columns the context windows. Table 2: passkey accuracy, the same rows, columns
the prompt lengths. Table 3: the dynamic-NTK scaling factor, rows rotary model x factor. The
dynamic-NTK rows of Tables 1 and 2 use one factor fixed before the run (``--headline-ntk-factor``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from megatron_lite.eval.report import (format_ppl, markdown_table, plot_passkey_heatmap, plot_perplexity,
                                       plots_available)
from megatron_lite.repro.curves import curve_section, plot_curves
from megatron_lite.repro.paper_comparison import comparison_section, paper_table_markdown


Key = tuple[str, str]  # (model = scheme, scaling name)
PROFILE_TITLES = {"cpu-tiny": "Tiny CoCA reproduction", "gpu-speedrun": "CoCA speedrun",
                  "paper-350m": "The CoCA paper's 350M run"}


def scaling_name(factor: float) -> str:
    return f"dynamic:{factor:g}"


def row_label(label: str, scaling: str) -> str:
    if scaling == "none":
        return label
    kind, _, factor = scaling.partition(":")
    return f"{label} + {'dynamic NTK' if kind == 'dynamic' else kind} (x{factor})"


def display_names(results: dict[str, Any]) -> dict[str, str]:
    """Model (run) name -> the scheme's display name, as training_summary recorded it."""
    return {name: info["display_name"] for name, info in results["training"].items()}


def rotary_models(results: dict[str, Any]) -> list[str]:
    return [name for name, info in results["training"].items() if info["rotary"]]


def assemble_results(evaluations: dict[str, dict[str, Any]], training: dict[str, dict[str, Any]], train_length: int,
                     train_iters: int, stride: int, settings: dict[str, Any]) -> dict[str, Any]:
    """One results dict from the per-scheme evaluation results (without the per-case passkey records)."""
    results: dict[str, Any] = {"settings": settings, "train_length": train_length, "train_iters": train_iters,
                               "stride": stride, "training": training, "models": {}, "perplexity": [], "passkey": []}
    for evaluation in evaluations.values():
        results["models"].update(evaluation["models"])
        results["perplexity"] += evaluation["perplexity"]
        results["passkey"] += evaluation["passkey"]
    documents = [row for row in results["perplexity"] if row.get("documents")]
    if documents:
        results["eval_documents"] = {"used": documents[0]["documents"],
                                     "skipped_short": documents[0]["documents_skipped"]}
    return results


def _grid(rows: Sequence[dict[str, Any]], column: str, keys: Sequence[Key], labels: dict[str, str],
          format_cell: Callable[[dict[str, Any]], str], train_length: int) -> str:
    columns = sorted({row[column] for row in rows})
    by_key = {(row["model"], row["scaling"], row[column]): row for row in rows}
    header = ["model", *[f"{value:,} (x{value / train_length:g})" for value in columns]]
    body = []
    for scheme, scaling in keys:
        cells = [by_key.get((scheme, scaling, value)) for value in columns]
        if any(cell is not None for cell in cells):
            body.append([row_label(labels[scheme], scaling), *["–" if cell is None else format_cell(cell) for cell in cells]])
    return markdown_table(header, body)


def headline_keys(schemes: Sequence[str], rotary: Sequence[str], headline_factor: float | None) -> list[Key]:
    keys: list[Key] = []
    for scheme in schemes:
        keys.append((scheme, "none"))
        if scheme in rotary and headline_factor is not None:
            keys.append((scheme, scaling_name(headline_factor)))
    return keys


def sweep_keys(rotary: Sequence[str], scalings: Sequence[str]) -> list[Key]:
    return [(scheme, scaling) for scheme in rotary for scaling in scalings]


def _ppl_cell(row: dict[str, Any]) -> str:
    return format_ppl(row["ppl"])


def _accuracy_cell(row: dict[str, Any]) -> str:
    return "–" if row["accuracy"] is None else f"{row['accuracy']:.2f}"


def _distance_cell(row: dict[str, Any]) -> str:
    def fraction(value: float | None) -> str:
        return "–" if value is None else f"{value:.2f}"

    return f"{fraction(row['accuracy_inside'])} / {fraction(row['accuracy_outside'])}"


def training_table(results: dict[str, Any]) -> str:
    def number(value: float | None, digits: int = 3) -> str:
        return "–" if value is None else f"{value:.{digits}f}"

    def rate(value: float | None) -> str:
        return "–" if value is None else f"{value:,.0f}"

    body = [[info["display_name"], f"{info['parameters']:,}", f"{info['steps']:,}", f"{info['tokens']:,}",
             rate(info.get("tokens_per_sec")), number(info["final_train_loss"]), number(info["final_val_loss"]),
             number(info["final_val_ppl"], 2), info["action"]] for scheme, info in results["training"].items()]
    return markdown_table(["model", "parameters", "steps", "training tokens", "tokens/s", "last train loss", "val loss",
                           "val ppl", "this invocation"], body)


def probe_section(probe: dict[str, Any]) -> str:
    """The speedrun's probe and the step count it set."""
    plan = probe["plan"]
    body = [[scheme, f"{row['steps']}", f"{row['tokens_per_sec']:,.0f}", f"{row['startup_seconds']:.1f}",
             f"{row['wall_seconds']:.1f}"] for scheme, row in probe["probes"].items()]
    budget = plan["budget"]
    return ("## Probe and budget\n\n" + markdown_table(["scheme", "steps", "steady tokens/s", "start-up s", "wall s"], body)
            + f"\n\nBudget {budget['total_seconds']:g} s for training + evaluation of all models: per model "
              f"{plan['train_seconds_per_model']} s of training after {plan['startup_seconds']} s start-up and "
              f"{budget['eval_seconds_per_model']:g} s evaluation; at the slowest {plan['slowest_tokens_per_sec']:,.0f} "
              f"tokens/s and {plan['tokens_per_step']:,} tokens per step: {plan['train_iters']:,} steps "
              f"(limited by the {plan['limited_by']}).")


def wall_time_table(results: dict[str, Any]) -> str:
    current, total = results["wall_seconds"], results["wall_seconds_all_invocations"]
    body = [[phase, f"{current.get(phase, 0.0):,.1f}", f"{seconds:,.1f}"] for phase, seconds in total.items()]
    body.append(["**total**", f"{sum(current.values()):,.1f}", f"{sum(total.values()):,.1f}"])
    return markdown_table(["phase", "this invocation, s", "all invocations, s"], body)


def tables_markdown(results: dict[str, Any], headline_factor: float | None) -> str:
    schemes, settings = list(results["training"]), results["settings"]
    scalings = ["none", *(scaling_name(factor) for factor in settings["ntk_factors"])]
    headline = headline_factor if settings["ntk_factors"] else None
    train_length, perplexity, passkey = results["train_length"], results["perplexity"], results["passkey"]
    labels, rotary = display_names(results), rotary_models(results)
    headline_rows = headline_keys(schemes, rotary, headline)
    title = PROFILE_TITLES[settings.get("profile", "cpu-tiny")]
    if settings.get("dry_run"):
        title += " (dry run at toy size)"
    parts = [f"# {title}: {', '.join(labels.values())}\n\n"
             f"Trained on {train_length} tokens for {results['train_iters']:,} steps; columns give tokens and (x) "
             "multiples of the training length. Dynamic NTK rows of Tables 1-2: "
             f"{'factor ' + format(headline, 'g') if headline is not None else 'none'}.\n\n"
             "## Training\n\n" + training_table(results)]
    if perplexity:
        documents = results.get("eval_documents", {})
        parts.append(f"## Table 1: sliding-window perplexity on {settings['eval_books']}\n\n"
                     f"Stride {results['stride']}; {documents.get('used')} books truncated to "
                     f"{settings['max_doc_tokens']:,} tokens ({documents.get('skipped_short')} shorter ones skipped)."
                     "\n\n" + _grid(perplexity, "window", headline_rows, labels, _ppl_cell, train_length))
    if passkey:
        parts.append(f"## Table 2: passkey retrieval accuracy\n\n{settings['passkey_cases']} cases per length (keys "
                     "and depths drawn once per length, the same for every model).\n\n"
                     + _grid(passkey, "length", headline_rows, labels, _accuracy_cell, train_length)
                     + "\n\nBy passkey distance (accuracy when the key lies inside / outside the training window "
                       "of the question; – no such case):\n\n"
                     + _grid(passkey, "length", headline_rows, labels, _distance_cell, train_length))
    if len(scalings) > 1 and rotary:
        sweep = sweep_keys(rotary, scalings)
        part = "## Table 3: dynamic NTK scaling factor\n\nPerplexity:\n\n" + _grid(
            perplexity, "window", sweep, labels, _ppl_cell, train_length)
        if passkey:
            part += "\n\nPasskey accuracy:\n\n" + _grid(passkey, "length", sweep, labels, _accuracy_cell, train_length)
        parts.append(part)
    curves = curve_section(results)
    if curves is not None:
        parts.append(curves)
    if "probe" in results:
        parts.append(probe_section(results["probe"]))
    if "budget" in results:
        from megatron_lite.repro.paper import budget_text

        parts.append("## Budget\n\nAs planned before the run (`budget.json`):\n\n```\n"
                     + budget_text(results["budget"]) + "\n```")
    parts.append("## Wall time\n\n" + wall_time_table(results))
    comparison = comparison_section(results, scaling_name(headline) if headline is not None else None)
    if comparison is not None:
        parts.append(comparison)
    parts.append("## For comparison\n\n" + paper_table_markdown())
    return "\n\n".join(parts) + "\n"


def write_plots(results: dict[str, Any], passkey_cases: Sequence[dict[str, Any]], out_dir: Path) -> list[Path]:
    """perplexity_vs_window.png (Table 1 rows), perplexity_ntk_factors.png (Table 3 rows), passkey_heatmap.png,
    extrapolation_curves.png (the in-training curves); none where matplotlib is not installed (a bare GPU node:
    the tables and results.json hold every number)."""
    written: list[Path] = []
    if not plots_available():
        return written
    schemes, rotary = list(results["training"]), rotary_models(results)
    factors = results["settings"]["ntk_factors"]
    headline = results["settings"]["headline_ntk_factor"] if factors else None
    groups = [("perplexity_vs_window.png", set(headline_keys(schemes, rotary, headline)))]
    if factors and rotary:
        groups.append(("perplexity_ntk_factors.png",
                       set(sweep_keys(rotary, ["none", *(scaling_name(f) for f in factors)]))))
    for name, keys in groups:
        rows = [row for row in results["perplexity"] if (row["model"], row["scaling"]) in keys]
        if rows:
            written.append(out_dir / name)
            plot_perplexity({"perplexity": rows, "models": results["models"]}, written[-1])
    if passkey_cases:
        written.append(out_dir / "passkey_heatmap.png")
        plot_passkey_heatmap(passkey_cases, written[-1])
    if plot_curves(results, out_dir / "extrapolation_curves.png"):
        written.append(out_dir / "extrapolation_curves.png")
    return written
