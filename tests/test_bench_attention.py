"""The attention benchmark on a tiny layer (seconds), and the CPU peak-memory tracker it relies on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_lite.bench import attention_bench
from megatron_lite.bench.attention_bench import (
    DTYPES,
    GB,
    METRIC_KEYS,
    SCHEMES,
    BenchSettings,
    estimate_peak_bytes,
    format_report,
    run_benchmark,
)
from megatron_lite.bench.memory import track_peak_memory
from script_loading import load_script

MiB = 2**20
RECORD_KEYS = {"scheme", "backend", "seq_len", *METRIC_KEYS, "skipped"}
TINY = dict(hidden_size=64, num_heads=4, seq_lens=(32, 64), backends=("sdpa", "chunked", "reference"),
            repeats=1, warmup=0, device="cpu", chunk_size=16)


# ----------------------------------------------------------------------------------------------
# Memory tracker


def test_tracker_counts_a_known_allocation() -> None:
    with track_peak_memory() as tracker:
        zeros = torch.zeros(1024, 1024)  # 4 MiB float32
    assert tracker.peak_bytes == 4 * MiB
    with track_peak_memory() as tracker:
        empty = torch.empty(1024, 1024)
        empty.fill_(1.0)  # in place: no new storage
    assert tracker.peak_bytes == 4 * MiB
    del zeros, empty


def test_tracker_releases_freed_temporaries() -> None:
    with track_peak_memory() as tracker:
        for _ in range(20):
            temporary = torch.ones(256, 1024)  # 1 MiB, the previous one freed on reassignment
            del temporary
        for _ in range(20):
            temporary = torch.ones(256, 1024) * 2  # the ones and the product alive at once
            del temporary
    assert tracker.peak_bytes == 2 * MiB  # not 20 or 40 MiB
    assert tracker.live_bytes == 0


def test_tracker_counts_views_once_and_ignores_the_baseline() -> None:
    existing = torch.randn(256, 1024)  # allocated before tracking: the baseline
    with track_peak_memory() as tracker:
        base = torch.zeros(256, 1024)  # 1 MiB
        views = [base.view(-1), base[:, ::2], base.t(), base.unsqueeze(0)]
        existing.add_(1.0)
        existing_views = [existing.view(-1), existing.t(), existing.detach()]
    assert tracker.peak_bytes == MiB
    del base, views, existing_views
    assert tracker.live_bytes == 0


def test_tracker_sees_backward() -> None:
    """Ops the autograd engine runs inside the region (CPU backward is on this thread) are counted."""
    torch.manual_seed(0)
    weights = [torch.randn(256, 256, requires_grad=True) for _ in range(4)]  # 256 KiB each
    x = torch.randn(256, 256)

    def chain() -> torch.Tensor:
        y = x
        for weight in weights:
            y = torch.tanh(y @ weight)
        return y

    with torch.no_grad(), track_peak_memory() as inference:
        chain()
    with track_peak_memory() as training:
        chain().sum().backward()
    assert training.peak_bytes > inference.peak_bytes
    # The weight grads were allocated by the backward pass and are still alive.
    assert training.live_bytes == sum(weight.grad.untyped_storage().nbytes() for weight in weights)


# ----------------------------------------------------------------------------------------------
# Benchmark


@pytest.fixture(scope="module")
def tiny_result() -> attention_bench.BenchResult:
    return run_benchmark(BenchSettings(**TINY))


def test_records_complete_with_rope_ratios_one(tiny_result: attention_bench.BenchResult) -> None:
    records = tiny_result.records
    assert len(records) == len(SCHEMES) * 3 * 2
    assert {(r["scheme"], r["backend"], r["seq_len"]) for r in records} == {
        (s, b, n) for s in SCHEMES for b in TINY["backends"] for n in TINY["seq_lens"]
    }
    for record in records:
        assert RECORD_KEYS <= record.keys()
        assert record["skipped"] is None, record
        assert record["time_ms"] > 0 and record["peak_mem_mb"] > 0 and record["infer_peak_mem_mb"] > 0
        # A training step keeps activations for backward and allocates grads: never less than inference.
        assert record["peak_mem_mb"] >= record["infer_peak_mem_mb"]
        if record["scheme"] == "rope":
            assert record["time_ratio_vs_rope"] == 1.0
            assert record["mem_ratio_vs_rope"] == 1.0
            assert record["infer_mem_ratio_vs_rope"] == 1.0
    meta = tiny_result.meta
    assert meta["device"] == "cpu" and meta["torch_version"] == torch.__version__ and meta["num_threads"] >= 1
    json.dumps(tiny_result.to_json())  # serialisable as is


def test_report_has_table_and_target_checks(tiny_result: attention_bench.BenchResult) -> None:
    report = format_report(tiny_result)
    assert "| scheme | backend | seq | fwd+bwd ms | ×RoPE | train peak MB | ×RoPE | infer peak MB | ×RoPE |" in report
    assert report.count("| coca_strict | sdpa |") == len(TINY["seq_lens"])  # one results row per length
    for seq_len in TINY["seq_lens"]:
        assert f"| coca_slack | {seq_len} |" in report  # its target-check row
    assert "target check:" in report and ("PASS" in report or "FAIL" in report)


def test_tiny_budget_skips_reference_before_running(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = dict(TINY, seq_lens=(64,), backends=("sdpa", "reference"))
    dtype = DTYPES["fp32"]

    def estimate(label: str, backend: str) -> int:
        return estimate_peak_bytes(label, backend, 1, 64, 64, 4, dtype, 16)

    # Above every non-ALiBi sdpa estimate, below every reference one.
    budget = max(estimate(label, "sdpa") for label in ("rope", "coca_slack", "coca_strict"))
    assert budget < min(estimate(label, "reference") for label in SCHEMES)
    calls: list[str] = []
    original = attention_bench.train_step
    monkeypatch.setattr(attention_bench, "train_step", lambda module, scheme, *rest: (
        calls.append(type(scheme).__name__), original(module, scheme, *rest))[1])
    result = run_benchmark(BenchSettings(**settings, mem_budget_gb=budget / GB))
    for record in result.records:
        assert RECORD_KEYS <= record.keys()
        if record["backend"] == "reference":
            assert "budget" in record["skipped"]
            assert all(record[key] is None for key in METRIC_KEYS)
        elif record["scheme"] != "alibi":
            assert record["skipped"] is None and record["time_ratio_vs_rope"] is not None
    assert len(result.records) == len(SCHEMES) * 2  # skipped rows are reported, not dropped
    ran = sum(record["skipped"] is None for record in result.records)
    assert len(calls) == 2 * ran  # one timed + one memory step each; skipped ones never ran


def test_runtime_error_becomes_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    original = attention_bench.train_step

    def failing(module, scheme, rotary, x_BNC):  # type: ignore[no-untyped-def]
        if type(scheme).__name__ == "CoCAStrict":
            raise RuntimeError("simulated out of memory")
        return original(module, scheme, rotary, x_BNC)

    monkeypatch.setattr(attention_bench, "train_step", failing)
    result = run_benchmark(BenchSettings(**dict(TINY, seq_lens=(32,), backends=("sdpa",))))
    by_scheme = {record["scheme"]: record for record in result.records}
    assert by_scheme["coca_strict"]["skipped"] == "RuntimeError: simulated out of memory"
    assert all(by_scheme["coca_strict"][key] is None for key in METRIC_KEYS)
    assert by_scheme["coca_slack"]["skipped"] is None and by_scheme["rope"]["time_ratio_vs_rope"] == 1.0


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"seq_lens": (0,)}, "seq_lens"),
        ({"repeats": 0}, "repeats"),
        ({"backends": ("sdpa", "fast")}, "backend"),
        ({"backends": ("flash",)}, "flash"),
        ({"num_heads": 5}, "num_attention_heads"),
        ({"dtype": "fp8"}, "dtype"),
        ({"mem_budget_gb": 0.0}, "mem_budget_gb"),
    ],
)
def test_bad_settings_raise_value_error(overrides: dict, match: str) -> None:
    if overrides.get("backends") == ("flash",) and torch.cuda.is_available():
        pytest.skip("flash may be usable here")
    with pytest.raises(ValueError, match=match):
        run_benchmark(BenchSettings(**dict(TINY, **overrides)))


def test_cli_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cli = load_script("tools/bench_attention.py")
    out = tmp_path / "bench.json"
    argv = ["--json", str(out), "--seq-lens", "32", "--backends", "sdpa", "--hidden-size", "64", "--num-heads", "4",
            "--repeats", "1", "--warmup", "0", "--device", "cpu"]
    assert cli.main(argv) == 0
    data = json.loads(out.read_text())
    assert [record["scheme"] for record in data["records"]] == list(SCHEMES)
    assert data["meta"]["torch_version"] == torch.__version__
    assert "| rope | sdpa | 32 |" in capsys.readouterr().out
    assert cli.main(["--seq-lens", "32", "--num-heads", "5", "--hidden-size", "64", "--device", "cpu"]) == 2


# ----------------------------------------------------------------------------------------------
# flex


@pytest.mark.parametrize("available", [True, False])
def test_default_backends_include_flex_when_available(monkeypatch: pytest.MonkeyPatch, available: bool) -> None:
    monkeypatch.setattr(attention_bench, "flex_available", lambda: available)
    backends = attention_bench.default_backends(torch.device("cpu"))
    assert backends[:3] == ("sdpa", "chunked", "reference")
    assert ("flex" in backends) is available


def test_flex_estimate_is_quadratic_on_cpu_only() -> None:
    dtype = DTYPES["fp32"]

    def estimate(label: str, backend: str, seq_len: int, device: str = "cpu") -> int:
        return estimate_peak_bytes(label, backend, 1, seq_len, 1024, 16, dtype, 1024, device)

    # CPU flex training materialises (B, H, N, N) scores: at 8192 far above the 8 GB CPU budget,
    # like the reference backend and unlike sdpa.
    for label in SCHEMES:
        assert estimate(label, "flex", 8192) > attention_bench.CPU_MEM_BUDGET_GB * GB
        assert estimate(label, "flex", 8192) >= 4 * 16 * 8192**2 * 4
        assert estimate(label, "flex", 8192, "cuda") < estimate(label, "sdpa", 8192) + 2**20  # fused: linear
    assert estimate("rope", "sdpa", 8192) < attention_bench.CPU_MEM_BUDGET_GB * GB
    assert estimate("alibi", "flex", 2048) > estimate("rope", "flex", 2048)  # the score_mod's bias


def test_flex_rows_on_cpu_and_budget_skip() -> None:
    pytest.importorskip("torch.nn.attention.flex_attention")
    settings = dict(TINY, seq_lens=(32, 64), backends=("sdpa", "flex"))
    big = estimate_peak_bytes("rope", "flex", 1, 64, 64, 4, DTYPES["fp32"], 16)
    small = estimate_peak_bytes("alibi", "flex", 1, 32, 64, 4, DTYPES["fp32"], 16)
    assert small < big
    result = run_benchmark(BenchSettings(**settings, mem_budget_gb=(small + big) / 2 / GB))
    flex = {(r["scheme"], r["seq_len"]): r for r in result.records if r["backend"] == "flex"}
    assert set(flex) == {(s, n) for s in SCHEMES for n in (32, 64)}
    for (scheme, seq_len), record in flex.items():
        assert RECORD_KEYS <= record.keys()
        if seq_len == 64:
            assert "budget" in record["skipped"]  # estimated above the budget: never run
        else:
            assert record["skipped"] is None, record
            assert record["time_ms"] > 0 and record["peak_mem_mb"] > 0
            assert record["infer_peak_mem_mb"] is None  # CPU flex inference: not trackable
            # measured below the estimate (which errs high)
            assert record["peak_mem_mb"] * MiB <= record["estimated_peak_mb"] * MiB
    assert "| rope | flex | 32 |" in format_report(result)
