"""Run records (benchmarks/runs/<date>_<what>_<device>/): each record.json figure equals what its raw files say,
and every results-table row in README.md and docs/performance.md quotes only figures its record holds.

A figure's ``source`` says how to recompute it from the record's raw files (benchmarks/runs/README.md,
"record.json"); ``value`` is that number rounded to ``digits``, ``text`` is ``format`` applied to it times ``scale``.
So a record cannot drift from its raw data, and a doc cannot drift from its record.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

import pytest

from megatron_lite.repro import run_length

REPO = Path(__file__).resolve().parents[1]
RUNS = REPO / "benchmarks" / "runs"
RECORDS = sorted(path.parent for path in RUNS.glob("*/record.json"))
RESULT_DOCS = (REPO / "README.md", REPO / "docs" / "performance.md")
RECORD_FIELDS = {"record", "what", "date", "device", "commit", "software", "commands", "conditions", "figures"}
FIGURE_FIELDS = {"value", "unit", "text", "format", "digits", "source", "conditions"}

# A figure as docs quote it: a percentage, tokens/s (with K or M), a ratio with decimals and an "x" (1.21x; a
# window multiple such as 32x is not a figure), seconds, GB or GiB.
QUOTED_FIGURE = re.compile(
    r"(?<![\w.,])(?:"
    r"\d[\d,]*(?:\.\d+)?[KM]? tokens/s"
    r"|\d+(?:\.\d+)?%"
    r"|\d+\.\d+x(?![\w])"
    r"|\d+(?:\.\d+)? s(?![\w])"
    r"|\d+(?:\.\d+)? GiB|\d+(?:\.\d+)? GB"
    r")")
RECORD_LINK = re.compile(r"benchmarks/runs/(\d{4}-\d{2}-\d{2}_[\w.-]+?)/")


# ----------------------------------------------------------------------------------------------
# Recomputing a figure from raw files


def _load_json(path: Path) -> Any:
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return json.loads(path.read_text())


def _number(value: Any) -> float:
    return float(str(value).replace(",", "")) if isinstance(value, str) else float(value)


def recompute(record: Path, source: dict[str, Any]) -> float:
    """The unrounded figure a source describes, read from the record's files."""
    if "ratio" in source:
        numerator, denominator = source["ratio"]
        return recompute(record, numerator) / recompute(record, denominator)
    path = record / source["file"]
    if "regex" in source:
        match = re.search(source["regex"], path.read_text())
        assert match, f"{path.name}: no match for {source['regex']!r}"
        return _number(match.group(1))
    if "users_command_steady" in source:
        from megatron_lite.bench.users_command import read_metrics, summarise_metrics

        summary = summarise_metrics(read_metrics(path), 512, through_step=source["through_step"])
        return float(summary[source["users_command_steady"]])
    if "forecast" in source:
        from megatron_lite.repro.break_forecast import forecast_window, load_curves

        (rows,) = load_curves(path).values()
        item = forecast_window(rows, source["multiple"])
        assert item is not None and item.fit is not None, f"{path.name}: no fit at x{source['multiple']}"
        field = source["forecast"]
        return float(getattr(item, field) if field == "projected_tokens" else getattr(item.fit, field))
    node = _load_json(path)
    for key in source.get("path", []):
        node = node[key]
    if "where" in source:
        matches = [row for row in node if all(row.get(key) == value for key, value in source["where"].items())]
        assert len(matches) == 1, f"{path.name}: {len(matches)} rows where {source['where']}"
        node = matches[0]
    if "median" in source:
        return statistics.median(_number(row[source["median"]]) for row in node
                                 if row.get(source["median"]) is not None)
    return _number(node[source["field"]])


def display(figure: dict[str, Any], unrounded: float) -> str:
    return figure["format"].format(unrounded * figure.get("scale", 1))


def record_json(record: Path) -> dict[str, Any]:
    return json.loads((record / "record.json").read_text())


# ----------------------------------------------------------------------------------------------
# (a) a record equals its raw files


def test_every_record_folder_has_a_record_and_a_readme() -> None:
    folders = sorted(path for path in RUNS.iterdir() if path.is_dir())
    assert folders == RECORDS, "a folder of benchmarks/runs/ without record.json"
    for folder in folders:
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}_[a-z0-9-]+_[a-z0-9]+", folder.name), folder.name
        assert (folder / "README.md").is_file(), folder.name


@pytest.mark.parametrize("record", RECORDS, ids=lambda path: path.name)
def test_record_figures_equal_the_raw_files(record: Path) -> None:
    data = record_json(record)
    assert set(data) == RECORD_FIELDS, f"{record.name}: fields {sorted(set(data) ^ RECORD_FIELDS)}"
    assert data["record"] == record.name and record.name.startswith(data["date"])
    assert data["figures"], record.name
    for key, figure in data["figures"].items():
        assert FIGURE_FIELDS <= set(figure) <= FIGURE_FIELDS | {"scale", "note"}, f"{record.name}: {key}"
        unrounded = recompute(record, figure["source"])
        assert figure["value"] == round(unrounded, figure["digits"]), \
            f"{record.name}: {key} is {figure['value']}, its raw files say {unrounded}"
        assert figure["text"] == display(figure, unrounded), \
            f"{record.name}: {key}'s text {figure['text']!r}, its raw files say {display(figure, unrounded)!r}"


def test_recompute_reads_each_kind_of_source(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps({"s": {"rows": [{"k": "x", "v": 2.0}, {"k": "y", "v": 8.0}]}}))
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps({"step": step, "v": step}) for step in (1, 2, 9)))
    (tmp_path / "log.txt").write_text("cache: 744 documents, 6,028,716 tokens\n")
    row = {"file": "a.json", "path": ["s", "rows"], "where": {"k": "y"}, "field": "v"}
    assert recompute(tmp_path, row) == 8.0
    assert recompute(tmp_path, {"file": "m.jsonl", "median": "v"}) == 2.0
    assert recompute(tmp_path, {"file": "log.txt", "regex": r"([\d,]+) tokens"}) == 6_028_716
    assert recompute(tmp_path, {"ratio": [row, {**row, "where": {"k": "x"}}]}) == 4.0
    figure = {"format": "{:.1f}K tokens/s", "scale": 1e-3}
    assert display(figure, 208_624.8) == "208.6K tokens/s"


# ----------------------------------------------------------------------------------------------
# (b) the figures users plan with are the newest users'-command record's


def test_measured_is_the_newest_users_command_record() -> None:
    users = [record for record in RECORDS if "users_command_mfu" in record_json(record)["figures"]]
    newest = max(users, key=lambda record: record.name)
    data = record_json(newest)
    figures = data["figures"]
    measured = run_length.MEASURED
    assert measured.record == newest.name
    assert (measured.mfu, measured.tokens_per_sec) == (figures["users_command_mfu"]["value"],
                                                       figures["users_command_tokens_per_sec"]["value"])
    assert measured.vocab_size == figures["users_command_vocab_size"]["value"] == 16_000
    assert measured.parameters == figures["users_command_parameters"]["value"] == 335_079_424
    assert (measured.device, measured.date, measured.commit) == (data["device"], data["date"], data["commit"])
    assert measured.command == data["conditions"]["users_command"]
    baseline = record_json(RUNS / run_length.BASELINE.record)
    assert run_length.BASELINE.mfu == baseline["figures"]["users_command_mfu"]["value"]


# ----------------------------------------------------------------------------------------------
# (d) results tables quote only their records' figures


def table_rows(text: str) -> list[tuple[int, list[str], list[str]]]:
    """(line number, the table's header cells, the row's line) for every body row of every markdown table."""
    rows, header, fenced = [], None, False
    lines = text.splitlines()
    for number, line in enumerate(lines, start=1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced or not line.lstrip().startswith("|"):
            header = None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif not all(re.fullmatch(r":?-+:?", cell) for cell in cells if cell):
            rows.append((number, header, line))
    return rows


def row_problems(line: str, header: list[str], texts: dict[str, set[str]]) -> list[str]:
    """What is wrong with one table row: a results table's row without a record link, a record that does not
    exist, or a quoted figure that none of the row's records hold."""
    linked = RECORD_LINK.findall(line)
    if not linked:
        return ["a results table's row without a record link"] if "record" in header else []
    missing = [name for name in linked if name not in texts]
    if missing:
        return [f"links {name}, which has no record.json" for name in missing]
    held = set().union(*(texts[name] for name in linked))
    cells = re.sub(r"\]\([^)]*\)", "]", line)  # link targets hold no figures
    return [f"quotes {quoted!r}, which {', '.join(linked)} does not hold"
            for quoted in QUOTED_FIGURE.findall(cells) if quoted not in held]


def record_texts() -> dict[str, set[str]]:
    return {record.name: {figure["text"] for figure in record_json(record)["figures"].values()}
            for record in RECORDS}


@pytest.mark.parametrize("doc", RESULT_DOCS, ids=lambda path: path.name)
def test_results_tables_quote_their_records(doc: Path) -> None:
    texts = record_texts()
    problems = [f"{doc.name}:{number}: {problem}" for number, header, line in table_rows(doc.read_text())
                for problem in row_problems(line, header, texts)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", RESULT_DOCS, ids=lambda path: path.name)
def test_the_results_tables_quote_the_newest_users_command_record(doc: Path) -> None:
    rows = table_rows(doc.read_text())
    linked = {name for _, header, line in rows if "record" in header for name in RECORD_LINK.findall(line)}
    assert run_length.MEASURED.record in linked


def test_row_checks_fail_on_a_figure_the_record_lacks() -> None:
    texts = {"2026-01-01_x_h200": {"43.5%", "208.6K tokens/s"}}
    link = "[r](../benchmarks/runs/2026-01-01_x_h200/)"
    header = ["what", "figure", "record"]
    assert row_problems(f"| users | 43.5%, 208.6K tokens/s at 16 of 256 | {link} |", header, texts) == []
    assert row_problems(f"| users | 43.6% | {link} |", header, texts) == \
        ["quotes '43.6%', which 2026-01-01_x_h200 does not hold"]
    assert row_problems("| users | 43.5% | none |", header, texts) == ["a results table's row without a record link"]
    assert row_problems("| users | 43.5% |", ["what", "figure"], texts) == []  # not a results table
    assert QUOTED_FIGURE.findall("14.6 s, 11.2 GB, 1.30 GiB, 1.21x at 32x, 129.6K tokens/s, 45.5%, 8,192 tokens") == \
        ["14.6 s", "11.2 GB", "1.30 GiB", "1.21x", "129.6K tokens/s", "45.5%"]
