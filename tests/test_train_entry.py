"""The README's main-job entry point (interim CPU demo) runs end to end and reports bad configs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import train  # noqa: E402


def test_main_job_trains_and_saves(tmp_path: Path) -> None:
    code = train.main(["--config", str(REPO / "configs/tiny/coca_slack.yml"), "--steps", "30", "--batch-size", "4",
                       "--set", "model.num_layers=2", "--set", "model.seq_length=64", "--run-dir", str(tmp_path)])
    assert code == 0
    result = json.loads((tmp_path / "demo_result.json").read_text())
    assert result["final_loss"] < 0.6 * result["first_loss"]
    assert result["cache_max_abs_diff"] < 1e-4
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "config.yml").is_file()


def test_bad_config_is_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = train.main(["--config", str(REPO / "configs/tiny/rope.yml"), "--set", "model.posiiton.scheme=alibi",
                       "--run-dir", str(tmp_path)])
    assert code == 2
    assert "did you mean model.position" in capsys.readouterr().err
