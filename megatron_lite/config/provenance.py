"""Where a config value came from, for error messages: the ``--set`` that gave it, or the file of the ``base:``
chain that set it; and the nearest YAML file to a path that does not exist.

``config.load`` prefixes a refused value's message with its source: ``--set train.lr=nan: must be positive``,
``configs/tiny/rope.yml: ...``, ``configs/tiny/coca_slack.yml (a base of configs/tiny/rope.yml): ...``.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from pathlib import Path
from typing import Any

from megatron_lite.config.schema import Config

SET = "--set"
# a dotted config key in a message: model.position.scheme=..., train.stages[0].steps=..., precision=...
_KEY_IN_MESSAGE = re.compile(r"(?<![\w./'\-])((?:%s)(?:\.\w+|\[\d+\])*)" % "|".join(
    field.name for field in dataclasses.fields(Config)))


def missing_file_message(path: Path, what: str) -> str:
    """``{what} {path} does not exist`` (or is a directory), with the nearest YAML file beside it, if any."""
    if path.is_dir():
        inside = sorted(file.name for pattern in ("*.yml", "*.yaml") for file in path.glob(pattern))
        listed = f" (it holds {', '.join(inside[:3])}{', ...' if len(inside) > 3 else ''})" if inside else ""
        return f"{what} {path} is a directory, not a YAML file{listed}"
    siblings = sorted(file.name for pattern in ("*.yml", "*.yaml") for file in path.parent.glob(pattern)) \
        if path.parent.is_dir() else []
    close = difflib.get_close_matches(path.name, siblings, n=1, cutoff=0.6)
    return f"{what} {path} does not exist" + (f"; did you mean {path.parent / close[0]}?" if close else "")


def key_sources(chain: list[tuple[Path, dict[str, Any]]], overrides: list[tuple[str, list[str], Any]]
                ) -> dict[str, str]:
    """Dotted key -> where its value came from: the file of the base ``chain`` (the config first, its bases
    after) that set it last, or ``--set ASSIGNMENT`` for ``overrides`` (assignment as shown, key parts, value),
    applied last. A value that is not a mapping, or any override, replaces what was below its key."""
    sources: dict[str, str] = {}

    def record(key: str, value: Any, source: str, replaces: bool) -> None:
        if replaces or not isinstance(value, dict):
            for below in [name for name in sources if name.startswith(key + ".")]:
                del sources[below]
        sources[key] = source
        if isinstance(value, dict):
            for name, item in value.items():
                record(f"{key}.{name}", item, source, False)

    for file, data in reversed(chain):
        for name, value in data.items():
            record(str(name), value, str(file), False)
    for shown, parts, value in overrides:
        record(".".join(parts), value, f"{SET} {shown}", True)
    return sources


def source_of(message: str, sources: dict[str, str], path: Path) -> str:
    """What to name before a validation ``message``: ``--set KEY=VALUE`` when a key it names was set there (the
    latest change), else the file that set the first key it names whose value was set in a file (noting the
    config it is a base of), else ``path``. Just ``--set`` when the message starts with that very key."""
    named = []
    for match in _KEY_IN_MESSAGE.finditer(message):
        parts = re.sub(r"\[\d+\]", "", match.group(1)).split(".")
        found = (sources.get(".".join(parts[:length])) for length in range(len(parts), 0, -1))
        named.append(next((source for source in found if source is not None), None))
    override = next((source for source in named if source is not None and source.startswith(f"{SET} ")), None)
    if override is not None:
        key = override[len(SET) + 1:].split("=", 1)[0].strip()
        return SET if message.startswith(f"{key}=") else override
    file = next((source for source in named if source is not None), str(path))
    return file if file == str(path) else f"{file} (a base of {path})"


def with_source(message: str, source: str) -> str:
    """``SOURCE: MESSAGE``, or ``--set MESSAGE`` when the message starts with the override's own ``KEY=VALUE``."""
    return f"{SET} {message}" if source == SET else f"{source}: {message}"
