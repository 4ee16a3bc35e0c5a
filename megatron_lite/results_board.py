"""The results board: one Markdown table row per finished run of tools/gpu_check.py and tools/reproduce.py, so
that runs on later GPUs add rows beside the earlier ones instead of overwriting them. A tool writes its row beside
its outputs, OUT/results_board.md, unless told otherwise: ``--board PATH`` anywhere, ``--repo-board`` the
repository's own board, docs/results.md (rows copied there on purpose, so a user's run leaves the checkout
clean), ``--no-board`` nowhere.

The board holds a short header and two tables, "GPU checks" and "Reproductions". A row goes at the end of
its table; the lines already there are never rewritten (the file is rewritten atomically with one line
inserted), so a board edited by hand is fine as long as both table headers are still present. Rows of
kind ``smoke`` (gpu_check --smoke) and ``dry-run`` (reproduce --dry-run) check the tools at toy size on
CPU: they are marked so that nobody reads them as results.

A row is appended whenever a call finishes its run (gpu_check: every chosen section done; reproduce: the
report written), also when the call only re-read sections or models that OUT already held: its
``this call`` cell says what it measured, so such a row repeats earlier numbers at a later date.
"""

from __future__ import annotations

import argparse
import datetime as dt
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_lite.eval.report import format_ppl
from megatron_lite.files import write_text_atomic
from megatron_lite.model.variants import PAPER_LABELS

REPO = Path(__file__).resolve().parents[1]
REPOSITORY_BOARD = REPO / "docs" / "results.md"  # the repository's board: written only with --repo-board / --board
BOARD_NAME = "results_board.md"  # the default board, OUT/results_board.md beside the tool's outputs
HEADLINE_SCHEME = "coca_slack"  # gpu_check's tokens/s, MFU and peak memory cells: the paper's scheme
PPL_MULTIPLES = (1, 4, 32)  # perplexity at these multiples of a model's training length
MISSING = "–"

GPU_CHECKS, REPRODUCTIONS = "GPU checks", "Reproductions"
COMMON_COLUMNS = ("date", "kind", "device", "commit", "run", "this call")
COLUMNS: dict[str, tuple[str, ...]] = {
    GPU_CHECKS: (*COMMON_COLUMNS, "rows", "tokens/s", "MFU", "peak memory", "train.py tokens/s"),
    REPRODUCTIONS: (*COMMON_COLUMNS, "steps", "length", "tokens/s", "MFU", "peak memory",
                    *(f"{scheme} ppl ×{' / ×'.join(map(str, PPL_MULTIPLES))}" for scheme in PAPER_LABELS)),
}

BOARD_HEADER = f"""# Results board

One row per finished run of `tools/gpu_check.py` ([GPU check](benchmarks.md#gpu-check)) and
`tools/reproduce.py` ([reproduction](reproduction.md)), appended by the tool when the run finishes: by default
to `OUT/results_board.md` beside the run's outputs, to the repository's `docs/results.md` only with `--repo-board`
(or `--board docs/results.md`), to any file with `--board PATH`, nowhere with `--no-board`. Rows are never
rewritten; the newest is last.

- **kind**: `full`, or `smoke` / `dry-run`: the tool checked at toy size on CPU, **not a result**.
- **commit**: the short hash of the code that ran; `+dirty` with uncommitted changes to tracked files
  (this board aside); `unknown` outside a git checkout. **date**: UTC, when the run finished.
- **this call**: what the call measured; a call that only re-read a finished OUT repeats earlier numbers.
- GPU checks: **rows** counts the check's rows by status. **tokens/s**, **MFU** and **peak memory** are
  {HEADLINE_SCHEME}'s: a training step (compiled where measured, else eager) and a forward of the memory
  section's length. **train.py tokens/s**: the short real training run.
- Reproductions: **tokens/s** and **MFU** are the mean over the models' training runs, **peak memory**
  the largest (GPU memory allocated, or the process's resident set on CPU). Each model's perplexity
  without scaling at ×{' / ×'.join(map(str, PPL_MULTIPLES))} its training length (**length**); \
`{MISSING}`: not evaluated.
"""


def table_line(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def new_board_text() -> str:
    tables = [f"## {name}\n\n{table_line(columns)}\n|{'---|' * len(columns)}\n" for name, columns in COLUMNS.items()]
    return BOARD_HEADER + "\n" + "\n".join(tables)


def split_cells(line: str) -> list[str]:
    """The cells of a table line, unescaped pipes kept inside their cell."""
    text = line.strip()
    text = text[1:] if text.startswith("|") else text
    text = text[:-1] if text.endswith("|") and not text.endswith("\\|") else text
    cells, current, escaped = [], "", False
    for char in text:
        if char == "|" and not escaped:
            cells.append(current.strip())
            current = ""
        else:
            current += char
        escaped = char == "\\" and not escaped
    return [*cells, current.strip()]


def _cell_text(value: str) -> str:
    return value.replace("|", "\\|").replace("\n", " ").strip() or MISSING


def _table_span(path: Path, lines: list[str], table: str) -> tuple[int, int]:
    """The indices of ``table``'s first row and of the line after its last (its header and separator found
    by their cells)."""
    columns = list(COLUMNS[table])
    headers = [index for index, line in enumerate(lines)
               if line.lstrip().startswith("|") and split_cells(line) == columns]
    if len(headers) != 1:
        found = "no" if not headers else f"{len(headers)}"
        raise ValueError(f"{path}: {found} '{table}' table header {table_line(columns)!r}; restore it "
                         "(or point --board elsewhere)")
    index = headers[0] + 1
    separator = lines[index].strip() if index < len(lines) else ""
    if not separator.startswith("|") or "-" not in separator or set(separator) - set("|-: "):
        raise ValueError(f"{path}: the '{table}' table header is not followed by its |---| line (line {index + 1})")
    end = index + 1
    while end < len(lines) and lines[end].lstrip().startswith("|"):
        end += 1
    return index + 1, end


def _read_lines(path: Path, keepends: bool) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines(keepends=keepends)
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text (byte {error.start})") from None


def check_board(path: Path) -> None:
    """Raise the one-line ValueError that appending would, before a long run rather than after it."""
    if path.is_dir():
        raise ValueError(f"{path}: a directory, not a board file")
    if not path.exists():
        if not path.parent.is_dir():
            raise ValueError(f"{path}: directory {path.parent} does not exist")
        return
    lines = _read_lines(path, keepends=True)
    for table in COLUMNS:
        _table_span(path, lines, table)


def read_rows(path: Path, table: str) -> list[dict[str, str]]:
    """The rows of ``table`` on the board at ``path``, cells by column name."""
    lines = _read_lines(path, keepends=False)
    start, end = _table_span(path, lines, table)
    return [dict(zip(COLUMNS[table], split_cells(line))) for line in lines[start:end]]


def append_row(path: Path, table: str, row: dict[str, str]) -> str:
    """Insert ``row`` (cells by column name; missing ones ``–``) after ``table``'s last row, creating the
    board if missing; every existing line is kept byte for byte. Returns the row's line."""
    check_board(path)
    unknown = set(row) - set(COLUMNS[table])
    if unknown:
        raise ValueError(f"{table} row: unknown column(s) {', '.join(sorted(unknown))}")
    lines = _read_lines(path, keepends=True) if path.exists() else new_board_text().splitlines(keepends=True)
    _, end = _table_span(path, lines, table)
    if end > 0 and not lines[end - 1].endswith("\n"):
        lines[end - 1] += "\n"  # the table ended the file without a newline
    line = table_line([_cell_text(row.get(column, "")) for column in COLUMNS[table]])
    lines.insert(end, line + "\n")
    write_text_atomic(path, "".join(lines))
    return line


# ----------------------------------------------------------------------------------------------
# What a row says about the run


def utc_date() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%MZ")


def _git(*arguments: str) -> str | None:
    try:
        result = subprocess.run(["git", "-C", str(REPO), *arguments], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def code_commit(board: Path | None = None) -> str:
    """The short hash of the checkout megatron_lite runs from, ``+dirty`` with uncommitted changes to tracked
    files (the board itself not counted); ``unknown`` outside git (e.g. an installed package)."""
    top = _git("rev-parse", "--show-toplevel")
    commit = _git("rev-parse", "--short", "HEAD")
    checkout = REPO.resolve()
    if top is None or commit is None or Path(top).resolve() != checkout:
        return "unknown"
    excluded = []
    if board is not None and board.resolve().is_relative_to(checkout):
        excluded = [f":(exclude){board.resolve().relative_to(checkout)}"]
    changes = _git("status", "--porcelain", "--untracked-files=no", "--", ".", *excluded)
    return commit + ("+dirty" if changes is None or changes else "")


def device_name(cpu: bool = False) -> str:
    """What a run ran on: the CUDA device's name where there is one (as train.py uses it), unless ``cpu``."""
    import torch

    return "cpu" if cpu or not torch.cuda.is_available() else torch.cuda.get_device_name()


def _number(value: float | None, pattern: str) -> str:
    return MISSING if value is None else format(value, pattern)


def _memory(gib: float) -> str:
    return f"{gib:.3g} GiB" if gib >= 1 else f"{gib * 1024:.3g} MiB"


def _mean(values: Sequence[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return sum(present) / len(present) if present else None


def _measured_text(measured: Sequence[str], sections: Sequence[str]) -> str:
    if not measured:
        return "nothing: every section re-read from OUT"
    return "every section" if list(measured) == list(sections) else ", ".join(measured)


def gpu_check_row(results: dict[str, Any], *, smoke: bool, sections: Sequence[str], all_sections: Sequence[str],
                  measured: Sequence[str], device: str) -> dict[str, str]:
    """The GPU-checks cells of a gpu_check results dict (gpu_check.json's shape)."""
    statuses: dict[str, int] = {}
    for section in results.values():
        for row in section["rows"]:
            if "status" in row:
                status = str(row["status"]).split(":")[0]
                statuses[status] = statuses.get(status, 0) + 1
    throughput: dict[tuple[str, str], dict[str, Any]] = {}
    for row in results.get("throughput", {}).get("rows", []):  # the first of a kind: an extra compile mode's is later
        if row.get("status") == "ok":
            throughput.setdefault((row["model"], row["mode"]), row)
    speed = throughput.get((HEADLINE_SCHEME, "compiled")) or throughput.get((HEADLINE_SCHEME, "eager"))
    memory = next((row for row in results.get("memory", {}).get("rows", [])
                   if row["scheme"] == HEADLINE_SCHEME and row.get("status") == "ok"), None)
    train = next(iter(results.get("train", {}).get("rows", [])), {})
    only = "" if list(sections) == list(all_sections) else f" --only {','.join(sections)}"
    return {
        "kind": "smoke" if smoke else "full", "device": device, "run": f"gpu_check{only}",
        "this call": _measured_text(measured, sections),
        "rows": ", ".join(f"{count} {status}" for status, count in sorted(statuses.items())),
        "tokens/s": MISSING if speed is None else f"{speed['tokens_per_sec']:,.0f} ({speed['mode']})",
        "MFU": _number(None if speed is None else speed.get("mfu"), ".1%"),
        "peak memory": MISSING if memory is None else f"{_memory(memory['peak_gib'])} ({memory['tokens']:,} tokens)",
        "train.py tokens/s": _number(train.get("tokens_per_sec") if train.get("status") == "ok" else None, ",.0f"),
    }


def perplexity_at_multiples(results: dict[str, Any], scheme: str) -> list[float | None]:
    """``scheme``'s perplexity without scaling at PPL_MULTIPLES × its training length (None: not evaluated)."""
    length = results.get("models", {}).get(scheme, {}).get("train_length") or results["train_length"]
    by_window = {row["window"]: row["ppl"] for row in results["perplexity"]
                 if row["model"] == scheme and row["scaling"] == "none"}
    return [by_window.get(multiple * length) for multiple in PPL_MULTIPLES]


def reproduction_row(results: dict[str, Any], *, profile: str, dry_run: bool, device: str) -> dict[str, str]:
    """The Reproductions cells of a reproduction results dict (OUT/results.json's shape)."""
    training = results["training"]
    trained = sum(not info["action"].startswith("skipped") for info in training.values())
    peaks = [info["peak_memory_gb"] for info in training.values() if info.get("peak_memory_gb") is not None]
    row = {
        "kind": "dry-run" if dry_run else "full", "device": device, "run": f"reproduce {profile}",
        "this call": f"trained {trained} of {len(training)} models" + ("" if trained else " (all re-read from OUT)"),
        "steps": f"{results['train_iters']:,}", "length": f"{results['train_length']:,}",
        "tokens/s": _number(_mean([info.get("tokens_per_sec") for info in training.values()]), ",.0f"),
        "MFU": _number(_mean([info.get("mfu") for info in training.values()]), ".1%"),
        "peak memory": _memory(max(peaks) * 1e9 / 2**30) if peaks else MISSING,  # train.py logs GB
    }
    for scheme, column in zip(PAPER_LABELS, COLUMNS[REPRODUCTIONS][-len(PAPER_LABELS):]):
        if scheme in training:
            row[column] = " / ".join(format_ppl(ppl) for ppl in perplexity_at_multiples(results, scheme))
    return row


# ----------------------------------------------------------------------------------------------
# The tools' flags


@dataclass(frozen=True)
class Board:
    """Where a tool appends its row, and the commit of the code as the run started."""

    path: Path
    commit: str
    make_parent: bool = False  # the default board: OUT is created by the run, so may not exist when checked

    def append(self, table: str, row: dict[str, str]) -> str:
        if self.make_parent:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        return append_row(self.path, table, {"date": utc_date(), "commit": self.commit, **row})


def add_board_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--board", type=Path, default=None,
                       help=f"results board a finished run appends its row to (default: OUT/{BOARD_NAME}, beside "
                            "the outputs)")
    group.add_argument("--repo-board", action="store_true",
                       help="append the row to this checkout's own board, docs/results.md (same as --board "
                            "docs/results.md)")
    group.add_argument("--no-board", action="store_true", help="append no row to any results board")


def board_path(args: argparse.Namespace) -> Path | None:
    """The board the flags name: --board, the repository's with --repo-board, None with --no-board, else
    OUT/results_board.md."""
    if args.no_board:
        return None
    if args.repo_board:
        return REPOSITORY_BOARD
    return args.board if args.board is not None else args.out / BOARD_NAME


def board_from_args(args: argparse.Namespace) -> Board | None:
    """The board the flags name, checked before the run (None with --no-board)."""
    path = board_path(args)
    if path is None:
        return None
    default = not args.repo_board and args.board is None
    if not (default and not path.parent.exists()):  # the default's OUT is made by the run
        check_board(path)
    return Board(path, code_commit(path), make_parent=default)
