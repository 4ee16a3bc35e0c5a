"""The step census (dev/step_census.py) counts known tiny cases exactly: GEMM FLOPs by
operand dtype, SDPA FLOPs apart, sync-class operations (item, nonzero, host-to-device copies), per phase;
census_bench's table for our schemes and the HF twin on meta; compile_time's worker at toy size with the
dynamo-only "eager" backend (the inductor comparison itself is a benchmark, not a test); compiled_bytes'
inductor count at toy size; dev/cpu_figures.py's flags reach their settings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import tiny_config
from dev.census_bench import HF_TWIN, CensusSettings, format_census, run_census
from dev.compile_time import CompileTimeSettings, _summary, format_compile_time, measure_in_process, worker_env
from dev.step_census import HOST_TO_DEVICE, census_step, traffic_bytes
from megatron_lite import config as config_lib
from script_loading import REPO


class TwoGemms(nn.Module):
    """One float32 GEMM (4x8 @ 8x16) and one bf16 GEMM (4x16 @ 16x4); optionally an ``.item()``, a
    ``nonzero`` and a host tensor copied to the device in forward."""

    def __init__(self, syncs: bool = False) -> None:
        super().__init__()
        self.w32 = nn.Parameter(torch.randn(8, 16))
        self.w16 = nn.Parameter(torch.randn(16, 4, dtype=torch.bfloat16))
        self.syncs = syncs

    def forward(self, ids_BT: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = torch.ones(4, 8, device=ids_BT.device)  # no grad: only w32's gradient GEMM in backward
        h = x @ self.w32  # fp32: 2*4*8*16 = 1024 FLOPs; backward dW32 = x^T @ g: 1024
        out = h.to(torch.bfloat16) @ self.w16  # bf16: 2*4*16*4 = 512; backward dh and dW16: 512 each
        loss = out.float().sum()
        if self.syncs:
            if float(loss.detach()) > 1e30:  # one item
                loss = loss * 0
            torch.nonzero(ids_BT)
            loss = loss + torch.arange(3.0).to(ids_BT.device).sum() * 0  # a host tensor into the device
        return loss


def test_flop_shares_by_operand_dtype_and_phase() -> None:
    census = census_step(TwoGemms(), torch.zeros(1, 5, dtype=torch.long))
    forward, backward = census.phases["forward"], census.phases["backward"]
    assert dict(forward.gemm_flops) == {"float32": 1024, "bfloat16": 512}
    assert dict(backward.gemm_flops) == {"float32": 1024, "bfloat16": 1024}
    assert census.gemm_flops == 3584 and census.fp32_gemm_flops == 2048
    assert census.fp32_share == pytest.approx(2048 / 3584)
    assert census.sync_count == 0 and census.sdpa_flops == 0
    assert census.dispatched_ops == forward.dispatched_ops + backward.dispatched_ops > 6
    assert 0 < census.non_view_ops == census.dispatched_ops - forward.view_ops - backward.view_ops


def test_sync_ops_counted_in_forward_and_host_copies_only_off_the_cpu() -> None:
    ids = torch.ones(1, 5, dtype=torch.long)
    on_cpu = census_step(TwoGemms(syncs=True), ids)
    assert dict(on_cpu.phases["forward"].sync_ops) == {"_local_scalar_dense": 1, "nonzero": 1}
    assert not on_cpu.phases["backward"].sync_ops
    assert on_cpu.sync_count == 2  # the host is the device: a copy from it is no copy
    with torch.device("meta"):
        model = TwoGemms(syncs=True)
    on_meta = census_step(model, ids.to("meta"))  # item and nonzero answered by stand-ins
    assert dict(on_meta.sync_ops) == {"_local_scalar_dense": 1, "nonzero": 1, HOST_TO_DEVICE: 1}
    assert on_meta.fp32_share == pytest.approx(on_cpu.fp32_share)
    with pytest.raises(ValueError, match="census on cpu: the model is on meta"):
        census_step(model, ids, device="cpu")


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_memory_traffic_of_the_operators_that_are_not_gemms(device: str) -> None:
    class Elementwise(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.x = nn.Parameter(torch.randn(4, 8))  # 128 bytes
            self.bias = nn.Parameter(torch.randn(8))  # 32 bytes, broadcast over rows

        def forward(self, ids_BT: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            y = self.x * 2  # reads 128, writes 128
            y = y + self.bias  # reads 128 + 32, writes 128
            y = y @ torch.ones(8, 8, device=y.device)  # a GEMM: not counted (ones writes 256)
            picked = y.gather(1, torch.zeros(4, 1, dtype=torch.long, device=y.device))  # ids 32, moves 2 x 16
            return picked.t().sum()  # t is a view; sum reads 16, writes 4

    with torch.device(device):
        model = Elementwise()
    census = census_step(model, torch.zeros(1, 5, dtype=torch.long, device=device))
    forward = census.phases["forward"].traffic
    assert {name: forward[name] for name in ("mul", "add", "gather", "sum")} == {
        "mul": 256, "add": 288, "gather": 64, "sum": 20}
    assert "mm" not in forward and "t" not in forward and forward["ones"] == 256 and forward["zeros"] == 32
    assert census.traffic_bytes == sum(forward.values()) + sum(census.phases["backward"].traffic.values())
    source, out = torch.ones(4, 1), torch.empty(4, 1)  # an out= operand is written, not read
    assert traffic_bytes("neg", (source,), {"out": out}, torch.neg(source, out=out)) == 32


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_sdpa_flops_counted_apart(device: str) -> None:
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = nn.Parameter(torch.randn(1, 2, 8, 4))

        def forward(self, ids_BT: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(self.q, self.q, self.q, is_causal=True).sum()

    with torch.device(device):
        model = Attention()
    census = census_step(model, torch.zeros(1, 5, dtype=torch.long, device=device))
    # B*H*T*S*D = 1*2*8*8*4 = 512: forward 4x, backward 8x; meta takes CUDA's fused kernel, not bmm
    assert dict(census.phases["forward"].sdpa_flops) == {"float32": 2048}
    assert dict(census.phases["backward"].sdpa_flops) == {"float32": 4096}
    assert census.gemm_flops == 0


def test_census_table_for_our_schemes_and_the_hf_twin(tmp_path: Path) -> None:
    path = tmp_path / "tiny.yml"
    config_lib.save(tiny_config("rope"), path)
    settings = CensusSettings(config_path=str(path), devices=["meta"], schemes=["rope", "alibi"])
    rows = run_census(settings, progress=lambda line: None)
    assert [(row["model"], row["scheme"]) for row in rows] == [("ours", "rope"), ("ours", "alibi"), (HF_TWIN, "rope")]
    twin = rows[-1]
    assert twin["fp32_share"] == 0.0 and twin["gemm"] is None  # bf16 logits, float32 cross entropy
    assert all(row["gemm_flops"] > 0 and row["sdpa_flops"] > 0 and row["dispatched_ops"] > 0 for row in rows)
    report = format_census(rows, settings)
    assert "| meta | ours | rope |" in report and "meta rope" in report and f"/ {HF_TWIN}:" in report


def test_compile_time_worker_at_toy_size() -> None:
    settings = CompileTimeSettings(layers=2, hidden=32, heads=2, seq_length=16, vocab=128, batch_size=2, steps=1,
                                   backend="eager")
    torch._dynamo.reset()
    try:
        row = measure_in_process(settings, "regional")
    finally:
        torch._dynamo.reset()
    assert row["mode"] == "regional" and row["first_step_s"] > 0 and 0 < row["forward_backward_ms"] < row["step_ms"]
    env = worker_env("/tmp/x")
    assert env["TORCHINDUCTOR_FX_GRAPH_CACHE"] == "0" and env["TORCHINDUCTOR_AUTOGRAD_CACHE"] == "0"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == env["TMPDIR"] == "/tmp/x"
    summary = _summary([row, row])
    assert summary["runs"] == 2 and summary["first_step_s"] == summary["first_step_min_s"] == row["first_step_s"]
    result = {"settings": settings.__dict__, "ratios": {"first_step_whole_over_regional": 4.0,
                                                        "first_step_cpu_whole_over_regional": 3.5,
                                                        "step_regional_over_whole": 1.01},
              "rows": [{**summary, "mode": mode} for mode in ("whole", "regional")]}
    report = format_compile_time(result)
    assert "first step whole / regional: 4.00x wall, 3.50x CPU time (target >= 3x: PASS)" in report
    result["ratios"].update(step_regional_over_cpp_wrapper=1.25, forward_backward_regional_over_cpp_wrapper=1.4,
                            first_step_cpp_wrapper_over_regional=1.5)
    assert ("compiled step regional / regional-cpp-wrapper: 1.25x, forward + backward 1.40x (> 1: the C++ wrapper "
            "saves host time); its first step 1.50x regional's") in format_compile_time(result)
    with pytest.raises(ValueError, match="^compile-time mode regional-cpp-wrapper: the C\\+\\+ wrapper is inductor's"):
        measure_in_process(settings, "regional-cpp-wrapper")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # the process's counts so far
    try:
        grouped = measure_in_process(settings, "regional-blocks-2")  # both blocks one region: one graph, and the head's
    finally:
        torch._dynamo.reset()
    assert grouped["dynamo"]["unique_graphs"] == 2 and grouped["forward_backward_ms"] > 0
    result["rows"].append({**summary, "mode": "regional-blocks-2"})
    result["ratios"].update({"forward_backward_regional_over_regional-blocks-2": 1.26,
                             "first_step_regional-blocks-2_over_regional": 1.3})
    assert ("forward + backward regional / regional-blocks-2: 1.26x (> 1: fewer region calls save host time); its "
            "first step 1.30x regional's") in format_compile_time(result)


@pytest.mark.slow
def test_the_count_lowers_a_concatenation_as_a_gpu_does() -> None:
    """The rotary's ``x * cos + rotate_half(x) * sin``: one fused kernel, as inductor's GPU backend makes it (its CPU
    backend would copy the concatenation's two inputs with two kernels of their own first)."""
    from dev.compiled_bytes import inductor_counting
    from megatron_lite.model.rope import rotate_half

    x_BHTD, cos_TD, sin_TD = torch.randn(1, 2, 8, 16), torch.randn(8, 16), torch.randn(8, 16)
    with inductor_counting() as metrics:
        rotated = torch.compile(lambda x, c, s: x * c + rotate_half(x) * s)(x_BHTD, cos_TD, sin_TD)
        assert metrics.generated_kernel_count == 1
    torch.testing.assert_close(rotated, x_BHTD * cos_TD + rotate_half(x_BHTD) * sin_TD)


@pytest.mark.slow
def test_compiled_bytes_per_layer_and_rest() -> None:
    """Inductor's count, whole-model compiles of the tiny model at one and two layers, ours and the HF twin: every
    figure positive, one block's bytes within a factor of two of the twin's block (same GEMMs, same fused
    elementwise work), the table and ratio lines printed. And ``--compiled-bytes-kernels``: the block compiled as
    one region, as training compiles it, lists its kernels forward then backward, GEMMs and attention as extern
    calls, and they move what one layer of the whole-model compile moves."""
    from dev.compiled_bytes import (
        CompiledBytesSettings,
        block_kernels,
        format_block_kernels,
        format_compiled_bytes,
        run_compiled_bytes,
    )

    config_path = str(Path(__file__).parents[1] / "configs/tiny/rope.yml")
    settings = CompiledBytesSettings(config_path=config_path, schemes=["rope"], batch_size=1, depths=(1, 2))
    rows = run_compiled_bytes(settings, progress=lambda line: None)
    ours, twin = rows
    assert (ours["model"], twin["model"]) == ("ours", HF_TWIN)
    for row in rows:
        assert row["layer_bytes_per_token"] > 0 and row["layer_kernels"] >= 1 and row["rest_bytes_per_token"] > 0
    assert 0.5 < ours["layer_bytes_per_token"] / twin["layer_bytes_per_token"] < 2
    report = format_compiled_bytes(rows, settings)
    assert "| ours | rope |" in report and f"rope / {HF_TWIN}: per layer" in report
    with pytest.raises(ValueError, match="depths"):
        CompiledBytesSettings(depths=(2, 2)).validate()

    kernels = block_kernels("rope", settings)
    assert [row["pass"] for row in kernels] == sorted((row["pass"] for row in kernels),
                                                      key=["forward", "backward"].index)
    extern = {(row["pass"], operator) for row in kernels if row["kind"] == "extern"
              for operator in row["operators"].split(",")}
    assert {("forward", "addmm"), ("backward", "mm")} <= extern
    assert any("attention" in operator for _, operator in extern)
    assert 0.8 < sum(row["bytes_per_token"] for row in kernels) / ours["layer_bytes_per_token"] < 1.2
    assert "| forward | generated |" in format_block_kernels("rope", kernels, settings)


def test_cpu_figures_flags(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """python -m dev.cpu_figures: --census, --compiled-bytes, --compile-time and --grad-sums reach their settings (the
    runs themselves: the tests above); a bad value, or no flag, is one error line."""
    from dev import cpu_figures as cli

    seen: dict[str, object] = {}

    def census(settings: object, progress: object) -> list:
        seen["census"] = settings
        return []

    def compile_time(settings: object, progress: object) -> dict:
        seen["compile_time"] = settings
        return {"settings": settings.__dict__, "rows": [], "ratios": {}}

    def compiled_bytes(settings: object, progress: object) -> list:
        seen["compiled_bytes"] = settings
        return []

    def grad_sums(settings: object, progress: object) -> list:
        seen["grad_sums"] = settings
        return []

    monkeypatch.setattr(cli, "run_grad_sums", grad_sums)
    monkeypatch.setattr(cli, "format_grad_sums", lambda rows, settings: "grad sums table\n")
    monkeypatch.setattr(cli, "run_census", census)
    monkeypatch.setattr(cli, "run_compiled_bytes", compiled_bytes)
    monkeypatch.setattr(cli, "run_compile_time", compile_time)
    monkeypatch.setattr(cli, "format_census", lambda rows, settings: "census table\n")
    assert cli.main(["--census", "--census-devices", "meta", "--census-gemm", "mixed", "fp32", "--compile-time",
                     "--compile-layers", "2", "--compile-backend", "eager", "--compile-modes", "whole,regional",
                     "--compiled-bytes", "--compiled-bytes-schemes", "coca_strict",
                     "--compiled-bytes-batch-size", "3", "--grad-sums", "--grad-sums-set", "model.num_layers=2",
                     "--grad-sums-accumulation", "2"]) == 0
    assert (seen["grad_sums"].overrides, seen["grad_sums"].accumulation) == (["model.num_layers=2"], 2)
    assert (seen["compiled_bytes"].schemes, seen["compiled_bytes"].batch_size) == (["coca_strict"], 3)
    assert seen["census"].devices == ["meta"] and seen["census"].gemms == ["mixed", "fp32"]
    assert seen["census"].precision == "bf16" and seen["census"].schemes == ["rope", "coca_slack", "coca_strict", "alibi"]
    compile_settings = seen["compile_time"]
    assert (compile_settings.layers, compile_settings.hidden, compile_settings.backend) == (2, 128, "eager")
    assert compile_settings.modes == ["whole", "regional"]
    assert "census table" in (out := capsys.readouterr().out) and "grad sums table" in out
    assert cli.main(["--compile-time", "--compile-modes", "whole,bogus"]) == 2  # one error line, nothing run
    assert cli.main(["--census", "--census-devices", "tpu"]) == 2
    assert cli.main(["--compiled-bytes", "--compiled-bytes-batch-size", "0"]) == 2
    assert cli.main(["--grad-sums", "--grad-sums-micro-batches", "1"]) == 2
    assert cli.main([]) == 2
    errors = capsys.readouterr().err
    assert "--grad-sums-micro-batches 1: must be >= 2" in errors
    assert "--compile-modes 'whole,bogus'" in errors and "--census-devices 'tpu'" in errors
    assert "--compiled-bytes-batch-size 0" in errors and "error: nothing to run" in errors
    assert all(line.startswith("error: ") for line in errors.splitlines()), errors


def test_dev_is_not_installed() -> None:
    """pyproject's package discovery finds megatron_lite's packages only: dev/ stays out of the wheel."""
    from setuptools import find_packages

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = find_packages(where=str(REPO), include=include)
    assert "megatron_lite.bench" in packages and all(name.startswith("megatron_lite") for name in packages), packages
    assert (REPO / "dev" / "step_census.py").is_file() and "dev" not in packages
