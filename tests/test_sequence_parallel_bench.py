"""tools/bench_train.py --sequence-parallel: per-rank peak memory at P=1 and P=2 (real launches of P ranks),
and the mode's one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from script_loading import load_script


@pytest.mark.slow
def test_sequence_parallel_mode_halves_the_per_rank_peak(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cli = load_script("tools/bench_train.py")
    out = tmp_path / "sp.json"
    assert cli.main(["--sequence-parallel", "1,2", "--sequence-length", "512", "--sequence-parallel-steps", "1",
                     "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [row["sequence_parallel_size"] for row in rows] == [1, 2]
    assert all(row["length"] == 512 and row["tokens_per_second"] > 0 for row in rows)
    ratio = rows[1]["peak_bytes_per_rank"] / rows[0]["peak_bytes_per_rank"]
    assert 0.4 < ratio < 0.7, rows  # a rank holds half the tokens' activations (0.56x at 8192 in the docs, 0.59x at 512)
    report = capsys.readouterr().out
    assert "| 2 | " in report and f"{ratio:.2f}x" in report


@pytest.mark.parametrize("argv, message", [
    (["--sequence-parallel", "1,3"], "--sequence-parallel 3: must divide the 8 heads and --sequence-length 8192"),
    (["--sequence-parallel", "two"], "--sequence-parallel 'two': must be sizes like 1,2,4"),
    (["--sequence-parallel", "2", "--sequence-parallel-steps", "0"], "--sequence-parallel-steps 0: must be >= 1"),
])
def test_sequence_parallel_mode_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    cli = load_script("tools/bench_train.py")
    assert cli.main(argv) == 2  # checked before any rank is launched
    captured = capsys.readouterr()
    assert (captured.out + captured.err).strip().splitlines() == [f"error: {message}"]
