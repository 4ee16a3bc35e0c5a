"""The GEMMs of a profiled step, shape by shape, with the throughput each ran at: from a ``torch.profiler`` trace.

A step's GEMMs are most of a GPU's time (Run 4's users' command: 57% of its kernel time), and what they could
still give depends on how close each shape runs to the device's peak. The kernel-time-by-kind summary
(``profiling.summarise``) cannot say that; this table can: each GEMM operator (``aten::mm``, ``addmm``, ``bmm``,
``baddbmm``, ``_addmm_activation``) grouped by its operand shapes and dtypes, with its calls, time and achieved
TFLOP/s (2·M·K·N per call over the time of the kernels it launched; on a CPU trace, the operator's own time).

It reads the Chrome trace the profiler exports (recorded with ``record_shapes``: ``train.profile.record_shapes``,
``tools/profile_step.py``), so the same code reads a live run's trace and one fetched from a GPU run. Kernels are
tied to their operator by the trace's ``External id``. Kernels replayed from CUDA graphs have no operator (the
graph's launch replaces them): they are counted apart, as GEMM kernels not attributed to a shape.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_lite.training.kernel_kinds import kind_of
from megatron_lite.training.metrics import known_peak_tflops

# operator -> index of its first matrix operand among the recorded inputs (the bias/accumulator comes first)
GEMM_OPERATORS = {"aten::mm": 0, "aten::bmm": 0, "aten::addmm": 1, "aten::baddbmm": 1, "aten::_addmm_activation": 1}
DTYPES = {"c10::BFloat16": "bf16", "c10::Half": "fp16", "float": "fp32", "double": "fp64"}
SCALAR_TYPES = {"5": "fp16", "6": "fp32", "7": "fp64", "15": "bf16"}  # c10::ScalarType codes, as a trace records them


@dataclass(frozen=True)
class GemmShape:
    operator: str
    batch: int  # 1 for mm/addmm
    m: int
    k: int
    n: int
    dtype: str  # operand dtype, "bf16->fp32" where the output's differs (aten::mm.dtype)

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.k * self.n

    def label(self) -> str:
        batch = f"{self.batch} x " if self.operator in ("aten::bmm", "aten::baddbmm") else ""
        return f"{self.operator.removeprefix('aten::')} {batch}{self.m} x {self.k} x {self.n}"


@dataclass
class GemmRow:
    shape: GemmShape
    calls: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class GemmTable:
    rows: list[GemmRow]  # by time, longest first
    device: str  # the trace's first device's name, or "cpu"
    timed_by: str  # "kernels" (a GPU trace) or "operators" (a CPU trace)
    unattributed_calls: int  # GEMM kernels tied to no recorded GEMM operator (CUDA-graph replays)
    unattributed_s: float

    @property
    def seconds(self) -> float:
        return sum(row.seconds for row in self.rows)


def shape_of(name: str, args: dict[str, Any]) -> GemmShape | None:
    """The GEMM shape of a recorded operator call, or None when it is not a GEMM or was recorded without shapes."""
    first = GEMM_OPERATORS.get(name)
    dims, types = args.get("Input Dims"), args.get("Input type")
    if first is None or not dims or len(dims) < first + 2:
        return None
    a, b = dims[first], dims[first + 1]
    if len(a) != len(b) or len(a) not in (2, 3):
        return None
    batch = a[0] if len(a) == 3 else 1
    m, k, n = a[-2], a[-1], b[-1]
    operand = DTYPES.get(types[first], types[first]) if types and len(types) > first else "?"
    # aten::mm.dtype (float32 logits from bf16 operands) records its out_dtype after the operands, as a ScalarType
    # code, and an output tensor given to it (out=, as inductor calls it) last, in the output's dtype
    concrete = args.get("Concrete Inputs") or []
    output = None
    if name in ("aten::mm", "aten::bmm") and len(concrete) > 2 and str(concrete[2]) in SCALAR_TYPES:
        output = SCALAR_TYPES[str(concrete[2])]
    elif types and len(dims) > first + 2 and dims[-1] == [*a[:-1], n]:
        output = DTYPES.get(types[-1], types[-1])
    dtype = operand if output in (None, operand) else f"{operand}->{output}"
    return GemmShape(name, batch, m, k, n, dtype)


def read_trace(path: Path) -> dict[str, Any]:
    """A Chrome trace as the profiler exports it (``.json`` or ``.json.gz``). ValueError naming the file if it is
    not one."""
    try:
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt") as handle:
            trace = json.load(handle)
    except (OSError, EOFError, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not a readable profiler trace ({error})") from None
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError(f"{path}: not a profiler trace (no traceEvents list)")
    return trace


def gemm_table(trace: dict[str, Any]) -> GemmTable:
    """The GEMM rows of one trace. On a GPU trace each operator's time is the summed duration of the kernels it
    launched; on a CPU trace (no kernels), the operator's own duration."""
    events = [event for event in trace["traceEvents"] if isinstance(event, dict)]
    kernels = [event for event in events if event.get("cat") == "kernel"]
    shapes: dict[Any, GemmShape] = {}  # External id -> shape
    rows: dict[GemmShape, GemmRow] = {}
    for event in events:
        if event.get("cat") != "cpu_op":
            continue
        shape = shape_of(event.get("name", ""), event.get("args", {}))
        if shape is None:
            continue
        row = rows.setdefault(shape, GemmRow(shape))
        row.calls += 1
        if kernels:
            shapes[event["args"].get("External id")] = shape
        else:
            row.seconds += event.get("dur", 0.0) / 1e6
    unattributed_calls, unattributed_s = 0, 0.0
    for kernel in kernels:
        shape = shapes.get(kernel.get("args", {}).get("External id"))
        if shape is not None:
            rows[shape].seconds += kernel.get("dur", 0.0) / 1e6
        elif kind_of(kernel.get("name", "")) == "gemm":
            unattributed_calls += 1
            unattributed_s += kernel.get("dur", 0.0) / 1e6
    devices = trace.get("deviceProperties") or []
    device = devices[0].get("name", "cuda") if kernels and devices else ("cuda" if kernels else "cpu")
    ordered = sorted(rows.values(), key=lambda row: (-row.seconds, row.shape.label()))
    return GemmTable(ordered, device, "kernels" if kernels else "operators", unattributed_calls, unattributed_s)


def format_table(table: GemmTable, per: int = 1, per_label: str = "per trace",
                 peak_tflops: float | None = None) -> str:
    """A markdown table of ``table``'s rows, times divided by ``per`` (the steps or micro batches in the trace);
    the share of ``peak_tflops`` where given."""
    if per < 1:
        raise ValueError(f"per={per}: must be >= 1")
    timing = "the kernels each operator launched" if table.timed_by == "kernels" else "each operator's own"
    lines = [f"GEMMs by shape ({table.device}; time: {timing}, ms {per_label})"]
    if not table.rows and not table.unattributed_calls:
        return lines[0] + ": none recorded (was the trace recorded with record_shapes?)"
    peak = peak_tflops if peak_tflops is not None and peak_tflops > 0 else None
    total = table.seconds + table.unattributed_s or 1.0

    def cells(label: str, dtype: str, calls: int, seconds: float, flops: int) -> str:
        tflops = flops / seconds / 1e12 if seconds > 0 else 0.0
        row = [label, dtype, f"{calls / per:g}", f"{seconds / per * 1e3:.2f}", f"{tflops:.1f}"]
        row += [f"{tflops / peak:.0%}"] if peak else []
        return "| " + " | ".join([*row, f"{seconds / total:.1%}"]) + " |"

    if table.rows:
        peak_column = " of peak |" if peak else ""
        lines += ["", f"| GEMM (M x K x N) | dtype | calls | ms | TFLOP/s |{peak_column} share |",
                  "|---|---|" + "---:|" * (5 if peak else 4)]
        lines += [cells(row.shape.label(), row.shape.dtype, row.calls, row.seconds, row.shape.flops * row.calls)
                  for row in table.rows]
        lines.append(cells("**all attributed**", "", sum(row.calls for row in table.rows), table.seconds,
                           sum(row.shape.flops * row.calls for row in table.rows)))
    if table.unattributed_calls:
        lines += ["", f"{table.unattributed_calls / per:g} GEMM kernels ({table.unattributed_s / per * 1e3:.2f} ms) "
                      "launched by no recorded GEMM operator (replayed from CUDA graphs): their shapes are unknown"]
    return "\n".join(lines)


def trace_gemm_text(path: Path, per: int = 1, per_label: str = "per trace", peak_tflops: float | None = None) -> str:
    """``format_table`` of the trace at ``path``; the peak, unless given, the trace's device's (if known).
    ValueError naming the file if it is not a readable trace."""
    table = gemm_table(read_trace(path))
    peak = peak_tflops if peak_tflops is not None else known_peak_tflops(table.device)
    return format_table(table, per, per_label, peak)
