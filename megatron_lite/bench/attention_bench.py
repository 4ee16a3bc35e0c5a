"""One attention layer per position scheme: forward+backward time, training and inference peak memory.

What one step is: ``SelfAttention.forward`` (fused QKV projection, the scheme's position transform,
the kernel, the output projection) plus building the ``PositionContext`` and its rotary tables, as
``GPT.forward`` does once per forward. Every scheme runs the same module (same seeded weights) on
the same input, so the ratios to RoPE isolate the position scheme.

Metrics per (scheme, backend, seq_len), each also as a ratio to RoPE measured in the same run:
  time_ms            median wall time of forward + ``out.float().sum().backward()``
  peak_mem_mb        peak live tensor memory of that step above inputs + parameters (grads included)
  infer_peak_mem_mb  the same for a ``torch.no_grad()`` forward
Memory is measured in a separate pass from timing: on CUDA with the allocator's peak statistics,
on CPU with ``megatron_lite.bench.memory.track_peak_memory`` (a dispatch mode, too slow to time).
MB here means 2**20 bytes.

Configurations whose estimated training peak (``estimate_peak_bytes``) exceeds the memory budget
are not run but reported as skipped, as are those that fail at run time (OOM, RuntimeError).
"""

from __future__ import annotations

import dataclasses
import gc
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_lite import config as config_lib
from megatron_lite.config import BACKENDS, AttentionConfig, ModelConfig
from megatron_lite.model.attention import SelfAttention, check_backend_available
from megatron_lite.model.context import PositionContext, build_context
from megatron_lite.model.flex import flex_available
from megatron_lite.model.gpt import DTYPES
from megatron_lite.model.position import PositionScheme, build_position_scheme
from megatron_lite.model.variants import PAPER_LABELS, variant_named
from megatron_lite.bench.memory import track_peak_memory

SCHEMES = PAPER_LABELS  # the four schemes the paper compares, by label
BASELINE = "rope"
MB = 2**20
GB = 2**30
CPU_MEM_BUDGET_GB = 8.0
GPU_MEM_BUDGET_FRACTION = 0.8

# metric key -> its ratio-to-RoPE key
RATIO_KEYS: dict[str, str] = {
    "time_ms": "time_ratio_vs_rope",
    "peak_mem_mb": "mem_ratio_vs_rope",
    "infer_peak_mem_mb": "infer_mem_ratio_vs_rope",
}
METRIC_KEYS = (*RATIO_KEYS, *RATIO_KEYS.values())


@dataclass(frozen=True)
class Target:
    """Acceptance target: ``ratio_key`` of ``schemes`` on ``backend`` at every length <= ``limit``."""

    ratio_key: str
    name: str
    limit: float
    schemes: tuple[str, ...] = ("coca_slack", "coca_strict")
    backend: str = "sdpa"


TARGETS: tuple[Target, ...] = (
    Target("time_ratio_vs_rope", "time", 1.10),
    Target("infer_mem_ratio_vs_rope", "infer mem", 1.05),
    Target("mem_ratio_vs_rope", "train mem", 1.25),
)


@dataclass
class BenchSettings:
    """Benchmark parameters; ``None`` fields are filled per device by ``resolve_settings``."""

    seq_lens: tuple[int, ...] = (512, 2048, 8192)
    batch_size: int = 1
    backends: tuple[str, ...] | None = None  # default: sdpa, chunked, reference (+ flex, + flash when usable)
    device: str | None = None  # default: cuda if available, else cpu
    dtype: str | None = None  # default: bf16 on cuda, fp32 on cpu
    repeats: int = 3
    warmup: int = 1
    hidden_size: int = 1024
    num_heads: int = 16
    mem_budget_gb: float | None = None  # default: 8 on cpu, 0.8 * GPU memory on cuda
    chunk_size: int = 1024
    seed: int = 1234


@dataclass
class BenchResult:
    records: list[dict[str, Any]]
    meta: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"records": self.records, "meta": self.meta}


# ----------------------------------------------------------------------------------------------
# Settings


def flash_usable() -> bool:
    try:
        check_backend_available("flash")
    except ValueError:
        return False
    return True


def default_backends(device: torch.device) -> tuple[str, ...]:
    """sdpa, chunked, reference; flex where torch has FlexAttention; flash on CUDA with flash-attn."""
    backends: tuple[str, ...] = ("sdpa", "chunked", "reference")
    if flex_available():
        backends += ("flex",)
    if device.type == "cuda" and flash_usable():
        backends += ("flash",)
    return backends


def resolve_settings(settings: BenchSettings) -> BenchSettings:
    """Fill per-device defaults and check everything; ValueError naming the bad setting."""
    try:
        device = torch.device(settings.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as error:
        raise ValueError(f"device={settings.device!r}: {error}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device={settings.device!r}: must be cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={settings.device!r}: CUDA is not available")
    dtype = settings.dtype or ("bf16" if device.type == "cuda" else "fp32")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: must be one of {', '.join(DTYPES)}")
    if not settings.seq_lens or any(isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in settings.seq_lens):
        raise ValueError(f"seq_lens={settings.seq_lens!r}: need one or more positive integers")
    for name, minimum in (("batch_size", 1), ("repeats", 1), ("warmup", 0), ("chunk_size", 1), ("hidden_size", 1), ("num_heads", 1)):
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name}={value!r}: must be an integer >= {minimum}")
    backends = settings.backends if settings.backends is not None else default_backends(device)
    if not backends or len(set(backends)) != len(backends):
        raise ValueError(f"backends={backends!r}: need one or more distinct backends out of {', '.join(BACKENDS)}")
    for backend in backends:
        check_backend_available(backend)  # ValueError for unknown names and unusable flash
    if "flash" in backends and (device.type != "cuda" or dtype == "fp32"):
        raise ValueError(f"backend flash needs device cuda and dtype bf16 or fp16, got {device} {dtype}")
    budget = settings.mem_budget_gb
    if budget is None:
        budget = CPU_MEM_BUDGET_GB if device.type == "cpu" else \
            GPU_MEM_BUDGET_FRACTION * torch.cuda.get_device_properties(device).total_memory / GB
    if not budget > 0:
        raise ValueError(f"mem_budget_gb={budget!r}: must be positive")
    resolved = dataclasses.replace(
        settings, seq_lens=tuple(settings.seq_lens), backends=tuple(backends), device=str(device), dtype=dtype,
        mem_budget_gb=float(budget),
    )
    for label in SCHEMES:  # hidden/heads/chunk checks of the config itself (e.g. heads must divide hidden)
        model_config(resolved, label, backends[0])
    return resolved


def model_config(settings: BenchSettings, label: str, backend: str) -> ModelConfig:
    variant = variant_named(label)
    data = {
        "model": {
            "num_layers": 1,
            "hidden_size": settings.hidden_size,
            "num_attention_heads": settings.num_heads,
            "seq_length": max(settings.seq_lens),  # only dynamic NTK reads it; no scaling here
            "position": {"scheme": variant.scheme, "constraint": variant.constraint},
            "attention": {"backend": backend, "chunk_size": settings.chunk_size},
        },
        "precision": settings.dtype,
        "seed": settings.seed,
    }
    return config_lib.from_dict(data).model


# ----------------------------------------------------------------------------------------------
# Estimate (decides "cannot fit" before anything runs)


def estimate_peak_bytes(
    label: str, backend: str, batch: int, seq_len: int, hidden: int, heads: int, dtype: torch.dtype, chunk_size: int,
    device: str | torch.device = "cpu",
) -> int:
    """Rough training-step peak in bytes above inputs + params, meant to err on the high side.

    Calibrated on CPU fp32 against the tracker (hidden 1024, 16 heads, N 256-2048: estimate / measured
    1.1-1.5). Linear terms: projections, transforms and their grads plus the weight grads. Quadratic
    terms: what a kernel materialises, times the copies alive at once (forward temporaries, tensors
    saved for backward, their grads). Errs higher still on GPU, where the fused kernels take the
    ALiBi bias without materialising scores.

    flex: on CUDA the fused kernel (forward and backward) materialises nothing quadratic but the
    block mask. On CPU/MPS FlexAttention has no backward, so training runs ``dense_flex_attention``
    (megatron_lite/model/flex.py): float32 scores, the masked scores, softmax probabilities and their
    NaN-cleared copy (both saved for backward), their grads, the (T, S) boolean mask, and with ALiBi
    the score_mod's (H, T, S) bias and its output: O(N^2) like the reference backend.
    """
    elem = torch.empty((), dtype=dtype).element_size()
    score_elem = max(elem, 4)  # the reference path computes scores and softmax in at least float32
    head_dim = hidden // heads
    linear = 12 * batch * seq_len * hidden * elem + 5 * hidden * hidden * elem
    scores = batch * heads * seq_len * seq_len  # elements of one (B, H, N, N) tensor
    bias = heads * seq_len * seq_len  # elements of the ALiBi (H, N, N) bias
    quadratic = 0
    variant = variant_named(label)
    if backend == "reference":
        quadratic = 4 * scores * score_elem + seq_len * seq_len  # scores/probs/grads + bool causal mask
        if variant.alibi_bias:
            quadratic += bias * score_elem
        if variant.pairwise_keys:
            quadratic += int(4.5 * scores * head_dim * elem)  # the Eq. 10 key tensor (B, H, N, N, D) + rotary temporaries
    elif backend == "flex":
        blocks = -(-seq_len // 128)
        if torch.device(device).type in ("cpu", "mps"):
            quadratic = 5 * scores * score_elem + seq_len * seq_len  # see the docstring
            if variant.alibi_bias:
                quadratic += bias * score_elem
        quadratic += 4 * blocks * blocks * 4  # block mask: counts and indices (int32), full and partial
    elif variant.alibi_bias and backend == "sdpa":
        # The fused CPU kernel rejects the 3-D (H, T, S) bias, so the math path materialises
        # (B, H, N, N) scores and probabilities next to the bias.
        quadratic = bias * score_elem + 2 * scores * score_elem  # the bias is float32 at least (model/masks.py)
    elif variant.alibi_bias and backend == "chunked":
        # Math path per query block: every block's probabilities are saved for backward, and the
        # last block's bias + scores are alive on top of them.
        starts = range(0, seq_len, chunk_size)
        visible = sum(min(chunk_size, seq_len - start) * min(start + chunk_size, seq_len) for start in starts)
        last_block = heads * min(chunk_size, seq_len) * seq_len
        quadratic = batch * heads * visible * score_elem + (1 + 2 * batch) * last_block * score_elem  # bias: float32
    elif backend == "chunked" and seq_len > chunk_size:
        quadratic = seq_len * seq_len * elem  # per-block causal masks (as float), kept for backward
    return int(linear + quadratic)


# ----------------------------------------------------------------------------------------------
# One step


def position_context(scheme: PositionScheme, attention: AttentionConfig, seq_len: int,
                     device: torch.device) -> PositionContext:
    """What GPT.forward builds per forward: positions, the mask mode and (rotary schemes) the cos/sin tables."""
    token_ids_1N = torch.ones(1, seq_len, dtype=torch.long, device=device)  # only its shape counts (no documents)
    return build_context(scheme, attention, token_ids_1N)


def train_step(module: SelfAttention, scheme: PositionScheme, attention: AttentionConfig, x_BNC: torch.Tensor) -> None:
    out_BNC = module(x_BNC, scheme, position_context(scheme, attention, x_BNC.shape[1], x_BNC.device))
    loss = out_BNC.float().sum()
    del out_BNC  # sum's backward needs no input: the peak then counts only what autograd keeps
    loss.backward()


def infer_step(module: SelfAttention, scheme: PositionScheme, attention: AttentionConfig, x_BNC: torch.Tensor) -> None:
    with torch.no_grad():
        module(x_BNC, scheme, position_context(scheme, attention, x_BNC.shape[1], x_BNC.device))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_bytes(step: Callable[[], None], device: torch.device) -> int:
    """Peak live tensor bytes during ``step`` above what was allocated before it."""
    if device.type == "cuda":
        synchronize(device)
        baseline = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - baseline
    with track_peak_memory() as tracker:
        step()
    return tracker.peak_bytes


@dataclass
class _Case:
    """One scheme inside a (backend, seq_len) group while it runs."""

    label: str
    scheme: PositionScheme
    attention: AttentionConfig
    record: dict[str, Any]
    times_ms: list[float] = field(default_factory=list)
    failed: bool = False


def _empty_record(label: str, backend: str, seq_len: int, settings: BenchSettings) -> dict[str, Any]:
    return {
        "scheme": label,
        "backend": backend,
        "seq_len": seq_len,
        "batch_size": settings.batch_size,
        **dict.fromkeys(METRIC_KEYS),
        "time_ms_repeats": None,
        "estimated_peak_mb": None,
        "skipped": None,
    }


def _ratio(value: float | None, baseline: float | None) -> float | None:
    if value is None or baseline is None or baseline <= 0:
        return None
    return value / baseline


def _add_ratios(group: list[dict[str, Any]]) -> None:
    """Ratios to the RoPE record of the same (backend, seq_len); None when either side is missing."""
    baseline = next((record for record in group if record["scheme"] == BASELINE), None)
    for record in group:
        for key, ratio_key in RATIO_KEYS.items():
            record[ratio_key] = _ratio(record[key], baseline[key] if baseline else None)


def _release_memory(module: SelfAttention | None, device: torch.device) -> None:
    if module is not None:
        module.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _run_group(
    settings: BenchSettings,
    module: SelfAttention,
    backend: str,
    seq_len: int,
    schemes: dict[str, tuple[PositionScheme, AttentionConfig]],
    progress: Callable[[str], None],
) -> list[dict[str, Any]]:
    """All schemes at one (backend, seq_len)."""
    device, dtype = torch.device(settings.device), DTYPES[settings.dtype]
    budget = settings.mem_budget_gb * GB

    def fresh_input(requires_grad: bool) -> torch.Tensor:
        # The same values for every scheme (seeded), created outside the measured region.
        generator = torch.Generator().manual_seed(settings.seed + seq_len)
        x_BNC = torch.randn(settings.batch_size, seq_len, settings.hidden_size, generator=generator)
        return x_BNC.to(device=device, dtype=dtype).requires_grad_(requires_grad)

    def fail(case: _Case, error: BaseException) -> None:
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        case.failed = True
        case.record["skipped"] = f"{type(error).__name__}: {message[:300]}"

    group: list[dict[str, Any]] = []
    cases: list[_Case] = []
    for label, (scheme, attention) in schemes.items():
        record = _empty_record(label, backend, seq_len, settings)
        group.append(record)
        estimate = estimate_peak_bytes(
            label, backend, settings.batch_size, seq_len, settings.hidden_size, settings.num_heads, dtype,
            settings.chunk_size, device,
        )
        record["estimated_peak_mb"] = estimate / MB
        if estimate > budget:
            record["skipped"] = (
                f"estimated training peak {estimate / GB:.1f} GB exceeds the memory budget {budget / GB:.1f} GB"
            )
        else:
            cases.append(_Case(label, scheme, attention, record))

    # Timing: the repeats go round-robin over the schemes so that load changes on a shared machine
    # hit every scheme alike instead of biasing the ratios.
    module.train()
    for iteration in range(settings.warmup + settings.repeats):
        for case in cases:
            if case.failed:
                continue
            x_BNC = fresh_input(requires_grad=True)
            module.zero_grad(set_to_none=True)  # every step allocates its weight grads, as in training
            try:
                synchronize(device)
                start = time.perf_counter()
                train_step(module, case.scheme, case.attention, x_BNC)
                synchronize(device)
                elapsed_ms = (time.perf_counter() - start) * 1e3
            except RuntimeError as error:  # torch.OutOfMemoryError included
                fail(case, error)
            if case.failed:  # outside the except block, whose traceback still holds the step's tensors
                _release_memory(module, device)
                continue
            if iteration >= settings.warmup:
                case.times_ms.append(elapsed_ms)

    # Memory: a separate pass (the CPU tracker's Python overhead would distort the timings).
    for case in cases:
        if case.failed:
            continue
        try:
            x_BNC = fresh_input(requires_grad=True)
            module.zero_grad(set_to_none=True)
            module.train()
            train_peak = peak_bytes(lambda x=x_BNC: train_step(module, case.scheme, case.attention, x), device)
            module.zero_grad(set_to_none=True)
            del x_BNC
            infer_peak: int | None = None
            if not (backend == "flex" and device.type == "cpu"):
                # CPU flex inference runs the FlexAttention higher-order op through torch.compile, which
                # the CPU tracker (a dispatch mode) cannot see into: left unmeasured (None).
                x_BNC = fresh_input(requires_grad=False)
                module.eval()
                infer_peak = peak_bytes(lambda x=x_BNC: infer_step(module, case.scheme, case.attention, x), device)
                del x_BNC
        except RuntimeError as error:
            fail(case, error)
        if case.failed:
            _release_memory(module, device)
            continue
        case.record.update(
            time_ms=statistics.median(case.times_ms),
            time_ms_repeats=case.times_ms,
            peak_mem_mb=train_peak / MB,
            infer_peak_mem_mb=None if infer_peak is None else infer_peak / MB,
        )
    _add_ratios(group)
    for record in group:
        progress(_progress_line(record))
    return group


def _progress_line(record: dict[str, Any]) -> str:
    where = f"{record['scheme']:<12} {record['backend']:<9} seq {record['seq_len']:>6}"
    if record["skipped"]:
        return f"{where}  skipped: {record['skipped']}"
    return (f"{where}  {record['time_ms']:9.1f} ms  train {record['peak_mem_mb']:9.1f} MB  "
            f"infer {_fmt(record['infer_peak_mem_mb'], 1):>9} MB")


# ----------------------------------------------------------------------------------------------
# Public API


def run_benchmark(settings: BenchSettings, progress: Callable[[str], None] | None = None) -> BenchResult:
    """Run every (scheme, backend, seq_len); records in (backend, seq_len, scheme) order."""
    settings = resolve_settings(settings)
    progress = progress or (lambda line: None)
    device, dtype = torch.device(settings.device), DTYPES[settings.dtype]
    assert settings.backends is not None

    records: list[dict[str, Any]] = []
    reference_state: dict[str, torch.Tensor] | None = None
    for backend in settings.backends:
        # One module per backend (the backend is fixed at construction), all with the same weights;
        # the position scheme is a forward argument, so every scheme shares the module.
        torch.manual_seed(settings.seed)
        module = SelfAttention(model_config(settings, BASELINE, backend))
        if reference_state is None:
            reference_state = {name: tensor.clone() for name, tensor in module.state_dict().items()}
        module.load_state_dict(reference_state)
        module.to(device=device, dtype=dtype)
        schemes: dict[str, tuple[PositionScheme, AttentionConfig]] = {}
        for label in SCHEMES:
            config = model_config(settings, label, backend)
            schemes[label] = (build_position_scheme(config).to(device), config.attention)
        for seq_len in settings.seq_lens:
            records.extend(_run_group(settings, module, backend, seq_len, schemes, progress))
        del module
        _release_memory(None, device)
    return BenchResult(records=records, meta=_meta(settings, device))


def _meta(settings: BenchSettings, device: torch.device) -> dict[str, Any]:
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    return {
        "device": str(device),
        "device_name": device_name,
        "torch_version": torch.__version__,
        "num_threads": torch.get_num_threads(),
        "dtype": settings.dtype,
        "batch_size": settings.batch_size,
        "hidden_size": settings.hidden_size,
        "num_heads": settings.num_heads,
        "seq_lens": list(settings.seq_lens),
        "backends": list(settings.backends or ()),
        "repeats": settings.repeats,
        "warmup": settings.warmup,
        "chunk_size": settings.chunk_size,
        "mem_budget_gb": settings.mem_budget_gb,
        "mem_measurement": "torch.cuda.max_memory_allocated" if device.type == "cuda" else "dispatch-mode storage tracker",
        "mb": MB,
        "targets": [dataclasses.asdict(target) for target in TARGETS],
    }


def target_checks(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (target scheme, seq_len): each target's ratio and pass (None when not measured)."""
    rows: list[dict[str, Any]] = []
    for record in records:
        if record["scheme"] not in TARGETS[0].schemes or record["backend"] != TARGETS[0].backend:
            continue
        row: dict[str, Any] = {"scheme": record["scheme"], "backend": record["backend"], "seq_len": record["seq_len"]}
        for target in TARGETS:
            ratio = record[target.ratio_key]
            row[target.name] = {"ratio": ratio, "limit": target.limit, "pass": None if ratio is None else ratio <= target.limit}
        rows.append(row)
    return rows


def _fmt(value: float | None, digits: int) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def format_report(result: BenchResult) -> str:
    """Markdown: the results table, then the target checks (informational)."""
    meta = result.meta
    lines = [
        f"Attention benchmark: hidden {meta['hidden_size']}, {meta['num_heads']} heads, batch {meta['batch_size']}, "
        f"{meta['dtype']} on {meta['device']} ({meta['device_name']}), torch {meta['torch_version']}, "
        f"{meta['num_threads']} threads, median of {meta['repeats']} (warmup {meta['warmup']}); MB = 2^20 bytes.",
        "",
        "| scheme | backend | seq | fwd+bwd ms | ×RoPE | train peak MB | ×RoPE | infer peak MB | ×RoPE | skipped |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for record in result.records:
        lines.append(
            f"| {record['scheme']} | {record['backend']} | {record['seq_len']} | {_fmt(record['time_ms'], 1)} | "
            f"{_fmt(record['time_ratio_vs_rope'], 2)} | {_fmt(record['peak_mem_mb'], 1)} | "
            f"{_fmt(record['mem_ratio_vs_rope'], 2)} | {_fmt(record['infer_peak_mem_mb'], 1)} | "
            f"{_fmt(record['infer_mem_ratio_vs_rope'], 2)} | {record['skipped'] or ''} |"
        )
    rows = target_checks(result.records)
    lines += ["", "Targets (informational): " + "; ".join(
        f"{target.name} ≤ {target.limit:.2f}× RoPE" for target in TARGETS
    ) + f" for {', '.join(TARGETS[0].schemes)} on {TARGETS[0].backend} at every length.", ""]
    if not rows:
        lines.append(f"target check: backend {TARGETS[0].backend} was not benchmarked")
        return "\n".join(lines) + "\n"
    lines += [
        "| scheme | seq | " + " | ".join(f"{t.name} ≤ {t.limit:.2f}×" for t in TARGETS) + " |",
        "|---|---:|" + "---|" * len(TARGETS),
    ]
    verdicts: list[bool | None] = []
    for row in rows:
        cells = []
        for target in TARGETS:
            check = row[target.name]
            verdicts.append(check["pass"])
            verdict = "n/a" if check["pass"] is None else ("PASS" if check["pass"] else "FAIL")
            cells.append(f"{_fmt(check['ratio'], 2)} {verdict}")
        lines.append(f"| {row['scheme']} | {row['seq_len']} | " + " | ".join(cells) + " |")
    passed = sum(verdict is True for verdict in verdicts)
    failed = sum(verdict is False for verdict in verdicts)
    missing = sum(verdict is None for verdict in verdicts)
    lines += ["", f"target check: {passed} pass, {failed} fail, {missing} not measured"]
    for row in rows:
        for target in TARGETS:
            check = row[target.name]
            if check["pass"] is False:
                lines.append(
                    f"  FAIL {row['scheme']} {row['backend']} seq {row['seq_len']}: {target.name} "
                    f"{check['ratio']:.2f}× RoPE > {target.limit:.2f}×"
                )
    return "\n".join(lines) + "\n"
