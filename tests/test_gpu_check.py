"""tools/gpu_check.py --smoke: every section on the tiny config on the CPU, written to JSON and markdown as it
finishes; a re-run skips finished sections; --only picks sections; no CUDA without --smoke is one error line."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from megatron_lite import results_board
from megatron_lite.bench import gpu_check
from megatron_lite.cli import EXIT_USER_ERROR
from script_loading import REPO, load_script


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    """(out dir, seconds) of one whole --smoke run; its results board is OUT/board.md."""
    out = tmp_path_factory.mktemp("gpu_check")
    start = time.perf_counter()
    assert load_script("tools/gpu_check.py").main(["--smoke", "--out", str(out), "--board", str(out / "board.md")]) == 0
    return out, time.perf_counter() - start


@pytest.mark.slow
def test_smoke_writes_every_section(smoke_run: tuple[Path, float]) -> None:
    out, _ = smoke_run
    results = json.loads((out / "gpu_check.json").read_text())
    assert list(results) == list(gpu_check.SECTIONS)
    markdown = (out / "gpu_check.md").read_text()
    assert f"torch {torch.__version__}" in markdown
    for name, section in results.items():
        assert section["rows"] and section["seconds"] >= 0 and section["finished"], name
        assert f"## {name}" in markdown
    env = {row["item"]: row["value"] for row in results["env"]["rows"]}
    assert env["torch"] == torch.__version__ and env["flash-attn"]  # a version or "missing", never a crash

    parity = {(row["scheme"], row["backend"]): row for row in results["parity"]["rows"]}
    assert {scheme for scheme, _ in parity} == set(gpu_check.SCHEMES)
    for scheme in gpu_check.SCHEMES:
        row = parity[(scheme, "sdpa")]
        assert row["status"] == "ok" and row["rel_error"] < 0.05 and row["max_abs_error"] < 0.2, row
        assert set(gpu_check.PARITY_BACKENDS) == {backend for s, backend in parity if s == scheme}
    if not torch.cuda.is_available():  # flash needs CUDA: a row saying why
        assert parity[("rope", "flash")]["status"].startswith("unavailable: ")

    throughput = results["throughput"]["rows"]
    eager = [row for row in throughput if row["mode"] == "eager"]
    assert len(eager) == len(gpu_check.SCHEMES) + 1  # + the Hugging Face twin
    assert all(row["status"] == "ok" and row["tokens_per_sec"] > 0 and row["micro_batch"] == 2 for row in eager)

    memory = [row for row in results["memory"]["rows"] if row["status"] == "ok"]
    assert {row["scheme"] for row in memory} == set(gpu_check.SCHEMES) and all(row["peak_gib"] > 0 for row in memory)
    assert [row["backend"] for row in memory if row["scheme"] == "alibi"] in (["chunked"], ["flash"])

    (train,) = results["train"]["rows"]
    assert train["status"] == "ok" and train["loss_last"] < train["loss_first"] and train["tokens_per_sec"] > 0
    assert all(row["status"] == "skipped: no CUDA" for row in results["sync"]["rows"]) or torch.cuda.is_available()

    (row,) = results_board.read_rows(out / "board.md", results_board.GPU_CHECKS)  # the finished run's row
    assert (row["kind"], row["device"], row["run"], row["this call"]) == ("smoke", "cpu", "gpu_check", "every section")
    assert row["tokens/s"].endswith("(eager)") and row["peak memory"].endswith("iB (1,024 tokens)")
    assert row["MFU"] == "–" and row["train.py tokens/s"] != "–" and "failed" not in row["rows"]


def test_rerun_skips_finished_sections(smoke_run: tuple[Path, float], capsys: pytest.CaptureFixture[str]) -> None:
    out, first_seconds = smoke_run
    before = json.loads((out / "gpu_check.json").read_text())
    (row_before,) = results_board.read_rows(out / "board.md", results_board.GPU_CHECKS)
    capsys.readouterr()
    start = time.perf_counter()
    assert load_script("tools/gpu_check.py").main(["--smoke", "--out", str(out), "--board", str(out / "board.md")]) == 0
    assert time.perf_counter() - start < min(5.0, first_seconds / 2)
    err = capsys.readouterr().err
    assert all(f"{name}: already finished" in err for name in gpu_check.SECTIONS), err
    assert json.loads((out / "gpu_check.json").read_text()) == before
    # the re-run finished too: a second row, saying it measured nothing; the first row kept
    first, second = results_board.read_rows(out / "board.md", results_board.GPU_CHECKS)
    assert first == row_before and second["tokens/s"] == first["tokens/s"]
    assert second["this call"] == "nothing: every section re-read from OUT"


def test_only_env(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert load_script("tools/gpu_check.py").main(["--smoke", "--only", "env", "--out", str(tmp_path),
                                                   "--no-board"]) == 0
    assert list(json.loads((tmp_path / "gpu_check.json").read_text())) == ["env"]
    assert "## env" in (tmp_path / "gpu_check.md").read_text() and "## parity" not in (tmp_path / "gpu_check.md").read_text()
    err = capsys.readouterr().err
    assert "env: start" in err and "env: finished" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without CUDA")
def test_without_cuda_and_smoke_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    assert load_script("tools/gpu_check.py").main(["--out", str(tmp_path)]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err == f"error: {gpu_check.NO_CUDA_MESSAGE}\n"
    assert not (tmp_path / "gpu_check.json").exists()


def test_sections_and_batch_search() -> None:
    assert gpu_check.parse_sections(None) == list(gpu_check.SECTIONS)
    assert gpu_check.parse_sections("sync, env") == ["env", "sync"]  # run in the fixed order
    with pytest.raises(ValueError, match="nonsense"):
        gpu_check.parse_sections("env,nonsense")
    config = gpu_check.parity_config(True, "rope", "sdpa", "fp32")
    device = torch.device("cpu")
    assert gpu_check.largest_batch(config, False, device, 64, fits=lambda batch: batch <= 8) == 8
    assert gpu_check.largest_batch(config, False, device, 64, fits=lambda batch: True) == 64
    assert gpu_check.largest_batch(config, False, device, 64, fits=lambda batch: False) == 0
    assert gpu_check.long_context_backends("alibi", flash=True, flex=False) == ["flash"]
    assert gpu_check.long_context_backends("alibi", flash=False, flex=True) == ["chunked", "flex"]
    assert gpu_check.long_context_backends("rope", flash=True, flex=False) == ["sdpa"]
