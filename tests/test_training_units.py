"""In-process pieces of the training loop: resume compatibility notices, the run's identity (model and
tokenizer), wandb fallback and run id, the loss every report shows, FLOPs, data loaders' own RNG."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megatron_lite import config as config_lib
from megatron_lite.console import Notice
from megatron_lite.model.params import analytic_parameter_count
from megatron_lite.data.loader import sample_loader
from megatron_lite.training import rng
from megatron_lite.training.checkpointing import check_resume_compatible
from megatron_lite.training.identity import tokenizer_change
from megatron_lite.training.metrics import (WANDB_ID_FILE, LossWindow, MetricsLogger, drop_rows_after, loss_summary,
                                            model_flops_per_token, plot_loss_curve, read_metrics, wandb_run_id)


def _saved_step_dir(tmp_path: Path, overrides: list[str]) -> Path:
    step_dir = tmp_path / "checkpoints" / "step_00000010"
    step_dir.mkdir(parents=True)
    config_lib.save(config_lib.load("configs/tiny/rope.yml", overrides), step_dir / "config.yml")
    return step_dir


def test_schedule_changes_on_resume_warn(tmp_path: Path) -> None:
    step_dir = _saved_step_dir(tmp_path, [])
    changed = config_lib.load("configs/tiny/rope.yml", ["train.lr=5.0e-4", "train.train_iters=900"])
    with pytest.warns(Notice) as caught:  # the project's notice (printed once, on rank 0, by the CLIs)
        check_resume_compatible(step_dir, changed)
    messages = " ".join(str(w.message) for w in caught)
    assert "train.lr changed from 0.002 to 0.0005" in messages and "train.train_iters changed from 300 to 900" in messages


def test_shape_change_on_resume_is_refused(tmp_path: Path) -> None:
    step_dir = _saved_step_dir(tmp_path, [])
    with pytest.raises(ValueError, match=r"layers\.4\.attention\.query_key_value\.weight: checkpoint None"):
        check_resume_compatible(step_dir, config_lib.load("configs/tiny/rope.yml", ["model.num_layers=5"]))


@pytest.mark.parametrize("overrides, expected", [
    (["model.position.scheme=coca"], "model.position.scheme: checkpoint 'rope', config 'coca'"),
    (["model.architecture=llama"], "model.architecture: checkpoint 'gpt_neox', config 'llama'"),
    (["model.position.rotary_emb_base=500000"], "model.position.rotary_emb_base: checkpoint 10000.0, config 500000.0"),
])
def test_identity_change_on_resume_is_one_short_line(tmp_path: Path, overrides: list[str], expected: str) -> None:
    step_dir = _saved_step_dir(tmp_path, [])
    with pytest.raises(ValueError) as refused:
        check_resume_compatible(step_dir, config_lib.load("configs/tiny/rope.yml", overrides))
    message = str(refused.value)
    assert expected in message and "\n" not in message and len(message) < 200, message


def test_inference_scaling_change_on_resume_is_a_short_notice(tmp_path: Path) -> None:
    step_dir = _saved_step_dir(tmp_path, [])
    with pytest.warns(Notice) as caught:
        check_resume_compatible(step_dir, config_lib.load("configs/tiny/rope.yml", ["model.position.scaling.type=yarn"]))
    assert [str(w.message) for w in caught] == ["resuming with model.position.scaling.type changed from 'none' to 'yarn'"]


def test_another_tokenizer_is_refused_naming_both_files_unless_allowed(tmp_path: Path) -> None:
    checkpoint, run = tmp_path / "step_00000010", tmp_path / "cache"
    checkpoint.mkdir()
    run.mkdir()
    (checkpoint / "tokenizer.model").write_bytes(b"pieces of the checkpoint")
    (run / "tokenizer.model").write_bytes(b"pieces of the run")
    with pytest.raises(ValueError) as refused:
        tokenizer_change(checkpoint, run / "tokenizer.model", allowed=False, what=f"cannot resume from {checkpoint}")
    message = str(refused.value)
    assert str(checkpoint / "tokenizer.model") in message and str(run / "tokenizer.model") in message
    assert "train.allow_tokenizer_change=true" in message and "\n" not in message
    change = tokenizer_change(checkpoint, run / "tokenizer.model", allowed=True, what="")
    assert change is not None and change.metrics_row(10)["tokenizer_change"]["run"] == str(run / "tokenizer.model")
    (run / "tokenizer.model").write_bytes(b"pieces of the checkpoint")
    assert tokenizer_change(checkpoint, run / "tokenizer.model", allowed=False, what="") is None
    assert tokenizer_change(tmp_path, run / "tokenizer.model", allowed=False, what="") is None  # carries none


def test_rng_state_round_trips_every_generator(tmp_path: Path) -> None:
    import random

    import numpy as np
    import torch

    from megatron_lite.checkpoint_integrity import safe_load

    device = torch.device("cpu")
    torch.save(rng.capture(device), tmp_path / "rng.pt")
    expected = (torch.rand(3), np.random.rand(3), random.random())
    rng.restore(safe_load(tmp_path / "rng.pt"), device)  # weights_only: plain tensors, ints and lists
    drawn = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(drawn[0], expected[0]) and np.array_equal(drawn[1], expected[1]) and drawn[2] == expected[2]


def test_iterating_a_loader_leaves_the_global_generator_alone() -> None:
    import torch

    loader = sample_loader(list(range(8)), 2, seed=11, rank=0, purpose="valid")
    before = torch.get_rng_state()
    assert [batch.tolist() for batch in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    next(iter(loader))
    assert torch.equal(torch.get_rng_state(), before)


def test_rows_logged_after_the_resumed_step_are_dropped(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    assert drop_rows_after(path, 5) == 0 and not path.exists()  # no file yet: nothing to do, nothing created
    rows = [f'{{"step": {step}, "loss": {10 - step}}}\n' for step in range(1, 9)] + ['{"step": 4, "val_loss": 3}\n']
    path.write_text("".join(rows))
    assert drop_rows_after(path, 8) == 0
    assert drop_rows_after(path, 4) == 4
    assert [(row["step"], "val_loss" in row) for row in read_metrics(path)] == [(1, False), (2, False), (3, False),
                                                                               (4, False), (4, True)]
    assert drop_rows_after(path, 0) == 5 and read_metrics(path) == []  # a fresh start: the old attempt is gone


def test_a_cut_off_metrics_row_is_dropped_and_a_bad_middle_row_named(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.5}\n{"step": 3, "lo')  # a write cut off
    assert [row["step"] for row in read_metrics(path)] == [1, 2]
    with pytest.warns(Notice, match="dropped its cut-off last line"):
        assert drop_rows_after(path, 2) == 0
    assert path.read_text() == '{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.5}\n'
    path.write_text('{"step": 1, "loss": 3.0}\n{"step": 2,\n{"step": 3, "loss": 2.5}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not a JSON row"):
        read_metrics(path)


def test_wandb_online_without_key_falls_back_to_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    config = config_lib.load("configs/tiny/rope.yml", ["train.wandb.mode=online", "train.wandb.project=unit"])
    with pytest.warns(UserWarning, match="logging offline instead"):
        logger = MetricsLogger(config, tmp_path, enabled=True)
    try:
        assert logger._wandb is not None and logger._wandb.settings.mode == "offline"
        logger.log({"step": 1, "loss": 2.0, "lr": 1e-3})
    finally:
        logger.close()
    assert (tmp_path / "wandb").is_dir()
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1
    assert plot_loss_curve(tmp_path / "metrics.jsonl", tmp_path / "curve.png", "unit") == tmp_path / "curve.png"


def test_a_resume_continues_the_wandb_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = config_lib.load("configs/tiny/rope.yml", ["train.wandb.mode=offline", "train.wandb.project=unit"])
    for start_step in (0, 4):  # a fresh start, then a resume from step 4
        logger = MetricsLogger(config, tmp_path, enabled=True, start_step=start_step)
        logger.log({"step": start_step + 1, "loss": 2.0})
        logger.close()
    run_id = (tmp_path / WANDB_ID_FILE).read_text().strip()
    runs = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    # wandb's dir names carry the run id (plus "-1" when both starts fall in the same second)
    assert len(runs) == 2 and all(f"-{run_id}" in name for name in runs), runs
    assert wandb_run_id(tmp_path, resuming=True) == run_id
    assert wandb_run_id(tmp_path, resuming=False) != run_id  # a fresh start (--resume none) is a new wandb run


def test_every_report_shows_the_mean_loss_of_the_last_log_interval_steps() -> None:
    window = LossWindow(3)
    assert window.mean(0) is None
    for step, loss in ((1, 6.0), (2, 5.0), (3, 4.0), (4, 3.0)):
        window.add(step, loss)
    assert window.mean(4) == pytest.approx(4.0)  # steps 2-4
    assert window.mean(6) == pytest.approx(3.0)  # steps 5 and 6 skipped (non-finite): only step 4 is in the window
    assert window.mean(7) is None
    rows = [{"step": 1, "loss": 6.0}, {"step": 4, "val_loss": 3.5}, {"step": 4, "loss": 4.0}, {"step": 5, "loss": None}]
    assert loss_summary(rows) == "loss 6.0000 (step 1) -> 4.0000 (step 4); validation loss 3.5000 (step 4)"
    assert loss_summary(rows[:2]) == "loss 6.0000 (step 1); validation loss 3.5000 (step 4)"
    assert loss_summary([]) == "loss n/a; validation loss n/a"


def test_flops_per_token_follows_the_palm_convention() -> None:
    model = config_lib.load("configs/coca_350m.yml").model
    matmul_params = analytic_parameter_count(model) - model.padded_vocab_size * model.hidden_size
    assert model_flops_per_token(model) == 6 * matmul_params + 12 * 24 * 1024 * 512


def test_validation_loss_is_the_same_on_any_world_size() -> None:
    """One fixed validation set scored by 1, 2, 3 or 5 ranks (5: padded shares) gives one number: the
    per-token mean, which on one rank is today's mean of eval_iters micro-batch losses."""
    import torch
    from torch.utils.data import DataLoader

    from megatron_lite.data.loader import ValidationShare
    from megatron_lite.model import build_model
    from megatron_lite.training.step import local_validation_sums

    config = config_lib.from_dict({"model": {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2,
                                             "seq_length": 16, "vocab_size": 64}})
    model = build_model(config).double().eval()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (12, 17), generator=generator)  # 12 samples = eval_iters 3 x micro 4
    samples = [{"input_ids": t[:-1], "labels": t[1:], "index": k} for k, t in enumerate(tokens)]
    micro = 4

    def val_loss(world_size: int) -> float:
        sums = [local_validation_sums(model, DataLoader(ValidationShare(samples, rank, world_size), batch_size=micro),
                                      torch.device("cpu")) for rank in range(world_size)]
        return sum(weighted for weighted, _ in sums) / sum(count for _, count in sums)

    with torch.no_grad():
        batch_means = [float(model(tokens[i:i + micro, :-1], labels=tokens[i:i + micro, 1:])) for i in (0, 4, 8)]
    assert val_loss(1) == pytest.approx(sum(batch_means) / 3, rel=1e-14)
    for world_size in (2, 3, 5):
        assert val_loss(world_size) == pytest.approx(val_loss(1), rel=1e-12), world_size


@pytest.mark.parametrize("variable", ["SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"])
def test_many_tasks_without_a_launcher_are_refused_in_one_line(monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    """``srun -n 4 python train.py``: each task would set up its own one-rank world and train alone."""
    from megatron_lite.training.distributed import single_process_env

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        monkeypatch.setenv(name, "")  # recorded, so what single_process_env sets is undone after the test
        monkeypatch.delenv(name)
    monkeypatch.setenv(variable, "4")
    with pytest.raises(ValueError, match=f"^{variable}=4: this is one of 4 tasks started without a torch launcher"):
        single_process_env()
    monkeypatch.setenv(variable, "1")  # one task (e.g. `srun -n 1`, or python inside an allocation): runs alone
    single_process_env()
    assert os.environ["WORLD_SIZE"] == "1"
    assert os.environ["MASTER_PORT"] == "0"  # the lone rank's store binds a port of the OS's choice: nothing to race


def test_a_rendezvous_port_is_picked_below_the_ephemeral_range(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    """Outgoing connections (other jobs' gloo/NCCL links) take ephemeral ports between the pick and the ranks'
    bind; a port below the range is safe from them. Without room below it, any free port."""
    import socket

    from megatron_lite.training import distributed

    port_range = tmp_path / "ip_local_port_range"
    port_range.write_text("40000\t60999\n")
    monkeypatch.setattr(distributed, "EPHEMERAL_PORTS", port_range)
    ports = {distributed.free_port() for _ in range(8)}
    assert all(28_000 <= port < 40_000 for port in ports) and len(ports) > 1, ports
    with socket.socket() as listener:
        listener.bind(("", ports.pop()))  # free when picked
    port_range.write_text("2000\t60999\n")
    assert 0 < distributed.free_port() < 65536
