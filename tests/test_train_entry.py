"""The README's main job (`python train.py --config configs/tiny/coca_slack.yml`) on a fresh data
cache: builds the offline sample corpus, tokenizer and shards, trains, evaluates, saves; the loss falls."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_lite import checkpoint_dirs
from megatron_lite import config as config_lib
from megatron_lite.data.loader import data_report
from megatron_lite.data.manifest import load_manifest
from training_helpers import REPO, metrics, run_train, train_losses

pytestmark = pytest.mark.slow  # multi-rank or end-to-end runs of train.py


def test_main_job_builds_data_trains_and_saves(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_train(REPO / "configs/tiny/coca_slack.yml", run_dir, "--train-iters", "30",
                       "--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "train.wandb.mode=disabled",
                       "--set", "train.log_interval=5", "--set", "train.eval_interval=30")
    assert "python_docs" in result.stdout and "python_stdlib" in result.stdout  # the sample corpus was built
    losses = train_losses(run_dir)
    assert losses[30] < 0.8 * losses[1]
    assert any("val_loss" in row for row in metrics(run_dir))
    assert checkpoint_dirs.latest_complete(run_dir / checkpoint_dirs.CHECKPOINTS_DIR).name == "step_00000030"
    assert "done: completed at step 30/30" in result.stdout and str(run_dir / "metrics.jsonl") in result.stdout

    # The sample corpus the main job built mixes exactly 75/25 by tokens (what inspect_data.py prints).
    config = config_lib.load(REPO / "configs/tiny/coca_slack.yml", [f"data.cache_dir={tmp_path / 'cache'}"])
    manifest = load_manifest(config.data.cache_dir)
    for num_samples in (1000, 10_000):
        share = data_report(config.data, config.model.seq_length, manifest, num_samples)["group_token_share"]
        assert abs(share["text"] - 0.75) <= 0.005 and abs(share["code"] - 0.25) <= 0.005, (num_samples, share)


def test_bad_config_is_one_line_error(tmp_path: Path) -> None:
    result = run_train(REPO / "configs/tiny/rope.yml", tmp_path, "--set", "model.posiiton.scheme=alibi", check=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error:")
    assert "did you mean model.position" in result.stderr
