"""Compile time of the decoder, whole model vs regional (``megatron_lite.model.compile.compile_model``).

The 350M model's depth (24 blocks) at a narrow width, on CPU with inductor: the first training step
(forward with labels -> fused loss, backward, AdamW; it compiles forward and backward) and then the median
of the compiled steps, for each mode in a fresh Python process, so that nothing dynamo or inductor keeps
in memory carries over, with inductor's on-disk caches off (``TORCHINDUCTOR_FX_GRAPH_CACHE=0``,
``TORCHINDUCTOR_AUTOGRAD_CACHE=0``) and a fresh ``TORCHINDUCTOR_CACHE_DIR`` and ``TMPDIR`` per mode (the
latter holds inductor's precompiled headers). An eager process
gives the reference step. The ratio with a target: whole / regional first step (>= 3).

    python -m dev.compile_time '{"mode": "regional", ...}'   # one worker (used internally)
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]  # the checkout: dev/ is not installed
# regional-cpp-wrapper: regional with inductor's C++ wrapper (train.compile_cpp_wrapper); at a width where kernels
# cost almost nothing its step time is the host's floor, and regional / regional-cpp-wrapper what launching each
# kernel from C++ instead of Python saves per step (not run unless asked)
CPP_WRAPPER_SUFFIX = "-cpp-wrapper"
MODES = ("eager", "whole", "regional", "regional" + CPP_WRAPPER_SUFFIX)
DEFAULT_MODES = MODES[:3]
# regional-blocks-K: K consecutive blocks per compiled region (train.compile_blocks_per_region); against regional,
# what fewer region calls save the host per step and what the larger graph costs the first step
GROUPED_PREFIX = "regional-blocks-"
RESULT_MARK = "COMPILE_TIME_RESULT "
FIRST_STEP_TARGET = 3.0  # whole / regional first-step time: what regional compile is for


def blocks_per_region(mode: str) -> int | None:
    """K of a ``regional-blocks-K`` mode (K >= 2), else None."""
    count = mode.removeprefix(GROUPED_PREFIX)
    return int(count) if mode.startswith(GROUPED_PREFIX) and count.isdigit() and int(count) >= 2 else None


@dataclass
class CompileTimeSettings:
    config_path: str = "configs/coca_350m.yml"  # the 350M depth; the width below replaces its own
    layers: int = 24
    hidden: int = 128
    heads: int = 4
    seq_length: int = 128
    vocab: int = 1024
    batch_size: int = 4
    scheme: str = "coca_slack"
    precision: str = "fp32"
    backend: str = "inductor"  # "eager" / "aot_eager": dynamo only, for a quick smoke
    steps: int = 10  # timed steps after the first two (median reported)
    repeats: int = 1  # fresh processes per mode, in interleaved order (whole, regional, whole, ...)
    modes: list[str] = field(default_factory=lambda: list(DEFAULT_MODES))
    # torch threads in each worker: 1 keeps step times steady beside other processes on a small machine
    # (inductor's compile is single-threaded Python plus compiler subprocesses either way); 0: torch's default
    threads: int = 1
    timeout_s: float = 1800.0  # per worker process

    def overrides(self) -> list[str]:
        from megatron_lite.model.variants import variant_named

        return [f"model.num_layers={self.layers}", f"model.hidden_size={self.hidden}",
                f"model.num_attention_heads={self.heads}", f"model.intermediate_size={4 * self.hidden}",
                f"model.seq_length={self.seq_length}", f"model.max_position_embeddings={self.seq_length}",
                f"model.vocab_size={self.vocab}", f"precision={self.precision}",
                *variant_named(self.scheme).overrides]


def _compile(model: Any, mode: str, backend: str) -> None:
    """compile_model(model, mode), with ``backend`` instead of inductor where asked (smoke runs)."""
    import torch

    from megatron_lite.model.compile import compile_model

    grouped = blocks_per_region(mode)
    if grouped is not None:
        compile_model(model, "regional", backend=backend, blocks_per_region=grouped)
        return
    if backend == "inductor":
        base = mode.removesuffix(CPP_WRAPPER_SUFFIX)
        compile_model(model, base, cpp_wrapper=base != mode)  # type: ignore[arg-type]
        return
    if mode.endswith(CPP_WRAPPER_SUFFIX):
        raise ValueError(f"compile-time mode {mode}: the C++ wrapper is inductor's (backend {backend!r})")
    original = torch.nn.Module.compile

    def with_backend(module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        original(module, *args, **{**kwargs, "backend": backend})

    torch.nn.Module.compile = with_backend  # type: ignore[method-assign]
    try:
        compile_model(model, mode)  # type: ignore[arg-type]
    finally:
        torch.nn.Module.compile = original  # type: ignore[method-assign]


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (the C++ compiler runs inductor starts)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def measure_in_process(settings: CompileTimeSettings, mode: str) -> dict[str, Any]:
    """This process: build the model, compile it (``mode``), time the first step, the second, and the
    median of ``settings.steps`` more."""
    import torch
    from torch._dynamo.utils import counters

    from megatron_lite import config as config_lib
    from megatron_lite.model import GPT
    from megatron_lite.model.gpt import DTYPES

    if settings.threads:
        torch.set_num_threads(settings.threads)
    config = config_lib.load(REPO / settings.config_path, settings.overrides())
    torch.manual_seed(config.seed)
    model = GPT(config.model).to(DTYPES[config.precision]).train()
    model.use_loss_settings(config.train)  # the loss head the trainer would run
    if mode != "eager":
        _compile(model, mode, settings.backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    ids = torch.randint(0, config.model.vocab_size, (settings.batch_size, settings.seq_length + 1),
                        generator=torch.Generator().manual_seed(config.seed))
    inputs, labels = ids[:, :-1], ids[:, 1:]

    model_seconds: list[float] = []  # forward and backward alone: the compiled regions, without AdamW's share

    def step() -> float:
        start = time.perf_counter()
        loss = model(inputs, labels=labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        model_seconds.append(time.perf_counter() - start)
        optimizer.step()
        return time.perf_counter() - start

    cpu_before = _cpu_seconds()
    first = step()
    first_cpu = _cpu_seconds() - cpu_before
    second = step()
    times = [step() for _ in range(settings.steps)]
    timed_model = model_seconds[2:]
    return {"mode": mode, "first_step_s": first, "first_step_cpu_s": first_cpu, "second_step_s": second,
            "step_ms": statistics.median(times) * 1e3, "step_ms_min": min(times) * 1e3,
            "step_ms_all": [t * 1e3 for t in times], "forward_backward_ms": statistics.median(timed_model) * 1e3,
            "threads": torch.get_num_threads(),
            "parameters": sum(p.numel() for p in model.parameters()),
            "dynamo": {key: int(value) for key, value in counters["stats"].items()},
            "torch": torch.__version__}


def worker_env(cache_dir: str) -> dict[str, str]:
    """The environment of one worker: inductor's caches off, its cache dir fresh, and TMPDIR too (inductor keeps
    its precompiled C++ headers under the default cache dir, in the temp dir, whatever TORCHINDUCTOR_CACHE_DIR
    says: a header built by one mode's process would otherwise speed up the next one's); inductor compiles in the
    process itself (``TORCHINDUCTOR_COMPILE_THREADS=1``: no worker pool), so the first step's CPU time counts all
    of it (the compiler subprocesses included), a figure other load on the machine barely moves."""
    env = dict(os.environ, TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0",
               TORCHINDUCTOR_CACHE_DIR=cache_dir, TMPDIR=cache_dir, TORCHINDUCTOR_COMPILE_THREADS="1",
               PYTHONPATH=os.pathsep.join(
                   filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.pop("TORCH_COMPILE_DISABLE", None)
    return env


def measure_mode(settings: CompileTimeSettings, mode: str) -> dict[str, Any]:
    """``measure_in_process`` in a fresh process with a fresh inductor cache dir; wall time of the process too."""
    with tempfile.TemporaryDirectory(prefix=f"compile_time_{mode}_") as cache_dir:
        start = time.perf_counter()
        completed = subprocess.run(
            [sys.executable, "-m", "dev.compile_time", json.dumps({**asdict(settings), "mode": mode})],
            capture_output=True, text=True, env=worker_env(cache_dir), cwd=REPO, timeout=settings.timeout_s)
        wall = time.perf_counter() - start
    lines = [line for line in completed.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if completed.returncode != 0 or not lines:
        tail = (completed.stderr or completed.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"compile-time worker ({mode}) exited {completed.returncode}: {' | '.join(tail)}")
    return {**json.loads(lines[-1][len(RESULT_MARK):]), "process_s": wall}


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's runs: medians (and the best first step) over its processes."""
    first = [run["first_step_s"] for run in runs]
    return {"mode": runs[0]["mode"], "runs": len(runs), "first_step_s": statistics.median(first),
            "first_step_min_s": min(first), "first_step_cpu_s": statistics.median(run["first_step_cpu_s"] for run in runs),
            "second_step_s": statistics.median(run["second_step_s"] for run in runs),
            "step_ms": statistics.median(run["step_ms"] for run in runs),
            "step_ms_min": min(run["step_ms_min"] for run in runs),
            "forward_backward_ms": statistics.median(run["forward_backward_ms"] for run in runs),
            "graphs": max(run["dynamo"].get("unique_graphs", 0) for run in runs),
            "threads": runs[0]["threads"], "torch": runs[0]["torch"], "parameters": runs[0]["parameters"]}


def run_compile_time(settings: CompileTimeSettings, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Every mode of ``settings.modes`` in fresh processes (``repeats`` each, interleaved); per mode the medians,
    and the whole/regional ratios where both ran."""
    unknown = [mode for mode in settings.modes if mode not in MODES and blocks_per_region(mode) is None]
    if unknown or not settings.modes:
        raise ValueError(f"compile-time modes {settings.modes}: expected some of {', '.join(MODES)}, "
                         f"{GROUPED_PREFIX}K (K >= 2)")
    for mode in settings.modes:
        grouped = blocks_per_region(mode)
        if grouped is not None and settings.layers % grouped:
            raise ValueError(f"compile-time mode {mode}: {grouped} must divide the {settings.layers} layers")
    if settings.repeats < 1 or settings.steps < 1:
        raise ValueError(f"compile time: repeats {settings.repeats} and steps {settings.steps} must be >= 1")
    settings.overrides()  # an unknown scheme stops here
    runs: list[dict[str, Any]] = []
    for repeat in range(settings.repeats):
        for mode in settings.modes:
            progress(f"compile time: {mode} ({settings.layers} layers, hidden {settings.hidden}, {settings.backend}), "
                     f"process {repeat + 1}/{settings.repeats} ...")
            run = measure_mode(settings, mode)
            progress(f"compile time: {mode}: first step {run['first_step_s']:.1f} s ({run['first_step_cpu_s']:.1f} s "
                     f"CPU), step {run['step_ms']:.1f} ms")
            runs.append(run)
    rows = [_summary([run for run in runs if run["mode"] == mode]) for mode in settings.modes]
    by_mode = {row["mode"]: row for row in rows}
    ratios = {}
    if "whole" in by_mode and "regional" in by_mode:
        whole, regional = by_mode["whole"], by_mode["regional"]
        ratios["first_step_whole_over_regional"] = whole["first_step_s"] / regional["first_step_s"]
        ratios["first_step_cpu_whole_over_regional"] = whole["first_step_cpu_s"] / regional["first_step_cpu_s"]
        ratios["step_regional_over_whole"] = regional["step_ms"] / whole["step_ms"]
    wrapped = "regional" + CPP_WRAPPER_SUFFIX
    if "regional" in by_mode and wrapped in by_mode:
        ratios["step_regional_over_cpp_wrapper"] = by_mode["regional"]["step_ms"] / by_mode[wrapped]["step_ms"]
        ratios["forward_backward_regional_over_cpp_wrapper"] = (by_mode["regional"]["forward_backward_ms"]
                                                                / by_mode[wrapped]["forward_backward_ms"])
        ratios["first_step_cpp_wrapper_over_regional"] = (by_mode[wrapped]["first_step_s"]
                                                          / by_mode["regional"]["first_step_s"])
    for mode in by_mode:
        if blocks_per_region(mode) is not None and "regional" in by_mode:
            ratios[f"forward_backward_regional_over_{mode}"] = (by_mode["regional"]["forward_backward_ms"]
                                                                / by_mode[mode]["forward_backward_ms"])
            ratios[f"first_step_{mode}_over_regional"] = (by_mode[mode]["first_step_s"]
                                                          / by_mode["regional"]["first_step_s"])
    if "eager" in by_mode:
        for mode in ("whole", "regional"):
            if mode in by_mode:
                ratios[f"step_eager_over_{mode}"] = by_mode["eager"]["step_ms"] / by_mode[mode]["step_ms"]
    return {"settings": asdict(settings), "rows": rows, "runs": runs, "ratios": ratios}


def format_compile_time(result: dict[str, Any]) -> str:
    s = result["settings"]
    rows, ratios = result["rows"], result["ratios"]
    lines = [
        f"Compile time, whole model vs regional (compile_model), {s['backend']}, CPU, torch "
        f"{rows[0]['torch'] if rows else '?'}, {rows[0]['threads'] if rows else '?'} thread(s): {s['scheme']}, "
        f"{s['layers']} layers, hidden {s['hidden']}, {s['heads']} heads, seq {s['seq_length']}, vocab {s['vocab']}, "
        f"batch {s['batch_size']}, {s['precision']}; {s['repeats']} fresh process(es) per mode, interleaved, inductor's "
        "FX-graph and autograd caches off, fresh cache and temp dirs, compile in-process. Step: forward with labels "
        f"(fused loss), backward, AdamW. Medians over the processes; step ms: each process's median of {s['steps']} "
        "steps after the first two.",
        "",
        "| mode | processes | first step s (compile + run) | best first step s | first step CPU s | second step s | "
        "step ms | best step ms | forward + backward ms | graphs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(f"| {row['mode']} | {row['runs']} | {row['first_step_s']:.1f} | {row['first_step_min_s']:.1f} | "
                     f"{row['first_step_cpu_s']:.1f} | {row['second_step_s']:.2f} | {row['step_ms']:.1f} | "
                     f"{row['step_ms_min']:.1f} | {row['forward_backward_ms']:.1f} | {row['graphs']} |")
    if "first_step_whole_over_regional" in ratios:
        value = ratios["first_step_whole_over_regional"]
        lines += ["", f"first step whole / regional: {value:.2f}x wall, "
                      f"{ratios['first_step_cpu_whole_over_regional']:.2f}x CPU time (target >= "
                      f"{FIRST_STEP_TARGET:.0f}x: {'PASS' if value >= FIRST_STEP_TARGET else 'FAIL'})",
                  f"compiled step regional / whole: {ratios['step_regional_over_whole']:.2f}x (<= 1 keeps the speed)"]
    if "step_regional_over_cpp_wrapper" in ratios:
        lines.append(f"compiled step regional / regional{CPP_WRAPPER_SUFFIX}: "
                     f"{ratios['step_regional_over_cpp_wrapper']:.2f}x, forward + backward "
                     f"{ratios['forward_backward_regional_over_cpp_wrapper']:.2f}x (> 1: the C++ wrapper saves host "
                     f"time); its first step {ratios['first_step_cpp_wrapper_over_regional']:.2f}x regional's")
    for row in rows:
        mode = row["mode"]
        if f"forward_backward_regional_over_{mode}" in ratios:
            faster = ratios[f"forward_backward_regional_over_{mode}"]
            longer = ratios[f"first_step_{mode}_over_regional"]
            lines.append(f"forward + backward regional / {mode}: {faster:.2f}x (> 1: fewer region calls save host "
                         f"time); its first step {longer:.2f}x regional's")
    for mode in ("whole", "regional"):
        if f"step_eager_over_{mode}" in ratios:
            lines.append(f"eager step / {mode} step: {ratios[f'step_eager_over_{mode}']:.2f}x")
    return "\n".join(lines) + "\n"


def _worker_main(argument: str) -> None:
    data = json.loads(argument)
    mode = data.pop("mode")
    result = measure_in_process(CompileTimeSettings(**data), mode)
    print(RESULT_MARK + json.dumps(result), flush=True)


if __name__ == "__main__":
    _worker_main(sys.argv[1])
