"""One-GPU acceptance check: environment, backend parity, long-context memory, throughput/MFU, a short real
training run, the users' command and host-sync freedom, each a section of rows in OUT/gpu_check.json and
OUT/gpu_check.md.

Sections run in order; each one's rows are written (JSON and a regenerated markdown report) as soon as it
finishes, so a run cut short keeps what it measured, and a re-run skips finished sections (``force`` redoes
them). ``smoke`` runs every section on tiny dimensions on the CPU in seconds: CUDA-only measurements become
rows saying so, or a CPU equivalent (dispatcher-counted peak memory for the memory section).

``quick`` is the profile that fits one short GPU allocation (at most ~6 minutes on an H100): sections env,
parity, memory, throughput, users_command and sync for two schemes (rope, coca_slack; ``schemes`` picks
others), throughput at one fixed micro batch (64 x 512) with 2 warm-up and 5 timed steps, each scheme eager
and compiled beside the Hugging Face twin eager and compiled, and smaller section budgets. Everything a run
depends on is a field of ``CheckSettings``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.metadata
import json
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from megatron_lite import config as config_lib
from megatron_lite.config import Config
from megatron_lite.bench.gpu_check_settings import (CUDA_GRAPHS_SUFFIX, FEWER_LAUNCHES_SUFFIX, MAX_AUTOTUNE_SUFFIX,
                                                    SECTIONS, CheckSettings)
from megatron_lite.bench.gpu_check_train import CONFIG_350M, CONFIG_TINY, section_train
from megatron_lite.bench.users_command import FEWER_LAUNCHES_INDUCTOR
from megatron_lite.files import write_text_atomic
from megatron_lite.model import GPT
from megatron_lite.model.attention import check_backend_available
from megatron_lite.model.compile import compile_model
from megatron_lite.model.variants import variant_named
from megatron_lite.training.engine import enable_tf32
from megatron_lite.training.metrics import known_peak_tflops, model_flops_per_token

REPO = Path(__file__).resolve().parents[2]
HF_TWIN = "hf_twin"  # the throughput rows' name for Hugging Face GPTNeoXForCausalLM at our dimensions
USERS_TIMEOUT_S = {"quick": 240.0, "full": 900.0}  # the users' command subprocess
COMPILE_ORDER = ("coca_slack", "coca_strict", "rope", "alibi", "none", "learned", "sinusoidal")
PARITY_BACKENDS = ("sdpa", "flash", "flex", "chunked")
NO_CUDA_MESSAGE = "no CUDA device: gpu_check measures a GPU (use --smoke to check the tool on CPU)"
JSON_NAME, MD_NAME = "gpu_check.json", "gpu_check.md"
SMOKE_DIMENSIONS = ("model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
                    "model.intermediate_size=256", "model.seq_length=32", "model.max_position_embeddings=32",
                    "model.vocab_size=384")

Progress = Callable[[str], None]


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"[:300]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def _free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def big_config(settings: CheckSettings, label: str, backend: str = "sdpa", precision: str = "bf16",
               extra: tuple[str, ...] = ()) -> Config:
    """The 350M config (tiny one under --smoke) with this scheme, backend and precision."""
    overrides = [*variant_named(label).overrides, f"model.attention.backend={backend}", f"precision={precision}", *extra]
    if settings.smoke:  # tiny_config-like dimensions: every section in seconds on two CPU cores
        return config_lib.load(REPO / CONFIG_TINY, [*SMOKE_DIMENSIONS, *overrides])
    return config_lib.load(REPO / CONFIG_350M, overrides)


# ----------------------------------------------------------------------------------------------
# env

def section_env(settings: CheckSettings, progress: Progress) -> list[dict[str, Any]]:
    from megatron_lite.model.flex import flex_available

    rows: list[dict[str, Any]] = []
    cuda = torch.cuda.is_available()
    rows.append({"item": "device", "value": torch.cuda.get_device_name() if cuda else "cpu (no CUDA)"})
    rows.append({"item": "torch", "value": torch.__version__})
    rows.append({"item": "CUDA", "value": torch.version.cuda or "none"})
    rows.append({"item": "cuDNN", "value": str(torch.backends.cudnn.version()) if cuda else "none"})
    try:
        flash = importlib.metadata.version("flash-attn")
    except importlib.metadata.PackageNotFoundError:
        flash = "missing"
    rows.append({"item": "flash-attn", "value": flash})
    rows.append({"item": "FlexAttention", "value": "available" if flex_available() else "unavailable"})
    rows.append({"item": "bf16", "value": str(torch.cuda.is_bf16_supported()) if cuda else "cpu: supported"})
    if cuda:
        free, total = torch.cuda.mem_get_info()
        rows.append({"item": "GPU memory", "value": f"{total / 2**30:.1f} GiB total, {free / 2**30:.1f} GiB free"})
        peak = known_peak_tflops(torch.cuda.get_device_name())
        rows.append({"item": "peak bf16 TFLOP/s", "value": str(peak) if peak else "unknown"})
        rows.append({"item": "SDPA kernel torch picks (bf16, causal, 16 x 16 heads x 512 x 64)",
                     "value": sdpa_auto_kernel(torch.device("cuda"))})
        precision = torch.get_float32_matmul_precision()  # 'highest': no TF32 for float32 matmuls
        rows.append({"item": "float32 matmul precision (this process)",
                     "value": precision + (" (no TF32)" if precision == "highest" else " (TF32)")})
    else:
        rows.append({"item": "GPU memory", "value": "skipped: no CUDA"})
    return rows


def sdpa_auto_kernel(device: torch.device) -> str:
    """The kernel torch's SDPA dispatches a causal bf16 attention of the 350M training shape to on ``device``
    (``torch._fused_sdp_choice``, the function SDPA itself asks), by its SDPBackend name."""
    from torch.nn.attention import SDPBackend

    q_BHTD = torch.empty(16, 16, 512, 64, dtype=torch.bfloat16, device=device)
    return SDPBackend(torch._fused_sdp_choice(q_BHTD, q_BHTD, q_BHTD, is_causal=True)).name


# ----------------------------------------------------------------------------------------------
# parity

def parity_config(smoke: bool, label: str, backend: str, precision: str) -> Config:
    variant = variant_named(label)
    hidden, heads, seq = (64, 4, 32) if smoke else (512, 8, 512)
    model = {"num_layers": 2, "hidden_size": hidden, "num_attention_heads": heads, "seq_length": seq,
             "max_position_embeddings": seq, "vocab_size": 250 if smoke else 1000, "make_vocab_size_divisible_by": 128,
             "position": {"scheme": variant.scheme, "constraint": variant.constraint, "rotary_pct": 1.0},
             "attention": {"backend": backend, "chunk_size": seq // 4}}
    return config_lib.from_dict({"model": model, "seed": 7, "precision": precision})


def section_parity(settings: CheckSettings, progress: Progress) -> list[dict[str, Any]]:
    device = settings.device
    rows = []
    for label in settings.schemes or ():
        reference_config = parity_config(settings.smoke, label, "reference", "fp32")
        torch.manual_seed(reference_config.seed)
        with device:
            reference = GPT(reference_config.model).eval()
        seq = reference_config.model.seq_length
        ids = torch.randint(0, reference_config.model.vocab_size, (2, seq), device=device,
                            generator=torch.Generator(device).manual_seed(0))
        with torch.no_grad():
            expected = reference(ids).float()
        for backend in PARITY_BACKENDS:
            row: dict[str, Any] = {"scheme": label, "backend": backend}
            try:
                config = parity_config(settings.smoke, label, backend, "bf16")
                check_backend_available(backend)
                with device:
                    model = GPT(config.model)
                model.load_state_dict(reference.state_dict())
                model = model.to(torch.bfloat16).eval()
                with torch.no_grad(), warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
                    logits = model(ids).float()
                error = (logits - expected).abs().max().item()
                row.update(status="ok", max_abs_error=error, rel_error=error / expected.abs().max().item())
                del model
            except ValueError as unavailable:
                row.update(status=f"unavailable: {unavailable}")
            except Exception as failure:  # noqa: BLE001 - a failing backend is a row, not a crash
                row.update(status=f"failed: {_error_text(failure)}")
            rows.append(row)
            progress(f"  parity {label} {backend}: {_row_summary(row)}")
        del reference
        _free(device)
    return rows


# ----------------------------------------------------------------------------------------------
# throughput

def hf_twin(config: Config) -> torch.nn.Module:
    from megatron_lite.bench.train_bench import hf_gpt_neox

    return hf_gpt_neox(config)


class TwinWithLoss(torch.nn.Module):
    """The Hugging Face twin and its loss as one module (the bf16 logits into a float32 cross entropy), so that
    compiling it puts the loss inside the twin's compiled region (``--twin-loss compiled``)."""

    def __init__(self, twin: torch.nn.Module) -> None:
        super().__init__()
        self.twin = twin

    def forward(self, inputs_BT: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
        logits_BTV = self.twin(inputs_BT).logits
        return F.cross_entropy(logits_BTV.reshape(-1, logits_BTV.shape[-1]).float(), labels_BT.reshape(-1))


def throughput_step(model: torch.nn.Module, is_hf: bool, batch: torch.Tensor) -> Callable[[], None]:
    """One timed training step: ours through its fused loss, the twin's bf16 logits into a float32 cross entropy
    (outside its compiled model, or inside with it: a TwinWithLoss); AdamW (torch's default implementation for the
    device). ``tools/profile_step.py`` profiles the same step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    inputs, labels = batch[:, :-1], batch[:, 1:]

    def step() -> None:
        torch.compiler.cudagraph_mark_step_begin()  # a new step for CUDA graphs' output buffers; else nothing
        if isinstance(model, TwinWithLoss):
            loss = model(inputs, labels)
        elif is_hf:
            logits = model(inputs).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
        else:
            loss = model(inputs, labels=labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


@dataclass(frozen=True)
class StepTiming:
    step_s: float  # mean of the timed steps
    first_step_s: float  # the first warm-up step's wall time: the compile, for a compiled model
    peak_gib: float | None = None  # CUDA: the most memory allocated while the model was built and stepped


def _time_steps(step: Callable[[], None], device: torch.device, warmup: int, steps: int) -> StepTiming:
    """``warmup`` untimed steps (the first timed alone), then the mean of ``steps`` timed ones."""
    _sync(device)
    start = time.perf_counter()
    step()
    _sync(device)
    first = time.perf_counter() - start
    for _ in range(warmup - 1):
        step()
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return StepTiming((time.perf_counter() - start) / steps, first)


def set_loss_gemm(model: torch.nn.Module, gemm: str) -> bool:
    """``model.lm_head.gemm = gemm`` (the fused loss head's GEMM operands); False where the head has no such
    attribute (a model or checkout without the option), and then nothing is set."""
    head = getattr(model, "lm_head", None)
    if head is None or not hasattr(head, "gemm"):
        return False
    setattr(head, "gemm", gemm)
    return True


def _compile(model: torch.nn.Module, is_hf: bool, mode: str) -> None:
    """Ours through compile_model (``mode``), the HF twin through its own ``model.compile()``; dynamo's
    in-memory caches cleared first, so that earlier rows' graphs neither count against its recompile limit
    nor turn this one's shapes dynamic (inductor's on-disk cache still serves identical graphs)."""
    torch._dynamo.reset()
    if is_hf:
        model.compile()
    else:
        base = mode.removesuffix(CUDA_GRAPHS_SUFFIX).removesuffix(MAX_AUTOTUNE_SUFFIX).removesuffix(
            FEWER_LAUNCHES_SUFFIX)
        compile_model(model, base, cuda_graphs=mode.endswith(CUDA_GRAPHS_SUFFIX),  # type: ignore[arg-type]
                      max_autotune=mode.endswith(MAX_AUTOTUNE_SUFFIX),
                      inductor=FEWER_LAUNCHES_INDUCTOR if mode.endswith(FEWER_LAUNCHES_SUFFIX) else None)


def build_for_throughput(config: Config, is_hf: bool, device: torch.device, compiled: bool,
                         compile_mode: str = "regional", loss_gemm: str | None = None,
                         twin_loss: str = "eager") -> torch.nn.Module:
    """Ours or the twin, in the config's precision, compiled if asked; the twin with ``twin_loss`` "compiled" as
    a TwinWithLoss (its loss then compiled with it)."""
    torch.manual_seed(config.seed)
    with device:
        model = hf_twin(config) if is_hf else GPT(config.model)
    model = model.to(dtype=torch.bfloat16 if config.precision == "bf16" else torch.float32).train()
    if is_hf and twin_loss == "compiled":
        model = TwinWithLoss(model)
    if loss_gemm is not None and not is_hf:
        set_loss_gemm(model, loss_gemm)
    if compiled:
        _compile(model, is_hf, compile_mode)
    return model


def _measure(config: Config, is_hf: bool, device: torch.device, compiled: bool, batch_size: int, warmup: int,
             steps: int, compile_mode: str = "regional", loss_gemm: str | None = None,
             twin_loss: str = "eager") -> StepTiming:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model = build_for_throughput(config, is_hf, device, compiled, compile_mode, loss_gemm, twin_loss)
    batch = torch.randint(0, config.model.vocab_size, (batch_size, config.model.seq_length + 1), device=device)
    try:
        timing = _time_steps(throughput_step(model, is_hf, batch), device, warmup, steps)
        if device.type != "cuda":
            return timing
        return replace(timing, peak_gib=torch.cuda.max_memory_allocated() / 2**30)
    finally:
        del model, batch
        _free(device)


def largest_batch(config: Config, is_hf: bool, device: torch.device, limit: int,
                  fits: Callable[[int], bool] | None = None) -> int:
    """Double the micro batch from 1 until a step runs out of memory or reaches ``limit``; the last that fit
    (0 if none did)."""
    def default_fits(batch_size: int) -> bool:
        out_of_memory = False
        try:
            _measure(config, is_hf, device, False, batch_size, warmup=1, steps=1)
        except RuntimeError as error:
            if not _is_oom(error):
                raise
            out_of_memory = True
        _free(device)  # outside the except block: the traceback no longer pins the failed step's tensors
        return not out_of_memory

    fits = fits or default_fits
    best, batch_size = 0, 1
    while batch_size <= limit and fits(batch_size):
        best, batch_size = batch_size, batch_size * 2
    return best


@dataclass(frozen=True)
class ThroughputRun:
    model: str  # a scheme label, or HF_TWIN (the HF model at rope's config)
    compiled: bool
    loss_gemm: str | None  # ours: model.lm_head.gemm; the HF twin: None
    compile_mode: str | None = None  # ours compiled: megatron_lite.model.compile's mode (None: the check's first)
    sdpa_kernel: str | None = None  # torch's SDPA kernel pinned for the row (None: the check's first)
    extra_loss_gemm: bool = False  # a row for a further --loss-gemm (its label names it)
    twin_loss: str | None = None  # the HF twin compiled: where its loss runs (--twin-loss); else None
    extra_twin_loss: bool = False  # a row for a further --twin-loss (its label names it)

    @property
    def is_hf(self) -> bool:
        return self.model == HF_TWIN

    @property
    def mode(self) -> str:
        return "compiled" if self.compiled else "eager"

    @property
    def label(self) -> str:
        """For progress lines: model, mode and what an extra row varies (loss GEMM, compile mode, SDPA kernel)."""
        extras = [extra for extra in (self.extra_loss_gemm and f"loss {self.loss_gemm}",
                                      self.extra_twin_loss and f"loss {self.twin_loss}", self.compile_mode,
                                      self.sdpa_kernel and f"sdpa {self.sdpa_kernel}") if extra]
        return f"{self.model} {self.mode}" + (f" ({', '.join(extras)})" if extras else "")


def throughput_runs(settings: CheckSettings) -> list[ThroughputRun]:
    """Eager rows first (every scheme, the extra loss-GEMM rows, the HF twin), then compiled ones (the paper's
    schemes first, then the HF twin, the twin with each extra --twin-loss, then rope in each extra compile mode,
    with each extra SDPA kernel, with each extra loss GEMM): a section budget cuts the most expensive rows, and the
    extra ones before the twin they are measured against."""
    schemes = list(settings.schemes or ())
    gemm, *extra_gemms = settings.loss_gemms
    timed_scheme = "rope" if "rope" in schemes else schemes[0]
    runs = [ThroughputRun(label, False, gemm) for label in schemes]
    runs += [ThroughputRun(timed_scheme, False, extra, extra_loss_gemm=True) for extra in extra_gemms]
    runs.append(ThroughputRun(HF_TWIN, False, None))
    runs += [ThroughputRun(label, True, gemm) for label in COMPILE_ORDER if label in schemes]
    twin_loss, *extra_twin_losses = settings.twin_losses
    runs.append(ThroughputRun(HF_TWIN, True, None, twin_loss=twin_loss))
    runs += [ThroughputRun(HF_TWIN, True, None, twin_loss=extra, extra_twin_loss=True) for extra in extra_twin_losses]
    runs += [ThroughputRun(timed_scheme, True, gemm, mode) for mode in settings.extra_compile_modes]
    runs += [ThroughputRun(timed_scheme, True, gemm, sdpa_kernel=kernel) for kernel in settings.sdpa_kernels[1:]]
    runs += [ThroughputRun(timed_scheme, True, extra, extra_loss_gemm=True) for extra in extra_gemms]
    return runs


def sdpa_kernel_context(kernel: str) -> contextlib.AbstractContextManager[Any]:
    """torch's SDPA pinned to ``kernel`` (one of SDPA_KERNELS) while a row compiles and runs; auto: torch's choice.
    A compiled graph takes the kernel chosen while it is traced, so the row's model is built and compiled inside."""
    if kernel == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    return sdpa_kernel(backends[kernel])


def loss_gemm_supported(config: Config) -> bool:
    """Whether this checkout's model has ``lm_head.gemm`` (built on the meta device: no memory, ~1 s)."""
    with torch.device("meta"):
        model = GPT(config.model)
    return hasattr(getattr(model, "lm_head", None), "gemm")


def _peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return known_peak_tflops(torch.cuda.get_device_name())


def _over_budget(settings: CheckSettings, section: str, since: float) -> str | None:
    budget = settings.budget_s(section)
    if settings.smoke or time.perf_counter() - since <= budget:
        return None
    return f"skipped: the section passed its {budget:.0f} s budget"


def section_throughput(settings: CheckSettings, progress: Progress) -> list[dict[str, Any]]:
    device = settings.device
    smoke = settings.smoke
    precision = "fp32" if smoke else "bf16"
    warmup, steps = (1, 2) if smoke else (2, 5) if settings.quick else (3, 8)
    peak = _peak_tflops(device)
    rows = []
    batches: dict[str, int] = {}
    gemm_option = loss_gemm_supported(big_config(settings, "rope", precision=precision))
    start = time.perf_counter()
    for run in throughput_runs(settings):
        config = big_config(settings, "rope" if run.is_hf else run.model, precision=precision)
        gemm = run.loss_gemm if gemm_option or run.loss_gemm is None else "n/a (no lm_head.gemm)"
        kernel = run.sdpa_kernel or settings.sdpa_kernels[0]
        row: dict[str, Any] = {"model": run.model, "mode": run.mode, "loss_gemm": gemm, "sdpa_kernel": kernel}
        compile_mode = run.compile_mode or settings.compile_mode
        if run.compiled:
            row["compile"] = "model.compile()" if run.is_hf else compile_mode
        if run.twin_loss is not None:
            row["twin_loss"] = run.twin_loss
        try:
            skipped = _over_budget(settings, "throughput", start)
            if skipped is None and run.compiled and smoke:
                skipped = "skipped: --smoke (compile is timed on the GPU)"
            if skipped is None and not gemm_option and run.loss_gemm not in (None, settings.loss_gemms[0]):
                skipped = "skipped: model.lm_head has no `gemm` attribute in this checkout"
            if skipped is not None:
                row["status"] = skipped
                rows.append(row)
                progress(f"  throughput {run.label}: {skipped}")
                continue
            if settings.micro_batch is not None or smoke:
                batch_size = settings.micro_batch or 2
            elif run.is_hf:
                batch_size = batches.get("rope", next(iter(batches.values()), 1))  # the same batch as ours
            elif run.model in batches:
                batch_size = batches[run.model]  # compiled: the batch eager found (compiled needs no more memory)
            else:
                batch_size = largest_batch(config, False, device, settings.max_batch)
                if batch_size == 0:
                    raise RuntimeError("out of memory at micro batch 1")
            if not run.is_hf:
                batches.setdefault(run.model, batch_size)
            timing = None
            while timing is None:
                try:
                    with sdpa_kernel_context(kernel):
                        timing = _measure(config, run.is_hf, device, run.compiled, batch_size, warmup, steps,
                                          compile_mode, run.loss_gemm, run.twin_loss or "eager")
                except RuntimeError as error:
                    if not _is_oom(error) or batch_size == 1:
                        raise
                    timing = None
                if timing is None:  # e.g. the HF twin at our batch: halve until it fits
                    _free(device)
                    batch_size //= 2
            seconds = timing.step_s
            tokens = batch_size * config.model.seq_length
            tflops = model_flops_per_token(config.model) * tokens / seconds / 1e12
            row.update(status="ok", micro_batch=batch_size, step_ms=seconds * 1e3, tokens_per_sec=tokens / seconds,
                       tflops=tflops, mfu=tflops / peak if peak else None)
            if run.compiled:
                row["compile_s"] = timing.first_step_s
            if timing.peak_gib is not None:
                row["peak_gib"] = timing.peak_gib
        except Exception as failure:  # noqa: BLE001
            row["status"] = f"failed: {_error_text(failure)}"
            _free(device)
        rows.append(row)
        progress(f"  throughput {run.label}: {_row_summary(row)}")
    return rows


# ----------------------------------------------------------------------------------------------
# memory

def long_context_backends(label: str, flash: bool, flex: bool) -> list[str]:
    """The scheme's long-context backend first, then flex as an extra row where available."""
    if variant_named(label).alibi_bias:
        backends = ["flash" if flash else "chunked"]
    else:
        backends = ["sdpa"]
    if flex:
        backends.append("flex")
    return backends


def section_memory(settings: CheckSettings, progress: Progress) -> list[dict[str, Any]]:
    from megatron_lite.bench.memory import track_peak_memory
    from megatron_lite.model.attention import flash_available
    from megatron_lite.model.flex import flex_available

    device = settings.device
    length, tail = (1024, 64) if settings.smoke else (32768, 512)
    rows = []
    start = time.perf_counter()
    for label in settings.schemes or ():
        for backend in long_context_backends(label, flash_available(), flex_available()):
            row: dict[str, Any] = {"scheme": label, "backend": backend, "tokens": length}
            # flex as training runs it: compiled (eager FlexAttention falls back to a path that materialises
            # the scores); the other backends are the same kernels eager or compiled
            compiled = backend == "flex"
            if compiled:
                row["compile"] = settings.compile_mode
            skipped = _over_budget(settings, "memory", start)
            if skipped is None and settings.smoke and backend == "flex":
                skipped = "skipped: track_peak_memory (CPU) cannot follow FlexAttention's operator"
            if skipped is not None:
                row["status"] = skipped
                rows.append(row)
                progress(f"  memory {label} {backend}: {skipped}")
                continue
            # learned positions stop at max_position_embeddings: a table as long as the window
            extra = (f"model.max_position_embeddings={length}",) if variant_named(label).position_table else ()
            try:
                config = big_config(settings, label, backend, precision="fp32" if settings.smoke else "bf16",
                                    extra=extra)
                if extra:
                    row["note"] = f"max_position_embeddings={length}"
                torch.manual_seed(config.seed)
                with device:
                    model = GPT(config.model).eval()
                if not settings.smoke:
                    model = model.to(torch.bfloat16)
                ids = torch.randint(0, config.model.vocab_size, (1, length), device=device)
                if compiled:  # the compile's own forward first: the measured one runs the compiled graphs
                    _compile(model, False, settings.compile_mode)
                    compile_start = time.perf_counter()
                    with torch.no_grad():
                        model(ids, logits_from=length - tail)
                    _sync(device)
                    row["compile_s"] = time.perf_counter() - compile_start
                if device.type == "cuda":
                    _free(device)
                    torch.cuda.reset_peak_memory_stats()
                    before = torch.cuda.memory_allocated()
                    with torch.no_grad():
                        model(ids, logits_from=length - tail)
                    torch.cuda.synchronize()
                    row.update(status="ok", peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                               above_weights_gib=(torch.cuda.max_memory_allocated() - before) / 2**30,
                               measured="torch.cuda.max_memory_allocated")
                else:
                    with torch.no_grad(), track_peak_memory() as tracker:
                        model(ids, logits_from=length - tail)
                    row.update(status="ok", peak_gib=tracker.peak_bytes / 2**30, above_weights_gib=tracker.peak_bytes / 2**30,
                               measured="track_peak_memory (CPU)")
                del model
            except Exception as failure:  # noqa: BLE001
                row["status"] = f"failed: {_error_text(failure)}"
            _free(device)
            rows.append(row)
            progress(f"  memory {label} {backend}: {_row_summary(row)}")
    return rows


# ----------------------------------------------------------------------------------------------
# sync

def section_sync(settings: CheckSettings, progress: Progress) -> list[dict[str, Any]]:
    schemes = list(settings.schemes or ())
    if settings.device.type != "cuda":
        rows = [{"scheme": label, "mode": mode, "status": "skipped: no CUDA"}
                for mode in ("eager", "compiled") for label in schemes]
        progress("  sync: skipped: no CUDA")
        return rows
    device = settings.device
    # the throughput rows' batch where it is fixed: the same compiled graphs, served by inductor's cache
    batch_size = settings.micro_batch or 2
    rows = []
    start = time.perf_counter()
    for compiled in (False, True):
        for label in [label for label in COMPILE_ORDER if label in schemes] if compiled else schemes:
            mode = "compiled" if compiled else "eager"
            row: dict[str, Any] = {"scheme": label, "mode": mode}
            if compiled:
                row["compile"] = settings.compile_mode
            skipped = _over_budget(settings, "sync", start)
            if skipped is not None:
                row["status"] = skipped
                rows.append(row)
                progress(f"  sync {label} {mode}: {row['status']}")
                continue
            try:
                config = big_config(settings, label)
                model = build_for_throughput(config, False, device, compiled, settings.compile_mode,
                                             settings.loss_gemms[0])
                batch = torch.randint(0, config.model.vocab_size, (batch_size, config.model.seq_length + 1),
                                      device=device)
                inputs, labels = batch[:, :-1], batch[:, 1:]
                model(inputs, labels=labels).backward()  # warm-up (compiles) outside the debug mode
                torch.cuda.synchronize()
                model.zero_grad(set_to_none=True)
                torch.cuda.set_sync_debug_mode("error")
                try:
                    model(inputs, labels=labels).backward()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                torch.cuda.synchronize()
                row["status"] = "ok"
                del model
            except Exception as failure:  # noqa: BLE001
                row["status"] = f"failing: {_error_text(failure)}"
            _free(device)
            rows.append(row)
            progress(f"  sync {label} {mode}: {row['status']}")
    return rows


def section_sequence_parallel(settings: CheckSettings, progress: Progress) -> list[dict[str, Any]]:
    """Per-GPU peak memory and tokens/s at P = 1, 2, 4, 8 (as many as the GPUs allow) of one long sequence
    (megatron_lite/bench/sequence_parallel_bench.py); one skipped row with fewer than 2 GPUs."""
    import tempfile

    from megatron_lite.bench.sequence_parallel_bench import run_sequence_parallel_bench

    gpus = 0 if settings.smoke else torch.cuda.device_count()
    if gpus < 2:
        return [{"status": f"skipped: sequence parallelism needs 2 or more GPUs ({gpus} here)"}]
    sizes = [size for size in (1, 2, 4, 8) if size <= gpus]
    with tempfile.TemporaryDirectory() as scratch:
        measured = run_sequence_parallel_bench(sizes, 32768, 3, Path(scratch))
    rows = [{"status": "ok", **row.__dict__, "peak_vs_p1": row.ratio_to(measured[0])} for row in measured]
    for row in rows:
        progress(f"  sequence_parallel: {_row_summary(row)}")
    return rows


def section_users_command(settings: CheckSettings, progress: Progress) -> list[dict[str, Any]]:
    """``deepspeed --num_gpus 1 train.py --config configs/coca_350m.yml`` for 20 steps on the given data
    (megatron_lite/bench/users_command.py); one skipped row without CUDA or without data."""
    from megatron_lite.bench.users_command import run_users_command

    _free(settings.device)  # the earlier sections' cached blocks: the run below is another process
    rows = []
    runs: list[tuple[int | None, str | None]] = [(micro_batch, None)
                                                 for micro_batch in settings.users_micro_batches or [None]]
    runs += [(micro_batch, variant) for variant, micro_batches in settings.users_variants().items()
             for micro_batch in micro_batches]
    start = time.perf_counter()
    for micro_batch, variant in runs:
        rows += run_users_command(settings.mix, settings.tokenizer, settings.vocab_size,
                                  settings.out / "users_command", cuda=settings.device.type == "cuda"
                                  and torch.cuda.is_available(),
                                  timeout_s=USERS_TIMEOUT_S["quick" if settings.quick else "full"], progress=progress,
                                  micro_batch=micro_batch, variant=variant,
                                  skipped=_over_budget(settings, "users_command", start))
        progress(f"  users_command: {_row_summary(rows[-1])}")
    return rows


SECTION_FUNCTIONS: dict[str, Callable[[CheckSettings, Progress], list[dict[str, Any]]]] = {
    "env": section_env, "parity": section_parity, "throughput": section_throughput, "memory": section_memory,
    "sequence_parallel": section_sequence_parallel, "train": section_train, "users_command": section_users_command,
    "sync": section_sync,
}


# ----------------------------------------------------------------------------------------------
# report

def _row_summary(row: dict[str, Any]) -> str:
    return ", ".join(f"{key}={_cell(value)}" for key, value in row.items() if key not in ("scheme", "backend", "model"))


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value != 0 and (abs(value) < 1e-2 or abs(value) >= 1e5):
            return f"{value:.3g}"
        return f"{value:,.3f}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def header(smoke: bool) -> list[str]:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and not smoke else "cpu"
    mode = " (--smoke: tiny config on CPU)" if smoke else ""
    return [f"# GPU check{mode}", "",
            f"Device: {device}; date {_now()}; torch {torch.__version__}; CUDA {torch.version.cuda or 'none'}.", ""]


def _settings_text(settings: dict[str, Any] | None) -> str:
    if not settings:
        return ""
    parts = ["--quick" if settings.get("quick") else "full profile", f"schemes {', '.join(settings['schemes'])}",
             f"micro batch {settings['micro_batch'] or ('2 (--smoke)' if settings.get('smoke') else 'searched')}",
             f"compile {settings['compile_mode']}",
             f"loss gemm {', '.join(settings['loss_gemms'])}"]
    return "; " + "; ".join(parts)


def render_markdown(results: dict[str, Any], smoke: bool) -> str:
    lines = header(smoke)
    for name in SECTIONS:
        if name not in results:
            continue
        section = results[name]
        rows = section["rows"]
        lines += [f"## {name}", "", f"{section['seconds']:.1f} s, finished {section['finished']}"
                  f"{_settings_text(section.get('settings'))}.", ""]
        columns: list[str] = []
        for row in rows:
            columns += [key for key in row if key not in columns]
        if rows:
            lines.append("| " + " | ".join(columns) + " |")
            lines.append("|" + "---|" * len(columns))
            lines += ["| " + " | ".join(_cell(row.get(key)) for key in columns) + " |" for row in rows]
        else:
            lines.append("(no rows)")
        lines.append("")
    return "\n".join(lines)


def load_results(out: Path) -> dict[str, Any]:
    path = out / JSON_NAME
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error}); remove it or pass --force") from error
    return data if isinstance(data, dict) else {}


def write_results(out: Path, results: dict[str, Any], smoke: bool) -> None:
    write_text_atomic(out / JSON_NAME, json.dumps(results, indent=2) + "\n")
    write_text_atomic(out / MD_NAME, render_markdown(results, smoke))


def run_check(settings: CheckSettings, progress: Progress = print) -> dict[str, Any]:
    """Run the chosen sections (skipping finished ones unless ``force``); returns the whole results dict."""
    if not settings.smoke and not torch.cuda.is_available():
        raise ValueError(NO_CUDA_MESSAGE)
    if not settings.smoke:
        enable_tf32()  # as train.py does on CUDA by default (train.tf32), for our model and the twin alike
    settings.out.mkdir(parents=True, exist_ok=True)
    sections = list(settings.sections or ())
    results = {} if settings.force and set(sections) == set(settings.profile_sections) else load_results(settings.out)
    for name in sections:
        if name in results and not settings.force:
            progress(f"{name}: already finished at {results[name].get('finished')}, skipped (--force redoes it)")
            continue
        progress(f"{name}: start")
        start = time.perf_counter()
        threads = torch.get_num_threads()
        if settings.smoke:  # tiny models: one thread is fastest, and much faster on a shared, busy CPU
            torch.set_num_threads(1)
        try:
            rows = SECTION_FUNCTIONS[name](settings, progress)
        finally:
            torch.set_num_threads(threads)
        seconds = time.perf_counter() - start
        results[name] = {"rows": rows, "seconds": seconds, "finished": _now(), "settings": settings.to_dict()}
        write_results(settings.out, results, settings.smoke)
        if name in ("env", "train"):
            for row in rows:
                progress(f"  {name}: {_row_summary(row) if name == 'train' else row['item'] + ' = ' + row['value']}")
        progress(f"{name}: finished in {seconds:.1f} s")
    if not (settings.out / MD_NAME).is_file() or not sections:
        write_results(settings.out, results, settings.smoke)
    return results
