"""The GEMMs-by-shape table (training/gemm_shapes.py, tools/gemm_table.py): from a CPU profile recorded here, and from
GPU trace events as the H200 wrote them (Run 4's users' command, 2026-11-28: operators, their kernels, a kernel
replayed from a CUDA graph)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from megatron_lite.cli import EXIT_USER_ERROR
from megatron_lite.training.gemm_shapes import format_table, gemm_table, read_trace, shape_of
from script_loading import load_script

# Copied from Run 4's trace (users_command_micro_batch_16_profile_steps_21_rank0.trace.json.gz): the QKV projection's
# addmm and the LM head's first chunk (aten::mm.dtype: bf16 operands, float32 logits), each with the kernel it launched
H200_EVENTS = [
    {"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "ts": 0.0, "dur": 255.335,
     "args": {"External id": 33, "Input Dims": [[3072], [8192, 1024], [1024, 3072], [], [], [8192, 3072]],
              "Input type": ["c10::BFloat16", "c10::BFloat16", "c10::BFloat16", "Scalar", "Scalar", "c10::BFloat16"]}},
    {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_bias_TNT", "ts": 240.0,
     "dur": 75.392, "args": {"External id": 33}},
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 400.0, "dur": 127.568,
     "args": {"External id": 593, "Input Dims": [[4096, 1024], [1024, 16000], [], [4096, 16000]],
              "Input type": ["c10::BFloat16", "c10::BFloat16", "Scalar", "float"]}},
    {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_tss_192x192_64x4_2x1_v_bz_coopB_TNN", "ts": 500.0,
     "dur": 213.566, "args": {"External id": 593}},
    # a GEMM replayed from a CUDA graph: launched by cudaGraphLaunch, no aten operator
    {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "ts": 900.0,
     "dur": 70.0, "args": {"External id": 9999}},
    {"ph": "X", "cat": "kernel", "name": "triton_poi_fused_add_0", "ts": 980.0, "dur": 5.0,
     "args": {"External id": 33}},  # a non-GEMM kernel under the addmm (a bias broadcast, say): counted with it
]


def test_gpu_trace_rows_are_timed_by_the_kernels_each_operator_launched() -> None:
    trace = {"traceEvents": H200_EVENTS, "deviceProperties": [{"id": 0, "name": "NVIDIA H200"}]}
    table = gemm_table(trace)
    assert (table.device, table.timed_by) == ("NVIDIA H200", "kernels")
    head, qkv = table.rows  # longest first
    assert (head.shape.label(), head.shape.dtype, head.calls) == ("mm 4096 x 1024 x 16000", "bf16->fp32", 1)
    assert head.seconds == pytest.approx(213.566e-6)
    assert (qkv.shape.label(), qkv.shape.dtype, qkv.shape.flops) == ("addmm 8192 x 1024 x 3072", "bf16",
                                                                    2 * 8192 * 1024 * 3072)
    assert qkv.seconds == pytest.approx(80.392e-6)
    assert (table.unattributed_calls, table.unattributed_s) == (1, pytest.approx(70e-6))
    text = format_table(table, per=1, peak_tflops=989.0)
    # 2 * 4096 * 1024 * 16000 FLOPs in 213.566 us: 628.5 TFLOP/s, 64% of 989
    assert "| mm 4096 x 1024 x 16000 | bf16->fp32 | 1 | 0.21 | 628.5 | 64% |" in text
    assert "1 GEMM kernels (0.07 ms) launched by no recorded GEMM operator" in text


def test_cpu_profile_rows_match_the_products_taken(tmp_path: Path) -> None:
    a, b, bias, batch = torch.randn(64, 32), torch.randn(32, 16), torch.randn(16), torch.randn(4, 64, 32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profiler:
        for _ in range(3):
            torch.mm(a, b)
        torch.nn.functional.linear(a, b.t(), bias)  # aten::linear -> aten::addmm: counted once
        torch.matmul(batch, b)  # folded into one aten::mm of 256 rows
        torch.bmm(batch, batch.transpose(1, 2))
    path = tmp_path / "trace.json"
    profiler.export_chrome_trace(str(path))
    table = gemm_table(read_trace(path))
    assert (table.device, table.timed_by, table.unattributed_calls) == ("cpu", "operators", 0)
    calls = {row.shape.label(): (row.calls, row.shape.dtype) for row in table.rows}
    assert calls == {"mm 64 x 32 x 16": (3, "fp32"), "addmm 64 x 32 x 16": (1, "fp32"),
                     "mm 256 x 32 x 16": (1, "fp32"), "bmm 4 x 64 x 32 x 64": (1, "fp32")}
    assert all(row.seconds > 0 for row in table.rows)
    text = format_table(table, per=2, per_label="per step")
    assert text.startswith("GEMMs by shape (cpu; time: each operator's own, ms per step)")
    assert "| mm 64 x 32 x 16 | fp32 | 1.5 |" in text and "of peak" not in text


def test_an_eager_float32_output_gemm_is_named_by_its_out_dtype() -> None:
    """Eager ``torch.mm(a, b, out_dtype=torch.float32)`` on CUDA: no output tensor recorded, the ScalarType code is."""
    args = {"Input Dims": [[4096, 1024], [1024, 16000], []], "Input type": ["c10::BFloat16", "c10::BFloat16", "Scalar"],
            "Concrete Inputs": ["", "", "6"]}
    assert shape_of("aten::mm", args).dtype == "bf16->fp32"
    plain_addmm = {"Input Dims": [[16], [64, 32], [32, 16], [], []], "Concrete Inputs": ["", "", "", "1", "1"],
                   "Input type": ["float", "float", "float", "Scalar", "Scalar"]}  # beta, alpha: not dtypes
    assert shape_of("aten::addmm", plain_addmm).dtype == "fp32"


def test_shapes_only_for_gemms_recorded_with_their_inputs() -> None:
    assert shape_of("aten::add", {"Input Dims": [[2, 2], [2, 2]]}) is None
    assert shape_of("aten::mm", {}) is None  # recorded without record_shapes
    assert shape_of("aten::baddbmm", {"Input Dims": [[2, 3, 5], [2, 3, 4], [2, 4, 5]],
                                      "Input type": ["float", "float", "float"]}).flops == 2 * 2 * 3 * 4 * 5


def test_tool_prints_the_table_and_a_broken_trace_is_a_user_error(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "steps_3-4_rank0.trace.json.gz"
    with gzip.open(trace, "wt") as handle:
        json.dump({"traceEvents": H200_EVENTS, "deviceProperties": [{"name": "NVIDIA H200"}]}, handle)
    tool = load_script("tools/gemm_table.py")
    assert tool.main([str(trace), "--per", "2"]) == 0
    shown = capsys.readouterr().out
    assert "ms per 1/2 of the trace" in shown and "| 0.5 | 0.11 | 628.5 | 64% |" in shown  # the H200's peak
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    assert tool.main([str(broken)]) == EXIT_USER_ERROR
    assert "broken.json: not a readable profiler trace" in capsys.readouterr().err
