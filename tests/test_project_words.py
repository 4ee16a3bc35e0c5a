"""The project speaks about what it does, never about how it was made.

Docs, code, comments, configs, tests and file names say what the code or a figure is. Words about the
making of the project (work sessions, numbered tickets, GPU allowances) mean nothing to a user, so this test
fails when they come back. A run record's raw files (logs, traces, JSON under benchmarks/runs/) are kept
byte for byte as their run wrote them and are not read; their README.md files are, and so are the comments of
the command scripts they keep (what a reader reads first; the commands stay as they ran).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# name -> pattern, matched line by line ("_" counts as a boundary, so file names are caught too)
I = re.IGNORECASE
FORBIDDEN = {
    "a work session": re.compile(r"(?<![a-z])sessions?(?![a-z])", I),
    # upstream trackers are cited as "transformers issue #25104"; the project never numbered its work that way
    "a numbered ticket": re.compile(r"(?<![a-z])(issues?|tickets?)[ _]+\d+", I),
    "call A / call B": re.compile(r"(?<![a-z])(calls? [AB](?![a-z])|call_[ab](?![a-z]))"),
    "one call (a GPU job named by its allowance)": re.compile(r"one[_-]call", I),
    "a lease": re.compile(r"(?<![a-z])lease[sd]?(?![a-z])", I),
    "a lent machine": re.compile(r"(?<![a-z])lent(?![a-z])", I),
    "device time (an allowance, not a profiler's figure)": re.compile(
        r"(minutes|seconds|budget|allowance) of device time|device allowance", I),
    "the next GPU run": re.compile(r"next GPU", I),
}
# Uses of these words that are about the product, each allowed by what it names.
ALLOWED_IN_LINE = (
    r"scope\s*=\s*[\"']session[\"']",  # pytest's session-scoped fixtures
    r"pytest_session\w*",  # pytest's session hooks
    r"\bssh sessions?\b",
    r"\bsession (id|cookie|token)s?\b",  # hub/HTTP clients' sessions
    r"requests\.Session",
    r"start_new_session",  # subprocess's process-group flag
)
# Files whose text is not the project's words: shipped evaluation text and this test itself.
SKIPPED_FILES = (
    re.compile(r"^data/eval/.*\.txt$"),
    re.compile(r"^tests/test_project_words\.py$"),
)
TEXT_SUFFIXES = {".py", ".md", ".yml", ".yaml", ".sh", ".txt", ".toml", ".cfg", ".json", ".jsonl", ".sbatch", ""}


def tracked_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=False)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    return [name for name in listed.stdout.decode().split("\0") if name]


def is_raw_record_file(name: str) -> bool:
    return name.startswith("benchmarks/runs/") and Path(name).name not in ("README.md", "TEMPLATE.md")


def findings(name: str, text: str) -> list[str]:
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        cleaned = line
        for allowed in ALLOWED_IN_LINE:
            cleaned = re.sub(allowed, "", cleaned, flags=re.IGNORECASE)
        for what, pattern in FORBIDDEN.items():
            match = pattern.search(cleaned)
            if match:
                found.append(f"{name}:{number}: {what}: {match.group(0)!r} in {line.strip()[:120]!r}")
    return found


def test_no_words_about_how_the_project_was_made_in_text_or_file_names():
    problems = []
    for name in tracked_files():
        problems += [f"{name}: file name: {line}" for line in findings(name, name.replace("/", " "))]
        path = REPO / name
        if any(skip.match(name) for skip in SKIPPED_FILES) or path.suffix not in TEXT_SUFFIXES or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if is_raw_record_file(name):
            if path.suffix != ".sh":
                continue
            # the commands as they ran keep the paths of the time; their comments are read
            text = "\n".join(line if line.lstrip().startswith("#") else "" for line in text.splitlines())
        problems += findings(name, text)
    assert not problems, f"{len(problems)} lines speak of how the project was made:\n" + "\n".join(problems[:60])


@pytest.mark.parametrize("line, bad", [
    ("the sixteenth session measured it", True),
    ("see issue 35", True),
    ("bash call_b.sh", True),
    ("tools/gpu_one_call.sh", True),
    ("the session had 15 minutes of device time", True),
    ("15 minutes of device time", True),
    ("sorted by self device time on CUDA", False),
    ("GPT-NeoX issue #1003", False),
    ("Popen(cmd, start_new_session=True)", False),
    ("a lent GPU", True),
    ('@pytest.fixture(scope="session")', False),
    ("huggingface/transformers#25104 (stale keys)", False),
    ("https://github.com/microsoft/DeepSpeed/issues/4567", False),
    ("calls a function", False),
])
def test_the_patterns_catch_the_making_words_and_leave_the_product_words(line, bad):
    assert bool(findings("x", line)) is bad
