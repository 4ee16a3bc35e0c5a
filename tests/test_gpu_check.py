"""tools/gpu_check.py --smoke: every section on the tiny config on the CPU, written to JSON and markdown as it
finishes; a re-run skips finished sections; --only picks sections; no CUDA without --smoke is one error line.
--quick --smoke: the quick profile's sections and rows for the schemes given; its flags checked (one error line
each); the users' command's metrics and warnings read from synthetic files; the Hugging Face twin's loss compiled with
it; the scripts of tools/gpu/ parse and name only settings and flags that exist (the acceptance script's dry run:
tests/test_speedrun.py)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import tarfile
import time
import typing
from pathlib import Path

import pytest
import torch

from megatron_lite import config as config_lib
from megatron_lite import results_board
from megatron_lite.bench import gpu_check, gpu_check_settings, users_command
from megatron_lite.model import GPT
from megatron_lite.model.compile import inductor_settings
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
    assert list(results) == list(gpu_check_settings.SECTIONS)
    markdown = (out / "gpu_check.md").read_text()
    assert f"torch {torch.__version__}" in markdown
    for name, section in results.items():
        assert section["rows"] and section["seconds"] >= 0 and section["finished"], name
        assert f"## {name}" in markdown
    env = {row["item"]: row["value"] for row in results["env"]["rows"]}
    assert env["torch"] == torch.__version__ and env["flash-attn"]  # a version or "missing", never a crash

    parity = {(row["scheme"], row["backend"]): row for row in results["parity"]["rows"]}
    assert {scheme for scheme, _ in parity} == set(gpu_check_settings.SCHEMES)
    for scheme in gpu_check_settings.SCHEMES:
        row = parity[(scheme, "sdpa")]
        assert row["status"] == "ok" and row["rel_error"] < 0.05 and row["max_abs_error"] < 0.2, row
        assert set(gpu_check.PARITY_BACKENDS) == {backend for s, backend in parity if s == scheme}
    if not torch.cuda.is_available():  # flash needs CUDA: a row saying why
        assert parity[("rope", "flash")]["status"].startswith("unavailable: ")

    throughput = results["throughput"]["rows"]
    eager = [row for row in throughput if row["mode"] == "eager"]
    assert len(eager) == len(gpu_check_settings.SCHEMES) + 1  # + the Hugging Face twin
    assert all(row["status"] == "ok" and row["tokens_per_sec"] > 0 and row["micro_batch"] == 2 for row in eager)

    memory = [row for row in results["memory"]["rows"] if row["status"] == "ok"]
    assert {row["scheme"] for row in memory} == set(gpu_check_settings.SCHEMES) and all(row["peak_gib"] > 0 for row in memory)
    assert [row["backend"] for row in memory if row["scheme"] == "alibi"] in (["chunked"], ["flash"])

    (train,) = results["train"]["rows"]
    assert train["status"] == "ok" and train["loss_last"] < train["loss_first"] and train["tokens_per_sec"] > 0
    assert all(row["status"] == "skipped: no CUDA" for row in results["sync"]["rows"]) or torch.cuda.is_available()
    (users,) = results["users_command"]["rows"]
    assert users["status"].startswith("skipped: no ")  # no CUDA, or no --mix

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
    assert all(f"{name}: already finished" in err for name in gpu_check_settings.SECTIONS), err
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
    assert gpu_check_settings.parse_sections(None) == list(gpu_check_settings.SECTIONS)
    assert gpu_check_settings.parse_sections("sync, env") == ["env", "sync"]  # run in the fixed order
    with pytest.raises(ValueError, match="nonsense"):
        gpu_check_settings.parse_sections("env,nonsense")
    config = gpu_check.parity_config(True, "rope", "sdpa", "fp32")
    device = torch.device("cpu")
    assert gpu_check.largest_batch(config, False, device, 64, fits=lambda batch: batch <= 8) == 8
    assert gpu_check.largest_batch(config, False, device, 64, fits=lambda batch: True) == 64
    assert gpu_check.largest_batch(config, False, device, 64, fits=lambda batch: False) == 0
    assert gpu_check.long_context_backends("alibi", flash=True, flex=False) == ["flash"]
    assert gpu_check.long_context_backends("alibi", flash=False, flex=True) == ["chunked", "flex"]
    assert gpu_check.long_context_backends("rope", flash=True, flex=False) == ["sdpa"]


def test_quick_smoke_runs_its_sections_for_the_schemes_given(tmp_path: Path) -> None:
    board = tmp_path / "board.md"
    arguments = ["--quick", "--smoke", "--schemes", "rope", "--loss-gemm", "mixed,input_dtype", "--out", str(tmp_path),
                 "--users-micro-batch", "16,64", "--users-no-cuda-graphs", "16",
                 "--users-cpp-wrapper", "16"]
    assert load_script("tools/gpu_check.py").main([*arguments, "--board", str(board)]) == 0
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(results) == list(gpu_check_settings.QUICK_SECTIONS)
    assert all(section["settings"]["quick"] and section["settings"]["schemes"] == ["rope"]
               for section in results.values())
    assert {row["scheme"] for name in ("parity", "memory", "sync") for row in results[name]["rows"]} == {"rope"}
    flex = [row for row in results["memory"]["rows"] if row["backend"] == "flex"]
    assert all(row["compile"] == "regional" for row in flex)  # measured compiled on a GPU (skipped on CPU)

    rows = {(row["model"], row["mode"], row["loss_gemm"]): row for row in results["throughput"]["rows"]}
    assert list(rows) == [("rope", "eager", "mixed"), ("rope", "eager", "input_dtype"), ("hf_twin", "eager", None),
                          ("rope", "compiled", "mixed"), ("hf_twin", "compiled", None),
                          ("rope", "compiled", "input_dtype")]
    assert all(row["status"] == "ok" and row["micro_batch"] == 2 and row["tokens_per_sec"] > 0
               for (_, mode, _), row in rows.items() if mode == "eager")
    assert rows[("rope", "compiled", "mixed")]["compile"] == "regional"
    assert rows[("hf_twin", "compiled", None)]["compile"] == "model.compile()"
    assert all(row["status"].startswith("skipped: --smoke") for (_, mode, _), row in rows.items() if mode == "compiled")
    users = results["users_command"]["rows"]  # a run per --users-micro-batch, then per --users-no-cuda-graphs value,
    # then per --users-cpp-wrapper value
    assert [(row["status"], row["micro_batch"], row["variant"]) for row in users] == [
        ("skipped: no CUDA", 16, "-"), ("skipped: no CUDA", 64, "-"), ("skipped: no CUDA", 16, "no_cuda_graphs"),
        ("skipped: no CUDA", 16, "cpp_wrapper")]
    assert users[1]["command"] == users_command.SHOWN_COMMAND + " --set train.train_micro_batch_size_per_gpu=64"
    assert users[2]["command"].endswith("=16 --set train.cuda_graphs=false")
    assert users[3]["command"].endswith("=16 --set train.compile_cpp_wrapper=true")
    assert "## users_command" in (tmp_path / "gpu_check.md").read_text()

    (row,) = results_board.read_rows(board, results_board.GPU_CHECKS)
    assert (row["kind"], row["run"], row["this call"]) == ("smoke", "gpu_check --quick", "every section")
    # --board-only: a row for what OUT holds (a call cut short by a timeout), measuring nothing
    assert load_script("tools/gpu_check.py").main([*arguments, "--board-only", "--board", str(board)]) == 0
    second = results_board.read_rows(board, results_board.GPU_CHECKS)[1]
    assert second["this call"].startswith("row only, from OUT: env")
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == results


@pytest.mark.parametrize(("arguments", "named"), [
    (["--schemes", "rope,nonsense"], "--schemes rope,nonsense: unknown scheme(s) nonsense"),
    (["--schemes", ","], "--schemes ,: unknown scheme(s) (none)"),
    (["--loss-gemm", "mixed,bf16"], "--loss-gemm mixed,bf16: unknown value(s) bf16"),
    (["--compile-mode", "partial"],
     "--compile-mode partial: must be distinct values from regional, whole, regional-cudagraphs"),
    (["--compile-mode", "whole,whole"],
     "--compile-mode whole,whole: must be distinct values from regional, whole, regional-cudagraphs"),
    (["--compile-mode", ","],
     "--compile-mode ,: must be distinct values from regional, whole, regional-cudagraphs"),
    (["--micro-batch", "0"], "--micro-batch 0: must be >= 1"),
    (["--quick", "--only", "train"], "--only train: unknown section(s) train for --quick"),
    (["--users-micro-batch", "16,x"], "--users-micro-batch 16,x: give micro batches as integers"),
    (["--users-micro-batch", "16,16"], "--users-micro-batch 16,16: give distinct positive micro batches"),
    (["--users-micro-batch", "0"], "--users-micro-batch 0: give distinct positive micro batches"),
    (["--users-no-cuda-graphs", "16,y"], "--users-no-cuda-graphs 16,y: give micro batches as integers"),
    (["--users-no-cuda-graphs", "0"], "--users-no-cuda-graphs 0: give distinct positive micro batches"),
    (["--users-cpp-wrapper", "16,16"], "--users-cpp-wrapper 16,16: give distinct positive micro batches"),
    (["--sdpa-kernel", "auto,fa3"], "--sdpa-kernel auto,fa3: unknown kernel(s) fa3"),
    (["--vocab-size", "100"], "--mix, --tokenizer and --vocab-size go together"),
    (["--mix", "no/such/mix.yml", "--tokenizer", "t.model", "--vocab-size", "100"],
     "--mix no/such/mix.yml: no such file"),
])
def test_bad_flags_are_one_error_line(arguments: list[str], named: str, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert load_script("tools/gpu_check.py").main(["--smoke", "--out", str(tmp_path), *arguments]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.startswith(f"error: {named}") and err.count("\n") == 1, err
    assert not (tmp_path / "gpu_check.json").exists()


def test_quick_settings_and_throughput_rows() -> None:
    quick = gpu_check_settings.CheckSettings(out=Path("unused"), quick=True)
    assert (quick.sections, quick.schemes, quick.micro_batch) == (list(gpu_check_settings.QUICK_SECTIONS),
                                                                  ["rope", "coca_slack"], 64)
    assert quick.budget_s("throughput") < gpu_check_settings.FULL_BUDGET_S
    full = gpu_check_settings.CheckSettings(out=Path("unused"))
    assert (full.sections, full.schemes, full.micro_batch) == (list(gpu_check_settings.SECTIONS), list(gpu_check_settings.SCHEMES), None)
    runs = [(run.model, run.mode) for run in gpu_check.throughput_runs(quick)]
    assert runs == [("rope", "eager"), ("coca_slack", "eager"), ("hf_twin", "eager"),
                    ("coca_slack", "compiled"), ("rope", "compiled"), ("hf_twin", "compiled")]
    # --compile-mode regional,whole: a rope row compiled whole after the twin's
    modes = gpu_check_settings.parse_compile_modes("regional,whole")
    both = gpu_check_settings.CheckSettings(out=Path("unused"), quick=True, compile_mode=modes[0],
                                            extra_compile_modes=modes[1:])
    runs = [(run.model, run.mode, run.compile_mode) for run in gpu_check.throughput_runs(both)]
    assert runs[-2:] == [("hf_twin", "compiled", None), ("rope", "compiled", "whole")]
    graphs = gpu_check_settings.CheckSettings(out=Path("unused"), quick=True,
                                              extra_compile_modes=["regional-cudagraphs"])
    assert gpu_check.throughput_runs(graphs)[-1].compile_mode == "regional-cudagraphs"
    # --sdpa-kernel auto,flash: a compiled rope row with torch's SDPA pinned to its flash kernel, last
    kernels = gpu_check_settings.CheckSettings(out=Path("unused"), quick=True,
                                               sdpa_kernels=gpu_check_settings.parse_sdpa_kernels("auto,flash"))
    last = gpu_check.throughput_runs(kernels)[-1]
    assert (last.model, last.mode, last.sdpa_kernel, last.label) == ("rope", "compiled", "flash",
                                                                     "rope compiled (sdpa flash)")
    # --loss-gemm mixed,input_dtype: rope with bf16 logits eager (after the schemes) and compiled (last)
    gemms = gpu_check_settings.CheckSettings(out=Path("unused"), quick=True,
                                             loss_gemms=gpu_check_settings.parse_loss_gemms("mixed,input_dtype"))
    runs = [(run.label, run.loss_gemm) for run in gpu_check.throughput_runs(gemms)]
    assert runs == [("rope eager", "mixed"), ("coca_slack eager", "mixed"),
                    ("rope eager (loss input_dtype)", "input_dtype"), ("hf_twin eager", None),
                    ("coca_slack compiled", "mixed"), ("rope compiled", "mixed"), ("hf_twin compiled", None),
                    ("rope compiled (loss input_dtype)", "input_dtype")]


def test_sdpa_kernel_rows_pin_torchs_kernel() -> None:
    """A row's kernel is pinned, not preferred: on CPU, where cuDNN has no kernel, SDPA then has none to run."""
    q_BHTD = torch.randn(1, 2, 8, 4)
    with gpu_check.sdpa_kernel_context("flash"):
        torch.nn.functional.scaled_dot_product_attention(q_BHTD, q_BHTD, q_BHTD, is_causal=True)
    with gpu_check.sdpa_kernel_context("cudnn"), pytest.raises(RuntimeError):
        torch.nn.functional.scaled_dot_product_attention(q_BHTD, q_BHTD, q_BHTD, is_causal=True)
    assert gpu_check.sdpa_auto_kernel(torch.device("cpu")) == "FLASH_ATTENTION"  # torch's choice on a CPU


def test_cudagraphs_max_autotune_and_fewer_launches_compile_modes_ask_inductor_for_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """gpu_check's ``-cudagraphs`` rows: the same regions compiled with torch.compile's mode="reduce-overhead";
    ``-max-autotune`` rows: with mode="max-autotune-no-cudagraphs" (GEMM autotuning, fused epilogues);
    ``-fewer-launches`` rows: with the users' command's fewer_launches inductor settings, as options."""
    calls: list[dict[str, object]] = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kwargs: calls.append(kwargs))
    model = GPT(config_lib.from_dict({"model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 2,
                                                "seq_length": 16, "vocab_size": 64}}).model)
    gpu_check._compile(model, False, "regional-cudagraphs")
    assert calls == [{"backend": "inductor", "mode": "reduce-overhead"}] * 3  # two blocks and the head
    calls.clear()
    gpu_check._compile(model, False, "regional")
    assert calls == [{"backend": "inductor"}] * 3
    calls.clear()
    gpu_check._compile(model, False, "regional-max-autotune")
    assert calls == [{"backend": "inductor", "mode": "max-autotune-no-cudagraphs"}] * 3
    calls.clear()
    gpu_check._compile(model, False, "regional-fewer-launches")
    fewer = {"combo_kernels": True, "combo_kernel_per_subkernel_blocks": True, "triton.mix_order_reduction": False}
    assert calls == [{"backend": "inductor", "options": fewer}] * 3
    # the same settings as the users' command's variant sets them
    varied = config_lib.with_overrides(config_lib.load(REPO / users_command.USERS_CONFIG),
                                       list(users_command.USERS_VARIANTS["fewer_launches"]))
    assert inductor_settings(varied.train.compile_options) == fewer


def test_users_command_reads_metrics_and_warnings(tmp_path: Path) -> None:
    # train.py's rows: step 1 alone (the compile), then every log_interval
    rows = [{"step": 1, "loss": 9.9, "tokens_per_sec": 2000.0, "mfu": 0.004, "tflops": 4.0, "memory_gb": 11.9,
             "consumed_samples": 256},
            {"step": 4, "loss": 9.3, "tokens_per_sec": 100_000.0, "mfu": 0.2, "tflops": 200.0, "memory_gb": 14.6},
            {"step": 8, "loss": 8.3, "tokens_per_sec": 125_000.0, "mfu": 0.25, "tflops": 250.0, "memory_gb": 14.6}]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"step": 9, "lo')  # a torn last line
    summary = users_command.summarise_metrics(users_command.read_metrics(metrics), seq_length=512)
    assert summary["first_step_s"] == pytest.approx(256 * 512 / 2000.0)
    # time-weighted over steps 2-8: 3 steps at 100K and 4 at 125K tokens/s
    assert summary["tokens_per_sec"] == pytest.approx(7 / (3 / 100_000 + 4 / 125_000))
    assert summary["mfu"] == pytest.approx(0.25 / 125_000 * summary["tokens_per_sec"])
    assert (summary["steady_steps"], summary["peak_memory_gb"], summary["last_step"]) == ("2-8", 14.6, 8)
    profiled = [*rows, {"step": 9, "loss": 8.2, "tokens_per_sec": 90_000.0, "mfu": 0.18, "memory_gb": 15.0}]
    assert users_command.summarise_metrics(profiled, seq_length=512, through_step=8) == summary
    log = ("[2026-11-26 21:12:48,568] [WARNING] [runner.py:214:fetch_hostfile] Unable to find hostfile\n"
           "VENV/lib/torch/distributed/c10d_logger.py:83: UserWarning: barrier(): using the device\n"
           "  return func(*args, **kwargs)\n"
           "[rank0]:[W1126 21:13:03.258055474 ProcessGroupNCCL.cpp:5188] Guessing device ID based on global rank\n"
           "train:  4%|▍ | 1/24\rVENV/torch/_inductor/compile_fx.py:322: UserWarning: TensorFloat32 tensor cores\n"
           "  warnings.warn(\n"
           "  warnings.warn(\n"
           "step 4/24 | loss 9.3425\n")
    assert users_command.find_warnings(log) == [
        "c10d_logger.py:83: UserWarning: barrier(): using the device",
        "ProcessGroupNCCL.cpp:5188] Guessing device ID based on global rank",
        "compile_fx.py:322: UserWarning: TensorFloat32 tensor cores",
        "(message lost) warnings.warn("]


def test_users_command_row_carries_the_profiled_step(tmp_path: Path) -> None:
    from megatron_lite.training.profiling import ProfileSummary

    assert users_command.profile_fields(tmp_path) == {}  # no profile written: no fields
    summary = ProfileSummary(21, 21, 0, "cuda", wall_s=4.0, busy_s=3.0, by_kind_s={"gemm": 2.0, "other": 1.0})
    (tmp_path / "profile").mkdir()
    (tmp_path / "profile" / "steps_21_rank0.json").write_text(json.dumps(summary.__dict__))
    fields = users_command.profile_fields(tmp_path)
    assert fields["gpu_busy"] == 0.75
    assert fields["profile"] == "profiled step 21: GPU busy 75% of 4.00 s; kernel time: gemm 67%, other 33%"
    assert fields["profile_table"] == str(tmp_path / "profile" / "steps_21_rank0.txt")


def test_users_command_line_and_the_check_script(tmp_path: Path) -> None:
    arguments = users_command.users_arguments(Path("/d/mix.yml"), Path("/d/t.model"), 16000, tmp_path / "run",
                                              tmp_path / "cache", master_port=29555)
    assert arguments[1:6] == ["-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port"]
    assert arguments[arguments.index("--config") + 1] == str(REPO / "configs/coca_350m.yml")
    sets = [arguments[index + 1] for index, word in enumerate(arguments) if word == "--set"]
    # 20 measured steps, then one under the profiler; no final save (GBs, ~11 s of a short GPU call)
    assert {'data.mix="/d/mix.yml"', "model.vocab_size=16000", "train.train_iters=21", "train.log_interval=4",
            "train.eval_interval=0", "train.profile.start_step=21", "train.profile.steps=1",
            "train.profile.record_shapes=true", "train.profile.row_limit=80",
            "train.save_final=false"} <= set(sets)
    at_64 = users_command.users_arguments(Path("/d/mix.yml"), Path("/d/t.model"), 16000, tmp_path / "run",
                                          tmp_path / "cache", micro_batch=64)
    assert at_64[-2:] == ["--set", "train.train_micro_batch_size_per_gpu=64"]  # laid over the config: last
    assert at_64[:-2] == [word for word in arguments if word not in ("--master_port", "29555")]
    graphed = users_command.users_arguments(Path("/d/mix.yml"), Path("/d/t.model"), 16000, tmp_path / "run",
                                            tmp_path / "cache", micro_batch=16, variant="no_cuda_graphs")
    assert graphed[-4:] == ["--set", "train.train_micro_batch_size_per_gpu=16", "--set", "train.cuda_graphs=false"]
    wrapped = users_command.users_arguments(Path("/d/mix.yml"), Path("/d/t.model"), 16000, tmp_path / "run",
                                            tmp_path / "cache", variant="cpp_wrapper")
    assert wrapped[-2:] == ["--set", "train.compile_cpp_wrapper=true"]
    # a variant's setting shown as a shell would take it (fewer_launches' is a YAML mapping with spaces)
    (fewer,) = users_command.run_users_command(None, None, None, tmp_path / "shown", False, 60.0, print,
                                               micro_batch=16, variant="fewer_launches")
    assert shlex.split(fewer["command"])[-2:] == ["--set", *users_command.USERS_VARIANTS["fewer_launches"]]
    # a variant of several settings sets each, in order, after the micro batch
    both = users_command.users_arguments(Path("/d/mix.yml"), Path("/d/t.model"), 16000, tmp_path / "run",
                                         tmp_path / "cache", micro_batch=16, variant="fewer_launches_blocks_of_4")
    assert both[-6:] == ["--set", "train.train_micro_batch_size_per_gpu=16", "--set", users_command.FEWER_LAUNCHES,
                         "--set", "train.compile_blocks_per_region=4"]
    # a run the section's budget skips starts nothing, even with CUDA
    over = "skipped: the section passed its 240 s budget"
    (row,) = users_command.run_users_command(Path("/d/mix.yml"), Path("/d/t.model"), 16000, tmp_path / "work", True,
                                             60.0, print, micro_batch=32, skipped=over)
    assert row["status"] == over and row["micro_batch"] == 32
    assert not (tmp_path / "work").exists()
    script = REPO / "tools/gpu/check_gpu.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    # GPU_CHECK_PACK=1's packing: everything in results.tar.xz, each trace a file of its own
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    names = ["log.txt", "gpu_check.md", "sub/x.txt", "a_profile_steps_21_rank0.trace.json.gz", "b.trace.json.gz"]
    for name in names:
        (out / name).write_text(name)
    packing = subprocess.run(["bash", str(REPO / "tools/gpu/pack_results.sh"), str(out)], capture_output=True,
                             text=True)
    assert packing.returncode == 0, packing.stderr
    assert sorted(path.name for path in out.iterdir()) == ["a_profile_steps_21_rank0.trace.json.gz",
                                                          "b.trace.json.gz", "results.tar.xz"]
    with tarfile.open(out / "results.tar.xz") as archive:
        assert sorted(archive.getnames()) == ["gpu_check.md", "log.txt", "sub", "sub/x.txt"]
    usage = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    assert usage.returncode == 2 and usage.stderr.startswith("usage: bash tools/gpu/check_gpu.sh WHEELS_DIR BUNDLE OUT")


def _config_keys(section: type, prefix: str = "") -> set[str]:
    """Every dotted key of a config dataclass (sections and leaves), as --set names them."""
    keys: set[str] = set()
    hints = typing.get_type_hints(section)
    for name in section.__dataclass_fields__:
        keys.add(prefix + name)
        if hasattr(hints[name], "__dataclass_fields__"):
            keys |= _config_keys(hints[name], f"{prefix}{name}.")
    return keys


def test_the_acceptance_script_sets_only_keys_and_flags_that_exist(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """tools/gpu/acceptance.sh runs as it is on a GPU node, where a typo costs the job: every script of tools/gpu/
    is valid bash, every config key the acceptance script sets exists, and its gpu_check arguments parse."""
    for script in sorted((REPO / "tools/gpu").glob("*.sh")):
        assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0, script
    text = (REPO / "tools/gpu/acceptance.sh").read_text()
    config = config_lib.load(REPO / users_command.USERS_CONFIG)
    known = set()
    for section in ("model", "train", "data"):
        known |= _config_keys(type(getattr(config, section)), f"{section}.")
    keys = set(re.findall(r"\b((?:model|train|data)\.[a-z0-9_.]*[a-z0-9_])=", text))
    assert {"train.train_iters", "train.save_interval", "train.eval_interval", "model.vocab_size",
            "train.fp8"} <= keys
    assert not keys - known, keys - known
    (line,) = re.findall(r"tools/gpu_check\.py (--quick .*?) >", text.replace("\\\n", " "))
    arguments = shlex.split(line.replace('"${THROUGHPUT_FLAGS[@]}"', "--smoke").replace('"$MICRO"', "16")
                            .replace('"$WORK/twin_mb$MICRO"', str(tmp_path)))
    assert "--twin-loss" in arguments and "--no-board" in arguments
    arguments.remove("--no-board")
    # every argument parsed and checked; the board-only path then stops at the empty OUT
    code = load_script("tools/gpu_check.py").main([*arguments, "--board-only", "--board", str(tmp_path / "b.md")])
    assert code == EXIT_USER_ERROR and "holds no gpu_check.json" in capsys.readouterr().err


def test_the_twins_loss_compiled_with_it_is_the_same_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    """--twin-loss compiled: the twin and its float32 cross entropy as one module, compiled whole; the same step."""
    settings = gpu_check_settings.CheckSettings(out=Path("unused"), smoke=True, quick=True,
                                                twin_losses=gpu_check_settings.parse_twin_losses("eager,compiled"))
    runs = [run.label for run in gpu_check.throughput_runs(settings)]
    assert runs[-4:] == ["coca_slack compiled", "rope compiled", "hf_twin compiled",
                         "hf_twin compiled (loss compiled)"] or runs[-3:] == ["rope compiled", "hf_twin compiled",
                                                                               "hf_twin compiled (loss compiled)"]
    config = gpu_check.big_config(settings, "rope", precision="fp32")
    batch = torch.randint(0, config.model.vocab_size, (2, config.model.seq_length + 1))
    eager = gpu_check.build_for_throughput(config, True, torch.device("cpu"), False)
    wrapped = gpu_check.build_for_throughput(config, True, torch.device("cpu"), False, twin_loss="compiled")
    assert isinstance(wrapped, gpu_check.TwinWithLoss) and not isinstance(eager, gpu_check.TwinWithLoss)
    logits = eager(batch[:, :-1]).logits
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
    torch.testing.assert_close(wrapped(batch[:, :-1], batch[:, 1:]), expected)
    calls: list[torch.nn.Module] = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kwargs: calls.append(self))
    gpu_check._compile(wrapped, True, "regional")
    assert calls == [wrapped]  # the wrapper, loss and all, not the twin alone
    with pytest.raises(ValueError, match="--twin-loss eager,jit: unknown value"):
        gpu_check_settings.parse_twin_losses("eager,jit")


def test_acceptance_summaries_read_resumed_runs_and_the_twins_rows(tmp_path: Path) -> None:
    """A resumed run's metrics.jsonl logs its steps after the checkpoint again: the resumed values count; the
    vocab summary divides the users' tokens/s by each compiled row's."""
    from megatron_lite.bench import gpu_check_acceptance as acceptance

    def write_run(name: str, rows: list[dict[str, float]]) -> Path:
        run = tmp_path / name
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        (run / "config.yml").write_text("model:\n  seq_length: 512\n")
        return run

    step = {"tokens_per_sec": 1000.0}
    killed = write_run("killed", [{"step": 1, "loss": 9.0, **step}, {"step": 2, "loss": 8.0, **step},
                                  {"step": 3, "loss": 7.5, **step},  # past the save at 2: logged, then killed
                                  {"step": 3, "loss": 7.0, **step}, {"step": 4, "loss": 6.5, **step}])
    reference = write_run("reference", [{"step": 1, "loss": 9.0, **step}, {"step": 2, "loss": 8.0, **step},
                                        {"step": 3, "loss": 7.01, **step}, {"step": 4, "loss": 6.48, **step}])
    report = acceptance.resume_report(killed, reference, resumed_from=2)
    assert report["after_the_resume"]["steps"] == [3, 4] and report["before_the_kill"]["max_abs_diff"] == 0
    assert report["after_the_resume"]["max_abs_diff"] == pytest.approx(0.02)
    assert "max abs difference 0.02 over steps 3-4" in acceptance.resume_markdown(report)

    gpu_check_json = tmp_path / "gpu_check.json"
    gpu_check_json.write_text(json.dumps({"throughput": {"rows": [
        {"model": "rope", "mode": "eager", "tokens_per_sec": 100.0},
        {"model": "hf_twin", "mode": "compiled", "twin_loss": "eager", "status": "ok", "micro_batch": 16,
         "tokens_per_sec": 500.0},
        {"model": "hf_twin", "mode": "compiled", "twin_loss": "compiled", "status": "ok", "micro_batch": 16,
         "tokens_per_sec": 800.0}]}}))
    runs = acceptance.runs_report([("users", reference), ("other", killed)], {"users": gpu_check_json})
    assert [row["run"] for row in runs["runs"]] == ["users", "other"]
    assert runs["runs"][1]["max_abs_loss_diff"] == pytest.approx(0.02)
    assert [(row["row"], row["run_over_row"]) for row in runs["throughput"]] == [
        ("hf_twin (loss eager)", 2.0), ("hf_twin (loss compiled)", 1.25)]
    assert "| users | hf_twin (loss compiled) | ok | 16 | 800 | 1.25 |" in acceptance.runs_markdown(runs)
