"""tools/reproduce.py --profile gpu-speedrun: the probe's step count, the GPU acceptance script's dry run (the
speedrun pair among its phases) from a real (tiny) data bundle on a node without wandb, datasets, zstandard or
matplotlib, and a SIGTERM (a scheduler's, ``timeout``'s) reaching train.py through the reproduction."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from megatron_lite import results_board
from megatron_lite.repro.settings import SpeedrunBudget
from megatron_lite.repro.speedrun import data_passes_line, plan_train_iters

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO / "tests"))
import reproduce  # noqa: E402
from test_reproduce import TOY_MODEL, write_books  # noqa: E402

BARE_NODE_BLOCKER = '''
import importlib.abc, importlib.util, sys
BLOCKED = {"wandb", "datasets", "zstandard", "matplotlib"}

class BareNode(importlib.abc.MetaPathFinder):
    """What a bare GPU node lacks (docs/gpu_check.md): importing it fails as if not installed."""
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (a bare node)", name=name)
        return None

_find_spec = importlib.util.find_spec

def find_spec(name, package=None):
    """As on a node without the package: no spec (torch probes for zstandard this way)."""
    return None if name.partition(".")[0] in BLOCKED else _find_spec(name, package)

importlib.util.find_spec = find_spec
sys.meta_path.insert(0, BareNode())
'''


def test_plan_splits_the_budget_at_the_slowest_scheme() -> None:
    probes = {"rope": {"tokens_per_sec": 2_000_000.0, "startup_seconds": 30.0},
              "alibi": {"tokens_per_sec": 1_600_000.0, "startup_seconds": 45.0}}
    budget = SpeedrunBudget(total_seconds=540, eval_seconds_per_model=40, curve_seconds_per_model=20,
                            report_seconds=10)
    plan = plan_train_iters(budget, probes, step_tokens=32_768, models=4)
    # (540 - 10) / 4 - 45 - 40 - 20 = 27.5 s of training at 1.6M tokens/s = 44M tokens = 1,342 steps of 32,768
    assert plan["train_seconds_per_model"] == 27.5 and plan["train_iters"] == 1342 and plan["limited_by"] == "budget"
    pair = plan_train_iters(budget, probes, step_tokens=32_768, models=2)  # 160 s each: 256M tokens, over the cap
    assert pair["train_seconds_per_model"] == 160.0 and pair["limited_by"] == "token cap"
    capped = plan_train_iters(SpeedrunBudget(max_train_tokens=32_768 * 100), probes, 32_768, 4)
    assert capped["train_iters"] == 100 and capped["limited_by"] == "token cap"


def test_the_passes_over_the_bundle_are_printed_and_many_are_flagged() -> None:
    # the 2026-11-27 H200 pair: 2,162 steps of 32,768 tokens over a 6.03M-token bundle
    line = data_passes_line(2_162 * 32_768, 6_028_716)
    assert line.startswith("data: 70.8M training tokens per model = 11.8 passes over the bundle's 6.03M tokens (more")
    assert "--min-tokens" in line and "(" not in data_passes_line(47_000_000, 30_000_000)  # 1.6 passes: no hint


@pytest.mark.parametrize(("argv", "message"), [
    (["--profile", "cpu-tiny", "--dry-run"], "--dry-run: only the gpu-speedrun and paper-350m profiles have one"),
    (["--profile", "gpu-speedrun", "--books", "x"], "--books/--eval-books: the gpu-speedrun profile reads"),
    (["--profile", "gpu-speedrun", "--bundle", "/nonexistent.tar.xz"], "--bundle /nonexistent.tar.xz: no such file"),
    (["--profile", "gpu-speedrun"], "--bundle: the gpu-speedrun profile trains on a data bundle"),
    (["--profile", "gpu-speedrun", "--bundle", __file__, "--only", "data,fit"], "--only 'fit': unknown phase"),
    (["--profile", "gpu-speedrun", "--bundle", __file__, "--probe-steps", "1"], "--probe-steps 1: must be >= 2"),
])
def test_user_errors_are_one_line(argv: list[str], message: str, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert reproduce.main([*argv, "--out", str(tmp_path / "out"), "--quiet"]) == 2
    error = capsys.readouterr().err.strip()
    assert message in error and len(error.splitlines()) == 1


@pytest.mark.slow
def test_sigterm_reaches_train_py_which_saves_and_the_rerun_resumes(tmp_path: Path) -> None:
    """``timeout`` or a scheduler signals only the reproduction; train.py must still save and stop."""
    books = write_books(tmp_path / "books", [f"book{i}" for i in range(4)], 30, seed=3)
    eval_books = write_books(tmp_path / "eval", ["heldout"], 40, seed=4)
    out = tmp_path / "out"
    argv = [sys.executable, str(REPO / "tools/reproduce.py"), "--books", str(books), "--eval-books", str(eval_books),
            "--out", str(out), "--schemes", "rope", "--train-iters", "100000", "--windows", "32",
            "--max-doc-tokens", "64", "--passkey-lengths", "", "--ntk-factors", "", "--code-max-documents", "4"]
    for override in TOY_MODEL:
        argv += ["--set", override]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "TQDM_DISABLE": "1"})
    metrics = out / "runs/rope/metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read() if process.stderr else ""
        time.sleep(0.5)
    process.send_signal(signal.SIGTERM)  # to the reproduction only, not its process group
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 130, stderr
    assert "interrupted: run the same command again to resume" in stderr
    complete = sorted((out / "runs/rope/checkpoints").glob("*/COMPLETE"))
    assert complete, "train.py did not save on the forwarded SIGTERM"
    saved_step = json.loads(complete[-1].read_text())["step"]
    assert 3 <= saved_step < 100000
    log = (out / "logs/train_rope.log").read_text()
    assert "SIGTERM" in log


@pytest.fixture(scope="module")
def tiny_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_data_bundle import make_tiny_bundle

    return make_tiny_bundle(tmp_path_factory.mktemp("speedrun_bundle"))


@pytest.mark.slow
def test_acceptance_dry_run_on_a_bare_node_writes_every_phase(tiny_bundle: Path, tmp_path: Path) -> None:
    """tools/gpu/acceptance.sh --dry-run on a tiny bundle, in processes where wandb, datasets, zstandard and
    matplotlib cannot be imported: the default phase's run killed after a save, resumed and compared with an
    uninterrupted one (equal in fp32 on a CPU), converted to Hugging Face; the paper vocabulary's runs and throughput rows; the
    speedrun pair through tools/gpu/speedrun_pair.sh (two reproduce.py invocations: data and probe, then train,
    eval and report); the FP8 runs (stopped at their start where FP8 needs CUDA); all packed into results.tar.xz."""
    blocker = tmp_path / "bare_node"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(BARE_NODE_BLOCKER)
    env = {**os.environ, "TQDM_DISABLE": "1", "GPU_ACCEPTANCE_WORK": str(tmp_path / "work"),
           "GPU_ACCEPTANCE_BUDGET": "1500",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(blocker), os.environ.get("PYTHONPATH")]))}
    probe = subprocess.run([sys.executable, "-c", "import matplotlib"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "a bare node" in probe.stderr  # the blocker is in force
    out = tmp_path / "out"
    run = subprocess.run(["bash", str(REPO / "tools/gpu/acceptance.sh"), "--dry-run", "-", str(tiny_bundle), str(out)],
                         capture_output=True, text=True, env={**env, "PYTHON": sys.executable}, timeout=1500)
    assert run.returncode == 0, run.stdout[-3000:]
    assert sorted(path.name for path in out.iterdir()) == ["results.tar.xz"]  # no profiler trace in a dry run
    with tarfile.open(out / "results.tar.xz") as archive:
        archive.extractall(tmp_path / "results", filter="data")
    results_dir = tmp_path / "results"
    phases = (results_dir / "phases.txt").read_text().splitlines()
    assert [line.split(" in ")[0] for line in phases] == ["default exit 0", "vocab exit 0", "speedrun exit 0",
                                                         "fp8 exit 0"], phases

    # default: killed once a save was complete (every 4 steps; how many steps ran by then is the machine's),
    # resumed to step 20: the same losses as the uninterrupted run's
    resume = json.loads((results_dir / "e2e_resume.json").read_text())
    assert resume["resumed_from"] in (4, 8, 12, 16) and resume["after_the_resume"]["steps"][-1] == 20
    assert resume["after_the_resume"]["max_abs_diff"] == 0 and resume["before_the_kill"]["max_abs_diff"] == 0
    log = (results_dir / "log.txt").read_text()
    assert re.search(r"e2e_killed: SIGKILL once step (4|8|12|16)'s checkpoint was complete", log), log[-3000:]
    assert "(--to hf, fp32, scheme coca slack)" in (results_dir / "e2e_convert.txt").read_text()
    assert " skipped" in (results_dir / "gpu_tests.txt").read_text()  # the GPU tests, on a CPU

    # vocab: both micro batches trained, each beside the compiled rows of rope and the twin (loss eager, compiled)
    vocab = json.loads((results_dir / "vocab_summary.json").read_text())
    assert [(row["run"], row["exit_code"]) for row in vocab["runs"]] == [("vocab_mb16", "0"), ("vocab_mb32", "0")]
    assert all(row["tokens_per_sec"] > 0 for row in vocab["runs"])
    assert [(row["run"], row["row"]) for row in vocab["throughput"]] == [
        (f"vocab_mb{micro}", row) for micro in (16, 32) for row in ("rope", "hf_twin (loss eager)",
                                                                    "hf_twin (loss compiled)")]

    # speedrun: the plan printed first, then every phase of the pair
    speedrun = results_dir / "speedrun"
    speedrun_log = (speedrun / "log.txt").read_text()
    assert "[reproduce] GPU plan at the reference measurement (one NVIDIA H200, 2026-11-27" in speedrun_log
    assert "data: 0.0M training tokens per model = 0.0 passes over the bundle's" in speedrun_log  # 3 steps of 128
    assert "matplotlib is not installed" in speedrun_log
    results = json.loads((speedrun / "results.json").read_text())
    schemes = ["rope", "coca_slack"]  # the speedrun's default pair
    assert list(results["training"]) == schemes
    for scheme in schemes:  # the in-training curve: an evaluation before step 1 and after each of the 3 steps
        curve = results["training"][scheme]["extrapolation_curve"]
        assert [row["step"] for row in curve] == [0, 1, 2, 3] and "extrapolation_ratio_x4" in curve[-1]
        assert all((speedrun / f"{scheme}_{name}").is_file() for name in ("metrics.jsonl", "train_log_tail.txt"))
    assert all(info["steps"] == 3 for info in results["training"].values())
    probes = results["probe"]["probes"]
    assert set(probes) == set(schemes) and all(row["tokens_per_sec"] > 0 for row in probes.values())
    assert results["probe"]["plan"]["tokens_per_step"] == 4 * 32
    scalings = ["none", "dynamic:2", "dynamic:4", "dynamic:8"]
    cells = {(row["model"], row["scaling"], row["window"]) for row in results["perplexity"]}
    assert cells == {(s, c, w) for s in schemes for c in scalings for w in (32, 64, 128)}
    assert {row["length"] for row in results["passkey"]} == {256, 512}
    assert results["plots"] == [] and not list(speedrun.glob("*.png"))
    phase_names = {name for call in json.loads((speedrun / "wall_times.json").read_text()) for name in call["phases"]}
    assert {"data", "probe", "report", *(f"train {s}" for s in schemes), *(f"perplexity {s}" for s in schemes)} \
        <= phase_names
    tables = (speedrun / "tables.md").read_text()
    assert "# CoCA speedrun (dry run at toy size)" in tables and "## Probe and budget" in tables
    assert "## Extrapolation while training" in tables and "### When would the ratio reach 2?" in tables
    (row,) = results_board.read_rows(speedrun / "results_board.md", results_board.REPRODUCTIONS)
    assert (row["kind"], row["run"], row["length"]) == ("dry-run", "reproduce gpu-speedrun", "32")
    for scheme in schemes:  # windows 32 ... 128: 1x and 4x evaluated, 32x not
        once, four_times, thirty_two_times = row[f"{scheme} ppl ×1 / ×4 / ×32"].split(" / ")
        assert "–" not in once + four_times and thirty_two_times == "–", row

    # fp8: bf16 trained; each FP8 choice accepted by the config, then stopped at its start on a CPU
    fp8 = json.loads((results_dir / "fp8_summary.json").read_text())
    assert [(row["run"], row["exit_code"]) for row in fp8["runs"]] == [
        ("fp8_none", "0"), ("fp8_lm_head", "2"), ("fp8_mlp", "2"), ("fp8_all", "2")]
    assert fp8["runs"][0]["tokens_per_sec"] > 0
    assert log.count("stopped at its start, as it must on a CPU") == 3


def test_a_corrupted_bundle_stops_the_run_in_one_line(tiny_bundle: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Damaged in transit (its .sha256 as built), or given without a .sha256: refused before unpacking."""
    damaged = tmp_path / "damaged.tar.xz"
    data = bytearray(tiny_bundle.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    argv = ["--profile", "gpu-speedrun", "--dry-run", "--bundle", str(damaged), "--out", str(tmp_path / "out"),
            "--quiet"]
    assert reproduce.main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "no damaged.tar.xz.sha256 beside it" in error and "--bundle-sha256" in error
    sidecar = tiny_bundle.with_name(tiny_bundle.name + ".sha256")
    damaged.with_name(damaged.name + ".sha256").write_text(sidecar.read_text())
    for extra in ([], ["--bundle-sha256", sidecar.read_text().split()[0]]):
        assert reproduce.main([*argv, *extra]) == 2
        error = capsys.readouterr().err.strip()
        assert len(error.splitlines()) == 1 and str(damaged) in error and "is not the one that was built" in error
    assert not (tmp_path / "out" / "data" / "bundle").exists()
    assert reproduce.main([*argv, "--bundle-sha256", "12ab"]) == 2
    assert capsys.readouterr().err == "error: --bundle-sha256 '12ab': expected a sha256, 64 hexadecimal digits\n"


def test_the_pair_script_parses_and_names_its_arguments() -> None:
    script = REPO / "tools/gpu/speedrun_pair.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    usage = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    assert usage.returncode == 2
    assert usage.stderr.startswith("usage: bash tools/gpu/speedrun_pair.sh WHEELS_DIR BUNDLE OUT")
    missing = subprocess.run(["bash", str(script), "-", "/nonexistent.tar.xz", "/tmp/x"], capture_output=True,
                             text=True)
    assert missing.returncode == 2 and missing.stderr.strip() == "error: BUNDLE /nonexistent.tar.xz: no such file"


def test_the_documented_gpu_plan_is_the_codes(tmp_path: Path) -> None:
    """docs/reproduction.md quotes the plan line the tool prints first; the reference and the budget make it."""
    from megatron_lite.repro.speedrun import reference_plan

    settings = reproduce.settings_from_args(reproduce.parse_args(
        ["--profile", "gpu-speedrun", "--bundle", str(tmp_path / "b.tar.xz"), "--out", str(tmp_path / "out")]))
    plan = reference_plan(settings)
    expected = (f"{plan['train_iters']:,} steps = {plan['tokens_per_model'] / 1e6:,.1f}M tokens each, "
                f"{plan['train_seconds_per_model']} s of training per model, about {plan['expected_minutes']} min")
    docs = (REPO / "docs/reproduction.md").read_text()
    assert expected in docs and f"{plan['slowest_tokens_per_sec']:,.0f} tokens/s" in docs, expected
