"""The results board (megatron_lite/results_board.py): rows appended to a tmp_path board, never rewritten;
the header made once; smoke / dry-run rows marked; perplexity at 1x / 4x / 32x of each model's training
length; a malformed board is one ValueError line naming the file; the commit stamp; the tools' flags.
The tools' real runs append their rows in tests/test_gpu_check.py, test_reproduce.py and test_speedrun.py."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from megatron_lite import results_board as board_lib
from megatron_lite.bench.gpu_check_settings import SECTIONS
from megatron_lite.repro import SCHEMES
from script_loading import REPO, load_script

GPU, REPRO = board_lib.GPU_CHECKS, board_lib.REPRODUCTIONS


def cells(line: str, table: str) -> dict[str, str]:
    return dict(zip(board_lib.COLUMNS[table], board_lib.split_cells(line)))


def gpu_results() -> dict[str, Any]:
    """gpu_check.json's shape, as a --smoke run writes it (a few rows per section)."""
    def section(rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {"rows": rows, "seconds": 1.0, "finished": "2025-01-01T00:00:00+00:00"}

    return {
        "env": section([{"item": "device", "value": "cpu (no CUDA)"}]),
        "parity": section([{"scheme": "rope", "backend": "sdpa", "status": "ok"},
                           {"scheme": "rope", "backend": "flash", "status": "unavailable: flash needs CUDA"}]),
        "throughput": section([{"model": "coca_slack", "mode": "eager", "status": "ok", "tokens_per_sec": 12345.6,
                                "mfu": None},
                               {"model": "coca_slack", "mode": "compiled", "status": "skipped: --smoke"}]),
        "memory": section([{"scheme": "rope", "backend": "sdpa", "tokens": 1024, "status": "ok", "peak_gib": 0.5},
                           {"scheme": "coca_slack", "backend": "sdpa", "tokens": 1024, "status": "ok",
                            "peak_gib": 0.0123}]),
        "train": section([{"status": "ok", "tokens_per_sec": 2222.2}]),
        "sync": section([{"scheme": "rope", "mode": "eager", "status": "skipped: no CUDA"}]),
    }


def repro_results(dry_run: bool = False) -> dict[str, Any]:
    """OUT/results.json's shape: RoPE trained on 32 tokens, CoCA slack on 64, evaluated at 32 ... 1024."""
    lengths = {"alibi": 32, "rope": 32, "coca_slack": 64, "coca_strict": 32}
    perplexity = [{"model": scheme, "scaling": scaling, "window": window, "ppl": float(window) + offset}
                  for scheme, offset in (("rope", 0.5), ("coca_slack", 0.25))
                  for scaling in ("none", "dynamic:2") for window in (32, 64, 128, 256, 1024)]
    perplexity.append({"model": "rope", "scaling": "none", "window": 2048, "ppl": float("inf")})
    training = {scheme: {"action": "trained", "tokens_per_sec": rate, "mfu": mfu, "peak_memory_gb": memory}
                for scheme, rate, mfu, memory in (("rope", 1000.0, 0.25, 1.5), ("coca_slack", 3000.0, 0.35, 2.5))}
    return {"settings": {"dry_run": dry_run}, "train_length": 32, "train_iters": 1000, "training": training,
            "models": {scheme: {"train_length": lengths[scheme]} for scheme in training},
            "perplexity": perplexity, "passkey": []}


def test_rows_are_appended_and_never_rewritten(tmp_path: Path) -> None:
    path = tmp_path / "results.md"
    board = board_lib.Board(path, commit="abc1234")
    first = board.append(GPU, board_lib.gpu_check_row(gpu_results(), smoke=True, sections=SECTIONS,
                                                      all_sections=SECTIONS, measured=SECTIONS, device="cpu"))
    once = path.read_text()
    assert once.startswith(board_lib.BOARD_HEADER) and once.count("# Results board") == 1
    assert board_lib.read_rows(path, GPU) == [cells(first, GPU)] and board_lib.read_rows(path, REPRO) == []

    second = board.append(GPU, board_lib.gpu_check_row(gpu_results(), smoke=False, sections=["env"],
                                                       all_sections=SECTIONS, measured=[], device="NVIDIA H100"))
    twice = path.read_text()
    assert board_lib.read_rows(path, GPU) == [cells(first, GPU), cells(second, GPU)]
    assert twice.replace(second + "\n", "", 1) == once  # the first run's bytes, untouched
    third = board.append(REPRO, board_lib.reproduction_row(repro_results(), profile="cpu-tiny", dry_run=False,
                                                           device="cpu"))
    thrice = path.read_text()
    assert thrice.replace(third + "\n", "", 1) == twice and board_lib.read_rows(path, REPRO) == [cells(third, REPRO)]
    assert thrice.count("## GPU checks") == thrice.count("## Reproductions") == 1

    row = cells(first, GPU)
    assert row["commit"] == "abc1234" and row["date"].endswith("Z") and row["run"] == "gpu_check"
    assert row["this call"] == "every section" and row["rows"] == "5 ok, 2 skipped, 1 unavailable"
    assert row["tokens/s"] == "12,346 (eager)" and row["MFU"] == "–" and row["train.py tokens/s"] == "2,222"
    assert row["peak memory"] == "12.6 MiB (1,024 tokens)"  # coca_slack's, not the largest
    row = cells(second, GPU)
    assert row["run"] == "gpu_check --only env" and row["this call"].startswith("nothing")


def test_smoke_and_dry_run_rows_are_marked() -> None:
    def kind(smoke: bool) -> str:
        return board_lib.gpu_check_row(gpu_results(), smoke=smoke, sections=SECTIONS, all_sections=SECTIONS,
                                       measured=SECTIONS, device="cpu")["kind"]

    assert (kind(True), kind(False)) == ("smoke", "full")
    for dry_run, expected in ((True, "dry-run"), (False, "full")):
        row = board_lib.reproduction_row(repro_results(dry_run), profile="gpu-speedrun", dry_run=dry_run, device="cpu")
        assert row["kind"] == expected and row["run"] == "reproduce gpu-speedrun"


def test_perplexity_at_one_four_and_thirty_two_times_each_training_length(tmp_path: Path) -> None:
    results = repro_results()
    assert board_lib.perplexity_at_multiples(results, "rope") == [32.5, 128.5, 1024.5]  # length 32, no dynamic NTK
    assert board_lib.perplexity_at_multiples(results, "coca_slack") == [64.25, 256.25, None]  # length 64: 2048 absent
    row = board_lib.reproduction_row(results, profile="cpu-tiny", dry_run=False, device="cpu")
    columns = dict(zip(SCHEMES, board_lib.COLUMNS[REPRO][-len(SCHEMES):]))
    assert row[columns["rope"]] == "32.50 / 128.5 / 1,024" and row[columns["coca_slack"]] == "64.25 / 256.2 / –"
    assert columns["alibi"] not in row  # not trained in this run: the cell is –
    assert (row["tokens/s"], row["MFU"], row["peak memory"]) == ("2,000", "30.0%", "2.33 GiB")  # 2.5 GB
    assert (row["steps"], row["length"], row["this call"]) == ("1,000", "32", "trained 2 of 2 models")
    line = board_lib.append_row(tmp_path / "results.md", REPRO, {"date": "d", "commit": "c", **row})
    assert cells(line, REPRO)[columns["alibi"]] == "–"


def test_a_hand_edited_board_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "results.md"
    text = board_lib.new_board_text().replace("# Results board", "# Results board\n\nNotes by hand.")
    text = text.replace(board_lib.table_line(board_lib.COLUMNS[GPU]),
                        "|date|kind| device |commit|run|this call|rows|tokens/s|MFU|peak memory|train.py tokens/s|")
    text = text.rstrip("\n") + "\n| by hand | full | x |"  # the file ends in a row without a newline
    path.write_text(text)
    line = board_lib.append_row(path, REPRO, {"kind": "dry-run"})
    assert path.read_text() == text + "\n" + line + "\n"
    line = board_lib.append_row(path, GPU, {"kind": "smoke", "run": "a | b"})
    assert "a \\| b" in line and board_lib.split_cells(line)[4] == "a \\| b" and line in path.read_text()


@pytest.mark.parametrize("damage", ["no header", "two headers", "no separator"])
def test_a_malformed_board_is_one_line_naming_the_file(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "results.md"
    header = board_lib.table_line(board_lib.COLUMNS[REPRO])
    text = board_lib.new_board_text()
    text = {"no header": text.replace(header, "| date | kind |"),
            "two headers": text + "\n" + header + "\n|---|\n",
            "no separator": text.replace(header + "\n|", header + "\n\n|")}[damage]
    path.write_text(text)
    with pytest.raises(ValueError) as error:
        board_lib.append_row(path, GPU, {"kind": "smoke"})
    assert str(path) in str(error.value) and "\n" not in str(error.value)
    assert path.read_text() == text
    with pytest.raises(ValueError, match="does not exist"):
        board_lib.check_board(tmp_path / "missing" / "results.md")
    path.write_bytes(b"# \xff\n")
    with pytest.raises(ValueError, match="not UTF-8"):
        board_lib.check_board(path)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_commit_is_the_checkouts_with_dirty_and_unknown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(board_lib, "REPO", tmp_path)
    assert board_lib.code_commit() == "unknown"  # not a git checkout

    def git(*arguments: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *arguments],
                              check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "docs").mkdir()
    (tmp_path / "code.py").write_text("a = 1\n")
    board = tmp_path / "docs" / "results.md"
    board.write_text(board_lib.new_board_text())
    git("add", "-A")
    git("commit", "-q", "-m", "first")
    commit = git("rev-parse", "--short", "HEAD")
    (tmp_path / "untracked.txt").write_text("not code that ran\n")
    board.write_text(board.read_text() + "| a row |\n")
    assert board_lib.code_commit(board) == commit  # the board's own rows and untracked files do not count
    (tmp_path / "code.py").write_text("a = 2\n")
    assert board_lib.code_commit(board) == commit + "+dirty"


def test_gpu_check_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The row goes beside the outputs (OUT/results_board.md) by default, to the repository's docs/results.md only
    with --repo-board, to --board PATH, nowhere with --no-board; the three exclude each other."""
    gpu_check = load_script("tools/gpu_check.py")
    repository = tmp_path / "repository.md"
    monkeypatch.setattr(board_lib, "REPOSITORY_BOARD", repository)  # this checkout's docs/results.md stays clean
    out = tmp_path / "a"

    assert gpu_check.main(["--smoke", "--only", "env", "--out", str(out), "--no-board"]) == 0
    assert not (out / board_lib.BOARD_NAME).exists() and not repository.exists()
    assert gpu_check.main(["--smoke", "--only", "env", "--out", str(out)]) == 0
    (row,) = board_lib.read_rows(out / board_lib.BOARD_NAME, GPU)
    assert row["run"] == "gpu_check --only env" and row["this call"].startswith("nothing")
    assert not repository.exists()
    assert gpu_check.main(["--smoke", "--only", "env", "--out", str(out), "--repo-board"]) == 0
    assert len(board_lib.read_rows(repository, GPU)) == 1 and len(board_lib.read_rows(out / board_lib.BOARD_NAME, GPU)) == 1
    elsewhere = tmp_path / "elsewhere.md"
    assert gpu_check.main(["--smoke", "--only", "env", "--out", str(tmp_path / "b"), "--board", str(elsewhere)]) == 0
    (row,) = board_lib.read_rows(elsewhere, GPU)
    assert row["kind"] == "smoke" and row["this call"] == "every section"
    assert not (tmp_path / "b" / board_lib.BOARD_NAME).exists()
    for clash in (["--no-board"], ["--repo-board"]):
        with pytest.raises(SystemExit):
            gpu_check.main(["--smoke", "--out", str(tmp_path / "c"), "--board", str(elsewhere), *clash])


def test_reproduce_board_defaults_beside_its_outputs() -> None:
    """reproduce: the same flags; its paper-350m budget still reads measured MFUs from the repository's board."""
    reproduce = load_script("tools/reproduce.py")
    args = reproduce.parse_args(["--out", "o"])
    assert board_lib.board_path(args) == Path("o") / board_lib.BOARD_NAME
    assert reproduce.mfu_board(args) == board_lib.REPOSITORY_BOARD
    args = reproduce.parse_args(["--out", "o", "--repo-board"])
    assert board_lib.board_path(args) == board_lib.REPOSITORY_BOARD == reproduce.mfu_board(args)
    args = reproduce.parse_args(["--out", "o", "--board", "b.md"])
    assert board_lib.board_path(args) == Path("b.md") == reproduce.mfu_board(args)
    args = reproduce.parse_args(["--out", "o", "--no-board"])
    assert board_lib.board_path(args) is None and reproduce.mfu_board(args) is None


def test_a_malformed_board_stops_a_tool_before_it_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken.md"
    broken.write_text("# a board without its tables\n")
    out = tmp_path / "out"
    assert load_script("tools/gpu_check.py").main(["--smoke", "--out", str(out), "--board", str(broken)]) == 2
    assert not out.exists() and str(broken) in capsys.readouterr().err
    reproduce = load_script("tools/reproduce.py")
    books = str(REPO / "data/eval")
    assert reproduce.main(["--books", books, "--eval-books", books, "--out", str(out), "--board", str(broken),
                           "--quiet"]) == 2
    assert not out.exists() and str(broken) in capsys.readouterr().err
    assert reproduce.parse_args(["--out", "o", "--no-board"]).no_board
