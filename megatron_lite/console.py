"""What a command prints besides its results: console lines, the project's notices, library warnings.

Project code reports something the user should know with ``notice(message)``: a ``Notice`` warning,
so library callers and tests can catch it. A command started through ``megatron_lite.cli.run_cli``
calls ``show_notices()``: each notice then prints once, on rank 0 only, as a console line
``warning: MESSAGE``. Library warnings and DeepSpeed log lines matching ``HARMLESS`` (an explicit
list, each with the reason it does not apply) are dropped; every other warning prints as Python
prints it, on every rank.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TextIO


class Notice(UserWarning):
    """Something the project tells the user (not a library's warning)."""


@dataclass(frozen=True)
class Harmless:
    """A library message known not to apply to this project's runs."""

    source: str  # a warning's module (regex, as ``warnings.filterwarnings``), or a logger's name
    message: str  # regex matched at the start of the message
    reason: str
    logged: bool = False  # a ``logging`` record of the logger ``source`` rather than a warning


HARMLESS: tuple[Harmless, ...] = (
    Harmless("DeepSpeed", r"Setting accelerator to CPU", "training on the CPU is intended where there is no GPU",
             logged=True),
    Harmless("DeepSpeed", r"\**\s*You are using ZeRO with an untested optimizer",
             "the optimizer is torch's AdamW with a skip switch (training/optim.py)", logged=True),
    Harmless(r"torch\.jit\._script", r"`torch\.jit\.script_method` is deprecated",
             "raised while DeepSpeed imports, not by the project's code"),
    Harmless(r"torch\.distributed\.c10d_logger", r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
             "DeepSpeed's ZeRO collectives call it"),
)


def console(message: str) -> None:
    """One line on stdout that does not break a tqdm progress bar."""
    from tqdm import tqdm

    tqdm.write(message, file=sys.stdout)


def notice(message: str, stacklevel: int = 1) -> None:
    """Tell the user ``message`` (a ``Notice``); ``stacklevel`` as in ``warnings.warn``, counted from the caller."""
    warnings.warn(message, Notice, stacklevel=stacklevel + 1)


def is_main_rank() -> bool:
    """Rank 0 of a launch (RANK, set by the launcher before the process starts), or a process without one."""
    return int(os.environ.get("RANK", "0")) == 0


class _LinesDropped:
    """A text stream passing every line to ``stream`` except those matching ``pattern``."""

    def __init__(self, stream: TextIO, pattern: re.Pattern[str]) -> None:
        self.stream, self.pattern, self.pending = stream, pattern, ""

    def write(self, text: str) -> int:
        *lines, self.pending = (self.pending + text).split("\n")
        kept = [line + "\n" for line in lines if not self.pattern.match(line)]
        if kept:
            self.stream.write("".join(kept))
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def close_line(self) -> None:
        if self.pending and not self.pattern.match(self.pending):
            self.stream.write(self.pending)
        self.pending = ""

    def __getattr__(self, name: str) -> object:  # fileno, isatty, encoding, ...: the stream's own
        return getattr(self.stream, name)


@contextmanager
def stdout_without(pattern: str) -> Iterator[None]:
    """While the body runs, lines a library ``print``s to stdout matching ``pattern`` (a regex matched at the
    line's start) are dropped; every other line passes. Python-level writes only (not a subprocess's)."""
    original = sys.stdout
    filtered = _LinesDropped(original, re.compile(pattern))
    sys.stdout = filtered  # type: ignore[assignment]
    try:
        yield
    finally:
        if sys.stdout is filtered:
            sys.stdout = original
        filtered.close_line()


class _HarmlessRecords(logging.Filter):
    def __init__(self, patterns: list[re.Pattern[str]]) -> None:
        super().__init__()
        self.patterns = patterns

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(pattern.match(record.getMessage()) for pattern in self.patterns)


def _show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
          file: TextIO | None = None, line: str | None = None) -> None:
    if issubclass(category, Notice):
        if is_main_rank():
            console(f"warning: {message}")
        return
    (file or sys.stderr).write(warnings.formatwarning(message, category, filename, lineno, line))  # as Python does


def show_notices(harmless: tuple[Harmless, ...] = HARMLESS) -> None:
    """Every warning once per place it is raised, notices as rank-0 console lines, ``harmless`` dropped.

    Call it before DeepSpeed is imported: its logger keeps the filter added here."""
    warnings.simplefilter("default")
    for item in harmless:
        if not item.logged:
            warnings.filterwarnings("ignore", message=item.message, module=item.source)
    by_logger: dict[str, list[re.Pattern[str]]] = {}
    for item in harmless:
        if item.logged:
            by_logger.setdefault(item.source, []).append(re.compile(item.message))
    for name, patterns in by_logger.items():
        logging.getLogger(name).addFilter(_HarmlessRecords(patterns))
    warnings.showwarning = _show
