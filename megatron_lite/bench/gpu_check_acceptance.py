"""The summaries of tools/gpu/acceptance.sh's phases, from the runs' metrics.jsonl and gpu_check.json files.

    python -m megatron_lite.bench.gpu_check_acceptance resume KILLED_RUN REFERENCE_RUN RESUMED_FROM OUT_STEM
    python -m megatron_lite.bench.gpu_check_acceptance runs OUT_STEM --run NAME=RUN_DIR ... [--twin NAME=JSON ...]

``resume``: the training losses of a run killed after a save and resumed (its metrics.jsonl holds both; a step
logged twice counts as the resumed run logged it) against an uninterrupted run's, step by step; the largest
absolute difference after the resume point is bf16's noise on a GPU, not an error, so it is printed, not judged.
``runs``: each run's exit, steady tokens/s, MFU and peak memory (users_command.summarise_metrics), its losses
against the first run's at the same steps, and with ``--twin`` the Hugging Face twin's compiled throughput rows
of a gpu_check at the same micro batch (its loss eager, and inside its compiled region) and our tokens/s over
theirs. Each writes OUT_STEM.json and OUT_STEM.md and prints the markdown.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

from megatron_lite.bench.users_command import read_metrics, summarise_metrics

Losses = dict[int, float]


def training_losses(rows: list[dict[str, Any]]) -> Losses:
    """step -> training loss; a step logged again (by a resumed run) takes its last value."""
    return {int(row["step"]): float(row["loss"]) for row in rows if "step" in row and row.get("loss") is not None}


def loss_differences(losses: Losses, reference: Losses, after: int = 0) -> dict[str, Any]:
    """The steps past ``after`` both logged, and the largest absolute loss difference over them."""
    steps = sorted(step for step in losses if step in reference and step > after)
    differences = [abs(losses[step] - reference[step]) for step in steps]
    return {"steps": steps, "max_abs_diff": max(differences) if differences else None,
            "last_step": steps[-1] if steps else None,
            "last_loss": losses[steps[-1]] if steps else None,
            "reference_last_loss": reference[steps[-1]] if steps else None}


def resume_report(killed: Path, reference: Path, resumed_from: int) -> dict[str, Any]:
    """The killed-and-resumed run's losses against the uninterrupted run's: before the kill, and after it."""
    resumed = training_losses(read_metrics(killed / "metrics.jsonl"))
    uninterrupted = training_losses(read_metrics(reference / "metrics.jsonl"))
    before = {step: loss for step, loss in resumed.items() if step <= resumed_from}
    return {"resumed_from": resumed_from, "steps_logged": len(resumed), "reference_steps_logged": len(uninterrupted),
            "before_the_kill": loss_differences(before, uninterrupted),
            "after_the_resume": loss_differences(resumed, uninterrupted, after=resumed_from),
            "per_step": [{"step": step, "loss": resumed[step], "reference": uninterrupted.get(step)}
                         for step in sorted(resumed)]}


def resume_markdown(report: dict[str, Any]) -> str:
    after, before = report["after_the_resume"], report["before_the_kill"]
    lines = ["# Killed after a save, resumed, against an uninterrupted run", "",
             f"Resumed from step {report['resumed_from']}; the losses after it against the uninterrupted run's at "
             f"the same steps: max abs difference {_number(after['max_abs_diff'])} over steps "
             f"{_span(after['steps'])} (bf16 on a GPU: up to ~2e-2 is noise); before the kill "
             f"{_number(before['max_abs_diff'])} over steps {_span(before['steps'])}.", "",
             "| step | resumed run | uninterrupted run |", "|---:|---:|---:|"]
    lines += [f"| {row['step']} | {_loss(row['loss'])} | {_loss(row['reference'])} |" for row in report["per_step"]]
    return "\n".join(lines) + "\n"


def _seq_length(run_dir: Path) -> int:
    try:
        return int(yaml.safe_load((run_dir / "config.yml").read_text())["model"]["seq_length"])
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError):
        return 512


def run_row(name: str, run_dir: Path, reference: Losses | None) -> dict[str, Any]:
    """One run's figures; ``reference``: the first run's losses, compared step by step."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    row: dict[str, Any] = {"run": name, **summarise_metrics(rows, _seq_length(run_dir))}
    exit_file = run_dir.parent / f"{run_dir.name}.exit"
    row["exit_code"] = exit_file.read_text().strip() if exit_file.is_file() else "-"
    if reference is not None:
        compared = loss_differences(training_losses(rows), reference)
        row.update(loss_steps=_span(compared["steps"]), max_abs_loss_diff=compared["max_abs_diff"])
    return row


def twin_rows(gpu_check_json: Path) -> list[dict[str, Any]]:
    """The compiled throughput rows of a gpu_check: ours and the Hugging Face twin's (each twin loss)."""
    try:
        rows = json.loads(gpu_check_json.read_text())["throughput"]["rows"]
    except (OSError, KeyError, TypeError, ValueError):
        return []
    return [row for row in rows if row.get("mode") == "compiled"]


def runs_report(runs: list[tuple[str, Path]], twins: dict[str, Path]) -> dict[str, Any]:
    first = training_losses(read_metrics(runs[0][1] / "metrics.jsonl")) if runs else {}
    rows = [run_row(name, run_dir, first if index else None) for index, (name, run_dir) in enumerate(runs)]
    comparisons = []
    for name, path in twins.items():
        ours = next((row for row in rows if row["run"] == name), {})
        for twin in twin_rows(path):
            label = twin["model"] + (f" (loss {twin['twin_loss']})" if twin.get("twin_loss") else "")
            tokens = twin.get("tokens_per_sec")
            comparisons.append({"run": name, "row": label, "status": twin.get("status"),
                                "micro_batch": twin.get("micro_batch"), "tokens_per_sec": tokens,
                                "run_over_row": ours.get("tokens_per_sec") / tokens
                                if tokens and ours.get("tokens_per_sec") else None})
    return {"runs": rows, "throughput": comparisons}


def runs_markdown(report: dict[str, Any]) -> str:
    columns = ["run", "exit_code", "steady_steps", "tokens_per_sec", "mfu", "peak_memory_gb", "first_step_s",
               "loss_first", "loss_last", "loss_steps", "max_abs_loss_diff"]
    lines = ["# Runs", "", "Losses compared with the first run's at the same steps.", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_number(row.get(column)) for column in columns) + " |" for row in report["runs"]]
    if report["throughput"]:
        columns = ["run", "row", "status", "micro_batch", "tokens_per_sec", "run_over_row"]
        lines += ["", "## The compiled throughput rows at the same micro batch (gpu_check)", "",
                  "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(_number(row.get(column)) for column in columns) + " |"
                  for row in report["throughput"]]
    return "\n".join(lines) + "\n"


def _span(steps: list[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if steps else "none"


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.5f}"


def _number(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if value != 0 and abs(value) < 1e-2 else f"{value:,.4g}"
    return str(value).replace("|", "\\|")


def _write(stem: Path, report: dict[str, Any], markdown: str) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    stem.with_suffix(".md").write_text(markdown)
    print(markdown, end="")


def _named_paths(words: list[str], what: str) -> list[tuple[str, Path]]:
    pairs = []
    for word in words:
        name, sep, path = word.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"{word!r}: expected NAME={what}")
        pairs.append((name, Path(path)))
    return pairs


def main(argv: list[str] | None = None) -> int:
    import argparse

    from megatron_lite.cli import print_error

    parser = argparse.ArgumentParser(prog="python -m megatron_lite.bench.gpu_check_acceptance",
                                     description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    resume = commands.add_parser("resume", help="a killed and resumed run against an uninterrupted one")
    resume.add_argument("killed", type=Path)
    resume.add_argument("reference", type=Path)
    resume.add_argument("resumed_from", type=int)
    resume.add_argument("out_stem", type=Path)
    runs = commands.add_parser("runs", help="runs side by side, losses against the first run's")
    runs.add_argument("out_stem", type=Path)
    runs.add_argument("--run", action="append", required=True, metavar="NAME=RUN_DIR",
                      help="a run dir, named; the first run's losses are the reference")
    runs.add_argument("--twin", action="append", default=[], metavar="NAME=GPU_CHECK_JSON",
                      help="a gpu_check's compiled throughput rows beside run NAME")
    args = parser.parse_args(argv)
    try:
        if args.command == "resume":
            report = resume_report(args.killed, args.reference, args.resumed_from)
            _write(args.out_stem, report, resume_markdown(report))
        else:
            report = runs_report(_named_paths(args.run, "RUN_DIR"), dict(_named_paths(args.twin, "GPU_CHECK_JSON")))
            _write(args.out_stem, report, runs_markdown(report))
    except ValueError as error:
        print_error(error)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
