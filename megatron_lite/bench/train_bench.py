"""Training throughput: our GPT vs Hugging Face GPTNeoXForCausalLM, and CoCA vs RoPE, in one run.

One step = forward, float32 cross entropy, backward, AdamW step — the same plain-PyTorch step for
every model, so the ratios compare the models, not the loops. Models are timed in interleaved
rounds (A B C D, A B C D, ...) and the median per model is reported, so machine noise hits all of
them alike. With CUDA, the 350M config is also timed in bf16 for tokens/s, TFLOP/s and MFU.

Compiled vs eager: for every position scheme on the same config, the training step as our trainer runs
it (``model(inputs, labels=labels)``: the fused chunked loss, backward, AdamW) is timed eagerly and with
the model compiled in place (``model.compile()``, inductor by default). Compilation and warm-up are
excluded; the two variants of every scheme are timed in interleaved rounds and medians reported, with
the compiled/eager tokens/s ratio per scheme (target >= 1.0).
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from megatron_lite import config as config_lib
from megatron_lite.config import Config
from megatron_lite.model import GPT, language_model_loss
from megatron_lite.model.variants import LABELS, SchemeVariant, variant_named
from megatron_lite.training.metrics import known_peak_tflops, model_flops_per_token

COMPILE_SCHEMES = LABELS  # every scheme is timed compiled vs eager

# label -> our scheme variant, or None for transformers' GPTNeoXForCausalLM
MODELS: dict[str, SchemeVariant | None] = {
    "hf_gpt_neox_rope": None,
    "ours_rope": variant_named("rope"),
    "ours_coca_slack": variant_named("coca_slack"),
    "ours_coca_strict": variant_named("coca_strict"),
}


@dataclass
class TrainBenchSettings:
    config_path: str = "configs/tiny/rope.yml"
    batch_size: int = 16
    rounds: int = 5
    steps_per_round: int = 3
    warmup_steps: int = 2
    threads: int | None = None
    seed: int = 1234
    gpu_config_path: str = "configs/coca_350m.yml"
    gpu_batch_size: int = 16
    # schemes timed compiled vs eager (keys of COMPILE_SCHEMES); empty skips the compiled rows
    compile_schemes: list[str] = field(default_factory=lambda: list(COMPILE_SCHEMES))
    compile_backend: str = "inductor"
    compile_warmup_steps: int = 3  # the first compiles forward and backward; the rest settle


@dataclass
class TrainBenchResult:
    settings: dict[str, Any]
    meta: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)
    ratios: dict[str, float] = field(default_factory=dict)
    gpu: dict[str, Any] | None = None
    compile_records: list[dict[str, Any]] = field(default_factory=list)
    compile_ratios: dict[str, float] = field(default_factory=dict)


def hf_gpt_neox(config: Config) -> torch.nn.Module:
    """A stock transformers GPTNeoXForCausalLM with our dimensions (parallel residual, untied, SDPA)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    model = config.model
    hf_config = GPTNeoXConfig(
        vocab_size=model.padded_vocab_size, hidden_size=model.hidden_size, num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_attention_heads, intermediate_size=model.ffn_size, hidden_act="gelu",
        max_position_embeddings=model.max_positions, layer_norm_eps=model.layernorm_epsilon,
        use_parallel_residual=model.gpt_j_residual, tie_word_embeddings=not model.no_weight_tying,
        attention_dropout=0.0, hidden_dropout=0.0,
        rope_parameters={"rope_type": "default", "rope_theta": model.position.rotary_emb_base,
                         "partial_rotary_factor": model.position.rotary_pct},
    )
    hf_config._attn_implementation = "sdpa"
    return GPTNeoXForCausalLM(hf_config)


def _step_fn(model: torch.nn.Module, is_hf: bool, batch: torch.Tensor) -> Callable[[], None]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    inputs, labels = batch[:, :-1], batch[:, 1:]  # (B, T)

    def step() -> None:
        logits = model(inputs).logits if is_hf else model(inputs)  # (B, T, V)
        loss = language_model_loss(logits, labels) if not is_hf else F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def _fused_step_fn(model: torch.nn.Module, batch: torch.Tensor) -> Callable[[], None]:
    """The trainer's step: GPT.forward(ids, labels=labels) returns the (fused, chunked) loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    inputs, labels = batch[:, :-1], batch[:, 1:]  # (B, T)

    def step() -> None:
        loss = model(inputs, labels=labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def _scheme_model(config: Config, variant: SchemeVariant) -> GPT:
    torch.manual_seed(config.seed)
    model = GPT(config_lib.with_overrides(config, variant.overrides).model).train()
    model.use_loss_settings(config.train)  # the loss head the trainer would run
    return model


def _build(label: str, config: Config) -> tuple[torch.nn.Module, bool]:
    spec = MODELS[label]
    torch.manual_seed(config.seed)
    if spec is None:
        return hf_gpt_neox(config).train(), True
    return _scheme_model(config, spec), False


def _interleaved(steps: dict[str, Callable[[], None]], settings: TrainBenchSettings,
                 progress: Callable[[str], None], prefix: str = "") -> dict[str, list[float]]:
    """Seconds per step of every entry, timed in interleaved rounds (A B C, A B C, ...)."""
    times: dict[str, list[float]] = {label: [] for label in steps}
    for round_index in range(settings.rounds):
        for label, step in steps.items():
            start = time.perf_counter()
            for _ in range(settings.steps_per_round):
                step()
            times[label].append((time.perf_counter() - start) / settings.steps_per_round)
        progress(f"{prefix}round {round_index + 1}/{settings.rounds}: " + ", ".join(
            f"{label} {times[label][-1] * 1e3:.0f} ms" for label in steps))
    return times


def _check_compile_schemes(settings: TrainBenchSettings) -> None:
    unknown = [name for name in settings.compile_schemes if name not in COMPILE_SCHEMES]
    if unknown:
        raise ValueError(f"compile schemes {unknown}: expected some of {list(COMPILE_SCHEMES)}")


def run_cpu_comparison(settings: TrainBenchSettings, progress: Callable[[str], None] = print) -> TrainBenchResult:
    _check_compile_schemes(settings)  # before the minutes of the first part
    if settings.threads:
        torch.set_num_threads(settings.threads)
    config = config_lib.load(settings.config_path)
    model_config = config.model
    tokens_per_step = settings.batch_size * model_config.seq_length
    batch = torch.randint(0, model_config.vocab_size, (settings.batch_size, model_config.seq_length + 1),
                          generator=torch.Generator().manual_seed(settings.seed))
    steps: dict[str, Callable[[], None]] = {}
    parameters: dict[str, int] = {}
    for label in MODELS:
        model, is_hf = _build(label, config)
        parameters[label] = sum(p.numel() for p in model.parameters())
        steps[label] = _step_fn(model, is_hf, batch)
        for _ in range(settings.warmup_steps):
            steps[label]()
    times = _interleaved(steps, settings, progress)
    result = TrainBenchResult(
        settings=settings.__dict__.copy(),
        meta={"device": "cpu", "torch": torch.__version__, "threads": torch.get_num_threads(),
              "machine": platform.machine(), "tokens_per_step": tokens_per_step,
              "model": {"layers": model_config.num_layers, "hidden": model_config.hidden_size,
                        "heads": model_config.num_attention_heads, "seq_length": model_config.seq_length,
                        "padded_vocab": model_config.padded_vocab_size}},
    )
    for label in MODELS:
        seconds = statistics.median(times[label])
        result.records.append({"model": label, "parameters": parameters[label], "step_ms": seconds * 1e3,
                               "tokens_per_sec": tokens_per_step / seconds})
    speed = {r["model"]: r["tokens_per_sec"] for r in result.records}
    result.ratios = {
        "ours_rope_vs_hf": speed["ours_rope"] / speed["hf_gpt_neox_rope"],
        "coca_slack_vs_rope": speed["ours_coca_slack"] / speed["ours_rope"],
        "coca_strict_vs_rope": speed["ours_coca_strict"] / speed["ours_rope"],
    }
    if settings.compile_schemes:
        run_compile_comparison(settings, config, batch, result, progress)
    return result


def run_compile_comparison(settings: TrainBenchSettings, config: Config, batch: torch.Tensor,
                           result: TrainBenchResult, progress: Callable[[str], None] = print) -> None:
    """Fill result.compile_records / compile_ratios: every scheme's fused-loss step eager and compiled."""
    _check_compile_schemes(settings)
    tokens_per_step = batch.shape[0] * (batch.shape[1] - 1)
    steps: dict[str, Callable[[], None]] = {}
    compile_seconds: dict[str, float] = {}
    for name in settings.compile_schemes:
        for mode in ("eager", "compiled"):
            model = _scheme_model(config, variant_named(name))
            if mode == "compiled":
                model.compile(backend=settings.compile_backend)
            step = _fused_step_fn(model, batch)
            start = time.perf_counter()
            for _ in range(settings.compile_warmup_steps if mode == "compiled" else settings.warmup_steps):
                step()
            if mode == "compiled":
                compile_seconds[name] = time.perf_counter() - start
                progress(f"compiled {name} ({settings.compile_backend}): {compile_seconds[name]:.1f} s "
                         "compile + warm-up")
            steps[f"{name}/{mode}"] = step
    times = _interleaved(steps, settings, progress, prefix="compile ")
    for name in settings.compile_schemes:
        eager, compiled = (statistics.median(times[f"{name}/{mode}"]) for mode in ("eager", "compiled"))
        result.compile_records.append({
            "scheme": name, "eager_step_ms": eager * 1e3, "compiled_step_ms": compiled * 1e3,
            "eager_tokens_per_sec": tokens_per_step / eager, "compiled_tokens_per_sec": tokens_per_step / compiled,
            "compile_and_warmup_s": compile_seconds[name]})
        result.compile_ratios[name] = eager / compiled


def run_gpu_mfu(settings: TrainBenchSettings, steps: int = 10) -> dict[str, Any]:
    """Tokens/s, TFLOP/s and MFU of the 350M config at seq 512 in bf16 on one GPU (plain PyTorch step)."""
    config = config_lib.load(settings.gpu_config_path, ["precision=bf16"])
    device = torch.device("cuda")
    torch.manual_seed(config.seed)
    with device:
        model = GPT(config.model).to(torch.bfloat16).train()
    batch = torch.randint(0, config.model.vocab_size, (settings.gpu_batch_size, config.model.seq_length + 1), device=device)
    step = _step_fn(model, False, batch)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    tokens = settings.gpu_batch_size * config.model.seq_length
    tflops = model_flops_per_token(config.model) * tokens / seconds / 1e12
    name = torch.cuda.get_device_name()
    peak = known_peak_tflops(name)
    return {"device": name, "config": settings.gpu_config_path, "batch": settings.gpu_batch_size,
            "seq_length": config.model.seq_length, "tokens_per_sec": tokens / seconds, "tflops": tflops,
            "mfu": tflops / peak if peak else None, "peak_tflops": peak,
            "max_memory_gb": torch.cuda.max_memory_allocated() / 1e9}


def format_report(result: TrainBenchResult) -> str:
    meta = result.meta
    model = meta["model"]
    lines = [
        f"Training throughput on {meta['device']} ({meta['machine']}, torch {meta['torch']}, {meta['threads']} threads): "
        f"{model['layers']} layers, hidden {model['hidden']}, {model['heads']} heads, seq {model['seq_length']}, "
        f"vocab {model['padded_vocab']}, batch {meta['tokens_per_step'] // model['seq_length']}; fp32; median of "
        f"{result.settings['rounds']} interleaved rounds of {result.settings['steps_per_round']} steps.",
        "",
        "| model | parameters | step ms | tokens/s |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {r['model']} | {r['parameters']:,} | {r['step_ms']:.1f} | {r['tokens_per_sec']:,.0f} |"
              for r in result.records]
    targets = {"ours_rope_vs_hf": 1.0, "coca_slack_vs_rope": 0.95, "coca_strict_vs_rope": 0.95}
    lines += ["", "| ratio | value | target | |", "|---|---:|---:|---|"]
    lines += [f"| {name} | {value:.3f} | ≥ {targets[name]:.2f} | {'PASS' if value >= targets[name] else 'FAIL'} |"
              for name, value in result.ratios.items()]
    if result.compile_records:
        lines += ["", f"Compiled ({result.settings['compile_backend']}, model.compile() in place) vs eager: the "
                      "trainer's step (fused chunked loss, backward, AdamW); compile and warm-up excluded; median "
                      f"of {result.settings['rounds']} interleaved rounds.", "",
                  "| scheme | eager tokens/s | compiled tokens/s | compiled/eager | target | | compile s |",
                  "|---|---:|---:|---:|---:|---|---:|"]
        for r in result.compile_records:
            ratio = result.compile_ratios[r["scheme"]]
            lines.append(f"| {r['scheme']} | {r['eager_tokens_per_sec']:,.0f} | {r['compiled_tokens_per_sec']:,.0f} | "
                         f"{ratio:.3f} | ≥ 1.00 | {'PASS' if ratio >= 1.0 else 'FAIL'} | "
                         f"{r['compile_and_warmup_s']:.1f} |")
    else:
        lines += ["", "Compiled vs eager: not measured (--no-compile)."]
    if result.gpu is not None:
        gpu = result.gpu
        mfu = f"{gpu['mfu']:.1%}" if gpu["mfu"] is not None else "n/a (unknown peak)"
        lines += ["", f"GPU {gpu['device']}: {gpu['config']} bf16, batch {gpu['batch']} x {gpu['seq_length']}: "
                      f"{gpu['tokens_per_sec']:,.0f} tokens/s, {gpu['tflops']:.1f} TFLOP/s, MFU {mfu}, "
                      f"peak memory {gpu['max_memory_gb']:.1f} GB"]
    else:
        lines += ["", "GPU: not measured (no CUDA device)."]
    return "\n".join(lines) + "\n"
