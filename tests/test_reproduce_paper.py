"""tools/reproduce.py --profile paper-350m (megatron_lite.repro.paper): the budget arithmetic on the real 350M
configs, where its MFU comes from (gpu_check.json, the results board, --mfu, assumed), the launcher command,
user errors; and (slow) the dry run of every phase through the real deepspeed launcher on 2 CPU ranks, with a
model interrupted after a checkpoint that the rerun resumes, and a SIGTERM that reaches the ranks."""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_lite import config as config_lib
from megatron_lite import results_board
from megatron_lite.repro.paper import (MfuEstimate, budget_mfu, budget_text, hostfile_slots, parse_tokens, plan_budget,
                                       world_size)
from megatron_lite.repro.run_length import MEASURED
from megatron_lite.repro.settings import absolute, load_scheme_configs
from megatron_lite.repro.training import train_command

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO / "tests"))
import reproduce  # noqa: E402
from training_helpers import make_corpus  # noqa: E402

PAPER_350M_CONFIGS = {"alibi": "alibi_350m.yml", "rope": "rope_350m.yml", "coca_slack": "coca_350m.yml",
                      "coca_strict": "coca_strict_350m.yml"}


def paper_settings(tmp_path: Path, *extra: str):  # type: ignore[no-untyped-def]
    board = [] if "--no-board" in extra else ["--board", str(tmp_path / "board.md")]
    argv = ["--profile", "paper-350m", "--eval-books", str(REPO / "data/eval"), "--out", str(tmp_path / "out"),
            *board, *extra]
    return absolute(reproduce.settings_from_args(reproduce.parse_args(argv)))


def test_the_profile_trains_the_repositorys_350m_configs_unchanged(tmp_path: Path) -> None:
    settings = paper_settings(tmp_path, "--num-gpus", "8")
    configs = load_scheme_configs(settings)  # also: they differ only in model.position
    for scheme, name in PAPER_350M_CONFIGS.items():
        own = config_lib.to_dict(config_lib.load(REPO / "configs" / name))
        used = config_lib.to_dict(configs[scheme])
        assert {key: used[key] for key in ("model", "train", "precision", "seed")} == \
               {key: own[key] for key in ("model", "train", "precision", "seed")}, scheme
        assert used["data"]["mix"] == str(REPO / "configs/data/paper_mix.yml")
        assert used["data"]["cache_dir"] == str(tmp_path / "out/data/cache")


def test_budget_of_the_paper_run_on_8_gpus(tmp_path: Path) -> None:
    settings = paper_settings(tmp_path, "--num-gpus", "8")
    config = load_scheme_configs(settings)["coca_slack"]
    plan = plan_budget(settings, config, world_size(settings), budget_mfu(settings))
    # 2 epochs x 50B = 100B tokens; global batch 256 x 512 = 131,072 tokens per step
    assert plan["tokens_requested"] == 100_000_000_000 and plan["tokens_per_step"] == 131_072
    assert plan["train_iters"] == 762_940 == -(-100_000_000_000 // 131_072)
    assert plan["tokens_per_model"] == 762_940 * 131_072 and plan["tokens_total"] == 4 * 762_940 * 131_072
    # 6 x (parameters without the input embedding) + 12 x layers x width x length (docs/run_at_scale.md)
    assert plan["flops_per_token"] == 6 * 353_560_576 + 12 * 24 * 1024 * 512 == 2_272_358_400
    # no board at tmp_path/board.md: the project's own measurement (the users' command on one H200)
    assert (plan["mfu"], plan["mfu_kind"]) == (MEASURED.mfu, "measured") and "H200" in plan["mfu_source"]
    for gpus in (1, 8):
        for device, peak in (("A100", 312.0), ("H100/H200", 989.0)):
            hours = plan["tokens_per_model"] * plan["flops_per_token"] / (gpus * peak * 1e12 * MEASURED.mfu) / 3600
            row = plan["hours"][f"{gpus}x{device}"]
            assert row["hours_per_model"] == pytest.approx(hours, abs=0.01)
            assert row["hours_total"] == pytest.approx(4 * hours, abs=0.01)
    assert plan["hours"]["8xA100"]["hours_per_model"] == pytest.approx(58.11, abs=0.01)
    assert plan["hours"]["8xH100/H200"]["hours_per_model"] == pytest.approx(18.33, abs=0.01)
    # --tokens shortens the two epochs; the global batch, not the GPU count, sets the tokens per step
    short = paper_settings(tmp_path, "--hostfile", str(write_hostfile(tmp_path, 2)), "--tokens", "10B")
    plan = plan_budget(short, config, world_size(short), MfuEstimate(0.5, "given", "--mfu"))
    assert (plan["ranks"], plan["train_iters"], plan["tokens_per_step"]) == (16, 76_294, 131_072)


def write_hostfile(tmp_path: Path, nodes: int) -> Path:
    path = tmp_path / "hostfile"
    path.write_text("".join(f"node{index} slots=8\n" for index in range(nodes)))
    return path


def test_the_documented_budget_is_what_the_tool_prints(tmp_path: Path) -> None:
    settings = paper_settings(tmp_path, "--num-gpus", "8")
    plan = plan_budget(settings, load_scheme_configs(settings)["coca_slack"], 8, budget_mfu(settings))
    doc = (REPO / "docs/reproduction.md").read_text()
    assert budget_text(plan) in doc


@pytest.mark.parametrize(("text", "tokens"), [("100B", 100_000_000_000), ("2.5b", 2_500_000_000),
                                              ("300M", 300_000_000), ("5e9", 5_000_000_000), ("1000", 1000)])
def test_token_counts(text: str, tokens: int) -> None:
    assert parse_tokens(text) == tokens


def gpu_check_json(path: Path, mfus: dict[tuple[str, str], float | None]) -> Path:
    rows = [{"model": model, "mode": mode, "status": "ok", "micro_batch": 32, "mfu": mfu}
            for (model, mode), mfu in mfus.items()]
    rows.append({"model": "hf_gpt_neox (rope)", "mode": "eager", "status": "ok", "mfu": 0.10})
    path.write_text(json.dumps({"env": {"rows": [{"item": "device", "value": "NVIDIA H100 80GB HBM3"}]},
                                "throughput": {"rows": rows}}))
    return path


def test_mfu_measured_by_gpu_check_is_the_slowest_compiled_scheme(tmp_path: Path) -> None:
    measured = gpu_check_json(tmp_path / "gpu_check.json", {
        ("rope", "eager"): 0.30, ("rope", "compiled"): 0.48, ("coca_slack", "compiled"): 0.46,
        ("alibi", "compiled"): 0.47, ("coca_strict", "compiled"): 0.465})
    estimate = budget_mfu(paper_settings(tmp_path, "--gpu-check", str(measured)))
    assert (estimate.value, estimate.kind) == (0.46, "measured")
    assert "NVIDIA H100 80GB HBM3" in estimate.source and "coca_slack compiled" in estimate.source
    # --smoke rows carry no MFU (CPU): nothing measured by the user, so the project's measurement
    smoke = gpu_check_json(tmp_path / "smoke.json", {("rope", "eager"): None})
    assert budget_mfu(paper_settings(tmp_path, "--gpu-check", str(smoke))) == \
        MfuEstimate(MEASURED.mfu, "measured", MEASURED.describe())
    assert budget_mfu(paper_settings(tmp_path, "--gpu-check", str(measured), "--mfu", "0.3")) == \
        MfuEstimate(0.3, "given", "--mfu")


def test_mfu_the_users_command_measured_in_a_gpu_check_json(tmp_path: Path) -> None:
    measured = gpu_check_json(tmp_path / "gpu_check.json",
                              {("rope", "compiled"): 0.38, ("coca_slack", "compiled"): 0.37})
    results = json.loads(measured.read_text())
    results["users_command"] = {"rows": [{"command": "deepspeed --num_gpus 1 train.py --config configs/coca_350m.yml",
                                          "status": "ok", "mfu": 0.2704}]}
    measured.write_text(json.dumps(results))
    estimate = budget_mfu(paper_settings(tmp_path, "--gpu-check", str(measured)))
    assert (estimate.value, estimate.kind) == (0.2704, "measured") and "users' command" in estimate.source


def test_mfu_measured_on_the_board_is_a_paper_runs_only(tmp_path: Path) -> None:
    board = results_board.Board(tmp_path / "board.md", "abc1234")
    own = MfuEstimate(MEASURED.mfu, "measured", MEASURED.describe())
    board.append(results_board.GPU_CHECKS, {"kind": "smoke", "device": "cpu", "run": "gpu_check", "MFU": "9.0%"})
    assert budget_mfu(paper_settings(tmp_path)) == own  # a smoke row is no measurement
    # a GPU check's MFU is the bare model's, above training's (37.5% vs 27.0% on one H200): not used
    board.append(results_board.GPU_CHECKS, {"kind": "full", "device": "NVIDIA H100", "run": "gpu_check",
                                            "MFU": "47.5%"})
    assert budget_mfu(paper_settings(tmp_path)) == own
    board.append(results_board.REPRODUCTIONS, {"kind": "full", "device": "NVIDIA A100-SXM4-80GB",
                                               "run": "reproduce paper-350m", "MFU": "31.0%"})
    board.append(results_board.REPRODUCTIONS, {"kind": "full", "device": "NVIDIA H100", "run": "reproduce gpu-speedrun",
                                               "MFU": "20.0%"})
    estimate = budget_mfu(paper_settings(tmp_path))
    assert estimate.value == pytest.approx(0.31) and "reproduce paper-350m" in estimate.source
    assert budget_mfu(paper_settings(tmp_path, "--no-board")) == own  # --no-board: not read either


def test_every_model_starts_through_the_deepspeed_launcher(tmp_path: Path) -> None:
    command = train_command(paper_settings(tmp_path, "--num-gpus", "8"), "rope", 100)
    assert command[:5] == [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "8"]
    assert command[5] == str(REPO / "train.py") and command[command.index("--resume") + 1] == "auto"
    assert command[command.index("--config") + 1] == str(REPO / "configs/repro/paper350m/rope.yml")
    hostfile = write_hostfile(tmp_path, 2)
    command = train_command(paper_settings(tmp_path, "--hostfile", str(hostfile), "--master-port", "29600"), "rope", 1)
    assert command[3:7] == ["--hostfile", str(hostfile), "--master_port", "29600"]
    dry = paper_settings(tmp_path, "--dry-run")
    assert world_size(dry) == 2 and train_command(dry, "rope", 4)[3:5] == ["--num_gpus", "2"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--tokens", "lots"], "--tokens 'lots': expected a number of tokens such as 100B"),
    (["--mix", "/nonexistent/mix.yml"], "--mix /nonexistent/mix.yml: no such file"),
    (["--num-gpus", "8", "--hostfile", __file__], "--hostfile/--num-gpus: give one"),
    (["--hostfile", __file__], f"--hostfile {__file__}: Hostfile contains a bad entry"),
    (["--num-gpus", "8", "--train-iters", "5"], "--train-iters: the paper-350m profile sets its step count from --tokens"),
    (["--num-gpus", "8", "--mfu", "45"], "--mfu 45: a fraction of the peak, in (0, 1]"),
    (["--num-gpus", "3"], "train.train_batch_size=256 is not a multiple of train.train_micro_batch_size_per_gpu=16 x 3"),
    (["--num-gpus", "8", "--eval-books", "/nonexistent"], "--eval-books '/nonexistent': no such file or directory"),
    (["--num-gpus", "8", "--books", "x"], "--books: the paper-350m profile trains on --mix"),
    (["--profile", "cpu-tiny", "--tokens", "5B"], "--tokens: only the paper-350m profile takes it (--profile cpu-tiny)"),
])
def test_user_errors_are_one_line(argv: list[str], message: str, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--profile", "paper-350m", "--eval-books", str(REPO / "data/eval"), "--out", str(tmp_path / "out"),
            "--no-board", "--quiet"]
    assert reproduce.main([*base, *argv]) == 2
    error = capsys.readouterr().err.strip()
    assert message in error and len(error.splitlines()) == 1, error


def test_a_bad_hostfile_is_said_once_not_also_by_deepspeeds_logger(tmp_path: Path) -> None:
    """DeepSpeed's parser logs the whole file at ERROR before it raises; the user gets the one line only."""
    from deepspeed.utils import logger

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=eight\n")
    level = logger.level
    logger.addHandler(handler)
    try:
        with pytest.raises(ValueError, match="--hostfile .*: Hostfile contains a bad entry: node0 slots=eight"):
            hostfile_slots(hostfile)
    finally:
        logger.removeHandler(handler)
    assert records == [] and logger.level == level


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message of a machine without GPUs")
def test_no_gpu_and_no_dry_run_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--profile", "paper-350m", "--eval-books", str(REPO / "data/eval"), "--out", str(tmp_path / "out"),
            "--no-board", "--quiet"]
    assert reproduce.main(argv) == 2
    assert "--num-gpus: this machine has no CUDA GPU" in capsys.readouterr().err


def test_documented_command_parses(tmp_path: Path) -> None:
    doc = (REPO / "docs/reproduction.md").read_text()
    line = next(line for line in doc.splitlines() if line.startswith("python tools/reproduce.py --profile paper-350m"))
    args = reproduce.parse_args(shlex.split(line)[2:])
    settings = reproduce.settings_from_args(args)
    assert settings.profile == "paper-350m" and settings.paper.tokens is None and settings.paper.mix is None
    assert settings.windows == [512 * 2**i for i in range(7)] and settings.passkey_cases == 100


# ----------------------------------------------------------------------------------------------
# The dry run: every phase, through the real launcher


def dry_run_command(corpus_mix: Path, out: Path, board: Path, *extra: str) -> list[str]:
    return [sys.executable, str(REPO / "tools/reproduce.py"), "--profile", "paper-350m", "--dry-run",
            "--mix", str(corpus_mix), "--eval-books", str(REPO / "data/eval"), "--out", str(out), "--board", str(board),
            "--windows", "32,64", "--max-doc-tokens", "128", "--max-docs", "1", "--passkey-lengths", "256",
            "--passkey-cases", "1", "--ntk-factors", "2", "--headline-ntk-factor", "2", *extra]


def run_tool(command: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


DRY_RUN = ("alibi", "coca_strict")
DRY_RUN_SCHEMES = ("--schemes", *DRY_RUN)


@pytest.mark.slow
def test_dry_run_of_every_phase_through_the_launcher_and_a_resumed_model(tmp_path: Path) -> None:
    """Two of the four models (ALiBi: no dynamic NTK rows; CoCA strict: the one interrupted), to keep the suite
    short: every model's config and launcher are checked without training (tests above)."""
    mix = make_corpus(tmp_path / "corpus")
    out, board = tmp_path / "out", tmp_path / "board.md"
    first = run_tool(dry_run_command(mix, out, board, *DRY_RUN_SCHEMES))
    # the budget comes before anything runs
    assert first.stdout.index("Budget (dry run: the toy model): 2 models") < first.stdout.index("train alibi")
    before_tables = first.stdout.split("# The CoCA paper's 350M run")[0]  # tables.md, printed last, repeats it
    assert before_tables.count("Budget (dry run") == 1
    assert "= 4 steps x 512 tokens (global batch 16 x length 32) = 2,048 tokens" in first.stdout
    assert f"MFU               {MEASURED.mfu:.1%}, measured (the users' command on one NVIDIA H200" in first.stdout
    results = json.loads((out / "results.json").read_text())
    assert list(results["training"]) == list(DRY_RUN)
    assert all(info["action"] == "trained" and info["steps"] == 4 and info["tokens"] == 4 * 16 * 32
               for info in results["training"].values())
    assert results["budget"]["train_iters"] == 4 and results["budget"]["ranks"] == 2
    for scheme in DRY_RUN:  # two ranks, started by the deepspeed launcher
        log = (out / f"logs/train_{scheme}.log").read_text()
        assert "-m deepspeed.launcher.runner --num_gpus 2" in log and "dist_world_size=2" in log
        marker = json.loads((out / f"runs/{scheme}/checkpoints/step_00000004/COMPLETE").read_text())
        assert (marker["world_size"], marker["zero_stage"]) == (2, 1)
    cells = {(row["model"], row["scaling"], row["window"]) for row in results["perplexity"]}
    assert cells == {(s, c, w) for s in DRY_RUN for c in ("none", "dynamic:2") for w in (32, 64)
                     if s != "alibi" or c == "none"}
    assert {(row["model"], row["length"]) for row in results["passkey"]} >= {(s, 256) for s in DRY_RUN}
    tables = (out / "tables.md").read_text()
    assert tables.startswith("# The CoCA paper's 350M run (dry run at toy size)") and "## Budget" in tables
    assert json.loads((out / "budget.json").read_text()) == results["budget"]
    assert not (out / "data/mix.yml").exists()  # the mix is read in place
    (row,) = results_board.read_rows(board, results_board.REPRODUCTIONS)
    assert (row["kind"], row["run"], row["this call"]) == ("dry-run", "reproduce paper-350m", "trained 2 of 2 models")

    # coca_strict interrupted after its step-2 checkpoint (the step-4 one never written): the rerun
    # resumes it through the launcher and skips the finished model
    shutil.rmtree(out / "runs/coca_strict/checkpoints/step_00000004")
    logs = {scheme: (out / f"logs/train_{scheme}.log").stat().st_size for scheme in DRY_RUN}
    run_tool(dry_run_command(mix, out, board, *DRY_RUN_SCHEMES))
    again = json.loads((out / "results.json").read_text())
    actions = {scheme: info["action"] for scheme, info in again["training"].items()}
    assert actions == {"alibi": "skipped (finished)", "coca_strict": "resumed from step 2"}
    assert again["training"]["coca_strict"]["steps"] == 4
    assert [(out / f"logs/train_{s}.log").stat().st_size == logs[s] for s in DRY_RUN] == [True, False]
    assert "resumed from" in (out / "logs/train_coca_strict.log").read_text()[logs["coca_strict"]:]
    rows = results_board.read_rows(board, results_board.REPRODUCTIONS)
    assert len(rows) == 2 and rows[1]["this call"] == "trained 1 of 2 models"


@pytest.mark.slow
def test_sigterm_reaches_the_ranks_through_the_launcher(tmp_path: Path) -> None:
    """``timeout`` or a scheduler signals only the reproduction: both ranks must still save and stop."""
    import psutil

    mix = make_corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    # a DataLoader worker per rank, as the real configs have: the signal must reach the ranks, not their workers
    command = dry_run_command(mix, out, tmp_path / "board.md", "--schemes", "rope", "--tokens", "50M", "--quiet",
                              "--set", "train.num_workers=1")
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"})
    metrics = out / "runs/rope/metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read() if process.stderr else ""
        time.sleep(0.5)
    family = psutil.Process(process.pid).children(recursive=True)
    process.send_signal(signal.SIGTERM)  # to the reproduction only, not its process group
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 130, stderr
    assert "interrupted: run the same command again to resume" in stderr
    complete = sorted((out / "runs/rope/checkpoints").glob("*/COMPLETE"))
    assert complete, "the ranks did not save on the forwarded SIGTERM"
    marker = json.loads(complete[-1].read_text())
    assert (marker["world_size"], marker["stopped_by"], marker.get("signal")) == (2, "signal", "SIGTERM")
    assert 3 <= marker["step"] < 97_657
    _, alive = psutil.wait_procs(family, timeout=60)
    assert not alive, f"left running: {[p.cmdline() for p in alive]}"
