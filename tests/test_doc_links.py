"""Every relative link in README.md, docs/*.md, dev/README.md and the run records' READMEs leads somewhere:
the file exists and, for `path#anchor` or `#anchor`, the target has a heading with that anchor under GitHub's
slug rules. Pure file reading, no rendering."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "dev" / "README.md",
             *sorted((REPO / "benchmarks").rglob("README.md")), REPO / "benchmarks" / "runs" / "TEMPLATE.md"]

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading (github-slugger): the rendered text lower-cased, punctuation and
    symbols dropped (letters, digits, marks, `_`, `-` and spaces kept), spaces turned into `-`."""
    text = INLINE_CODE.sub(lambda match: match.group(2).strip(), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links and images keep their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = re.sub(r"(\*+|(?<!\w)_+|_+(?!\w))", "", text)  # emphasis markers, not snake_case
    kept = (c for c in text.lower() if c in "-_ " or unicodedata.category(c)[0] in "LNM")
    return "".join(kept).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, repeated headings numbered -1, -2 as GitHub does."""
    seen: dict[str, int] = {}
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if match:
            slug = github_slug(match.group(2))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            if count:
                seen.setdefault(f"{slug}-{count}", 1)
    return set(seen)


def relative_links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link that is not an absolute URL."""
    links = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target, flags=re.I):  # http:, https:, mailto:
                links.append((number, target))
    return links


def dead_links(path: Path) -> list[str]:
    problems = []
    for number, target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        destination = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{number}: ({target})"
        if not destination.exists():
            problems.append(f"{where} no such file")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            problems.append(f"{where} no heading with anchor #{anchor} in {destination.name}")
    return problems


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda path: str(path.relative_to(REPO)))
def test_relative_links_resolve(path: Path) -> None:
    assert not dead_links(path), "dead links:\n" + "\n".join(dead_links(path))


def test_the_docs_link_to_each_other() -> None:
    """The check above has something to check: the README links into docs/, with anchors."""
    readme_targets = [target for _, target in relative_links(REPO / "README.md")]
    assert sum(target.startswith("docs/") for target in readme_targets) >= 10
    assert any("#" in target for path in DOCUMENTS for _, target in relative_links(path))


@pytest.mark.parametrize("heading, slug", [
    ("Needle suite (RULER-style, `megatron_lite/eval/needles.py`)", "needle-suite-ruler-style-megatron_liteevalneedlespy"),
    ("`--coca slack|strict`: RoPE → CoCA", "--coca-slackstrict-rope--coca"),
    ("Table 1: sliding-window perplexity on **PG-19**", "table-1-sliding-window-perplexity-on-pg-19"),
    ("4a. DeepSpeed's pdsh launcher (ssh between the containers)", "4a-deepspeeds-pdsh-launcher-ssh-between-the-containers"),
    ("The initial angle Θ_j", "the-initial-angle-θ_j"),
])
def test_github_slug(heading: str, slug: str) -> None:
    assert github_slug(heading) == slug


def test_dead_links_are_found(tmp_path: Path) -> None:
    (tmp_path / "target.md").write_text("# Title\n\n## A section\n\n## A section\n\n```\n# not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](target.md) [ok](target.md#a-section) [ok](target.md#a-section-1) [ok](#here)\n"
                    "# Here\n"
                    "[gone](missing.md) [bad anchor](target.md#not-a-heading) ![img](missing.png)\n"
                    "`[in code](missing.md)` [web](https://example.com/x)\n"
                    "```\n[in a block](missing.md)\n```\n")
    problems = dead_links(page)
    assert len(problems) == 3, problems
    assert "(missing.md) no such file" in problems[0] and "#not-a-heading" in problems[1]
    assert "(missing.png) no such file" in problems[2]


# a test named in the docs, in inline code: `test_name`, `tests/file.py::test_name[case]`, `file.py`: `test_name`
NAMED_TEST = re.compile(r"(?<![\w.])(test_\w+)")


def test_every_test_the_docs_name_exists() -> None:
    """A claim's evidence stays findable: a test renamed or removed without its mention fails here."""
    defined = {name for path in (REPO / "tests").glob("*.py")
               for name in re.findall(r"^\s*(?:async )?def (test_\w+)", path.read_text(), flags=re.M)}
    defined |= {path.stem for path in (REPO / "tests").glob("test_*.py")}  # a file named without its .py
    missing = [f"{path.relative_to(REPO)}:{number}: {name}" for path in DOCUMENTS for number, line in prose_lines(
        path.read_text()) for code in INLINE_CODE.findall(line) for name in NAMED_TEST.findall(code[1])
        if name not in defined]
    assert len(defined) > 500 and not missing, missing
