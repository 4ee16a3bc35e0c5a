"""The gpu-speedrun profile: the data bundle as the mix, the throughput probe and the step count it sets.

The four models (configs/repro/speedrun/*.yml: 8 layers, width 512, 8 heads, length 512, bf16, compiled
on CUDA) train on the bundle's pre-tokenised shards through two ``type: megatron`` sources (75% books,
25% Python code). Before the first model trains, every scheme runs ``probe_steps`` steps
(``OUT/probe/<scheme>``); the slowest steady-state tokens/s and the largest start-up cost (process,
DeepSpeed, compile) turn the budget into one step count for all four, kept in ``OUT/probe.json`` so a
resumed or split run trains every model to the same step. The probe also fills the compile cache
(``TORCHINDUCTOR_CACHE_DIR`` = ``OUT/inductor_cache``), so the models' own compiles are warm.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from megatron_lite.config import Config
from megatron_lite.files import write_text_atomic
from megatron_lite.repro.bundle import UnpackedBundle, unpack_bundle, unpacked_at
from megatron_lite.repro.settings import CODE_WEIGHT, TEXT_WEIGHT, ReproSettings, SpeedrunBudget, log

DRY_RUN_MODEL = ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=2",
                 "model.intermediate_size=64", "model.seq_length=32", "model.max_position_embeddings=32",
                 "precision=fp32", "train.compile=false", "train.train_micro_batch_size_per_gpu=4",
                 "train.log_interval=1", "train.eval_interval=0", "train.num_workers=0", "data.num_workers=1"]
DRY_RUN_CURVE = ["train.extrapolation_eval.windows=[1, 2, 4]", "train.extrapolation_eval.scored_tokens_per_book=32"]
DRY_RUN_MAX_ITERS = 3  # the dry run proves the phases, not the numbers
# The speedrun model's reference throughput, the plan printed before the probe measures this device: one H200,
# 2026-11-27, commit b6274a8 (at ZeRO 0), the probe's figures for RoPE, the slower of the pair: 664,882 tokens/s
# steady, 36.9 s of start-up (process, DeepSpeed, compile). Its 2,162-step training then ran at 593,010 tokens/s
# with the curve's evaluations (docs/reproduction.md, "Results: gpu-speedrun"; benchmarks/runs/
# 2026-11-27_speedrun-pair_h200).
REFERENCE_MEASUREMENT = {"device": "one NVIDIA H200", "date": "2026-11-27", "commit": "b6274a8",
                         "tokens_per_sec": 664_882.0, "startup_seconds": 36.9}
PROBE_LOG_INTERVAL = 5
# More passes over the bundle than this and a model mostly re-reads what it has seen: the H200 pair of 2026-11-27
# made 11.8 over a 6M-token bundle (training loss 3.4 against validation 4.6); the profile's default bundle holds 30M.
QUIET_PASSES = 4.0


def bundle_dir(settings: ReproSettings) -> Path:
    return settings.out_dir / "data" / "bundle"


def unpack(settings: ReproSettings) -> UnpackedBundle:
    """The bundle, checked against its sha256, unpacked under OUT/data/bundle and verified (a no-op when it
    already is)."""
    assert settings.bundle is not None
    return unpack_bundle(settings.bundle, bundle_dir(settings), sha256=settings.bundle_sha256)


def bundle_mix_document(bundle: UnpackedBundle) -> dict[str, Any]:
    """The mix: the bundle's two shard directories read in place with its tokenizer."""
    tokenizer = str(bundle.tokenizer)
    return {
        "description": "CoCA speedrun: the data bundle's pre-tokenised Gutenberg books (text) and Python sources "
                       "(code), 75/25 by tokens",
        "groups": {
            "text": {"weight": TEXT_WEIGHT, "sources": {
                "gutenberg_books": {"type": "megatron", "path": str(bundle.text_shards), "tokenizer": tokenizer}}},
            "code": {"weight": CODE_WEIGHT, "sources": {
                "python_code": {"type": "megatron", "path": str(bundle.code_shards), "tokenizer": tokenizer}}},
        },
    }


def profile_overrides(settings: ReproSettings, bundle: UnpackedBundle) -> list[str]:
    """The bundle's tokenizer and vocabulary for every model; the toy model in a dry run."""
    overrides = [f"data.tokenizer.model={json.dumps(str(bundle.tokenizer))}", f"model.vocab_size={bundle.vocab_size}"]
    return overrides + (DRY_RUN_MODEL + DRY_RUN_CURVE if settings.dry_run else [])


def environment(settings: ReproSettings) -> dict[str, str]:
    """Environment of train.py: the compile cache kept in OUT, so the probe's compiles serve the models."""
    return {"TORCHINDUCTOR_CACHE_DIR": str(settings.out_dir / "inductor_cache")}


# ----------------------------------------------------------------------------------------------
# The probe


def probe_path(settings: ReproSettings) -> Path:
    return settings.out_dir / "probe.json"


def probe_scheme(settings: ReproSettings, scheme: str, config: Config) -> dict[str, Any]:
    """``probe_steps`` steps of one scheme from scratch; its steady tokens/s and start-up seconds (which
    include train.py's final save: an upper bound, as the budget wants)."""
    from megatron_lite.repro.training import (TRAIN_COMMAND_RANKS, TrainingFailed, run_logged, steady_tokens_per_second,
                                              tokens_per_step, train_command)
    from megatron_lite.training.metrics import read_metrics

    run = settings.out_dir / "probe" / scheme
    shutil.rmtree(run, ignore_errors=True)  # an interrupted probe starts over: it must time a cold start
    steps = settings.budget.probe_steps
    command = train_command(settings, scheme, steps, run_dir=run)
    command += ["--set", f"train.log_interval={min(PROBE_LOG_INTERVAL, max(1, steps // 3))}",
                "--set", "train.eval_interval=0", "--set", "train.save_interval=0",
                "--set", "train.extrapolation_eval.interval=0"]  # the probe times training only
    log_path = settings.out_dir / "logs" / f"probe_{scheme}.log"
    start = time.perf_counter()
    exit_code = run_logged(command, log_path, settings.progress, settings.threads, environment(settings))
    wall = time.perf_counter() - start
    if exit_code != 0:
        raise TrainingFailed(f"the probe of {scheme} (train.py) exited with code {exit_code} (log {log_path})")
    rate = steady_tokens_per_second(read_metrics(run / "metrics.jsonl"))
    if rate is None:
        raise TrainingFailed(f"the probe of {scheme} logged no throughput ({run / 'metrics.jsonl'})")
    training_seconds = steps * tokens_per_step(config, TRAIN_COMMAND_RANKS) / rate
    shutil.rmtree(run / "checkpoints", ignore_errors=True)  # only the timing is kept
    return {"steps": steps, "tokens_per_sec": round(rate, 1), "wall_seconds": round(wall, 1),
            "startup_seconds": round(max(0.0, wall - training_seconds), 1)}


def plan_train_iters(budget: SpeedrunBudget, probes: dict[str, dict[str, Any]], step_tokens: int,
                     models: int) -> dict[str, Any]:
    """One step count for every model from the probe: the budget left after each model's start-up and
    evaluation allowance, split evenly, at the slowest scheme's tokens/s; capped at ``max_train_tokens``."""
    slowest = min(probe["tokens_per_sec"] for probe in probes.values())
    startup = max(probe["startup_seconds"] for probe in probes.values())
    train_seconds = ((budget.total_seconds - budget.report_seconds) / models - startup - budget.eval_seconds_per_model
                     - budget.curve_seconds_per_model)
    by_budget = math.floor(max(0.0, train_seconds) * slowest / step_tokens)
    by_cap = budget.max_train_tokens // step_tokens
    return {"train_iters": min(by_budget, by_cap), "limited_by": "budget" if by_budget <= by_cap else "token cap",
            "train_seconds_per_model": round(train_seconds, 1), "slowest_tokens_per_sec": slowest,
            "startup_seconds": startup, "tokens_per_step": step_tokens, "budget": asdict(budget)}


def reference_plan(settings: ReproSettings) -> dict[str, Any]:
    """The budget's plan at the reference measurement (``REFERENCE_MEASUREMENT``) for the shipped speedrun model,
    a dry run's toy model notwithstanding: what a GPU run of these settings should train."""
    from megatron_lite import config as config_lib
    from megatron_lite.repro.settings import config_path
    from megatron_lite.repro.training import TRAIN_COMMAND_RANKS, tokens_per_step

    shipped = config_lib.load(config_path(settings, settings.schemes[0]))
    step_tokens = tokens_per_step(shipped, TRAIN_COMMAND_RANKS)
    budget, models = settings.budget, len(settings.schemes)
    plan = plan_train_iters(budget, {"reference": REFERENCE_MEASUREMENT}, step_tokens, models)
    per_model = (plan["startup_seconds"] + budget.eval_seconds_per_model + budget.curve_seconds_per_model
                 + plan["train_iters"] * step_tokens / plan["slowest_tokens_per_sec"])
    return {**plan, "tokens_per_model": plan["train_iters"] * step_tokens, "models": models,
            "expected_minutes": round((per_model * models + budget.report_seconds) / 60, 1),
            "reference": REFERENCE_MEASUREMENT}


def announce_reference_plan(settings: ReproSettings) -> dict[str, Any]:
    """Print the GPU plan before anything trains; the probe then replaces the reference with this device."""
    plan = reference_plan(settings)
    reference = plan["reference"]
    training = (f"{plan['train_iters']:,} steps = {plan['tokens_per_model'] / 1e6:,.1f}M tokens each, "
                f"{plan['train_seconds_per_model']} s of training per model, about {plan['expected_minutes']} min "
                f"in all" if plan["train_iters"] else "no training time left at the reference: raise --budget-seconds")
    log(settings, f"GPU plan at the reference measurement ({reference['device']}, {reference['date']}, commit "
                  f"{reference['commit']}: {reference['tokens_per_sec']:,.0f} tokens/s, "
                  f"{reference['startup_seconds']:g} s start-up): {plan['models']} models "
                  f"({', '.join(settings.schemes)}), {training} (budget {settings.budget.total_seconds:g} s); the "
                  "probe measures this device and sets the steps")
    return plan


def data_passes_line(tokens_per_model: int, bundle_tokens: int) -> str:
    """How often each model reads the bundle at the planned step count, with a hint where that is a lot."""
    passes = tokens_per_model / bundle_tokens
    line = (f"data: {tokens_per_model / 1e6:,.1f}M training tokens per model = {passes:.1f} passes over the "
            f"bundle's {bundle_tokens / 1e6:,.2f}M tokens")
    if passes > QUIET_PASSES:
        line += (f" (more than {QUIET_PASSES:g}: the models mostly re-read their data; a larger bundle, "
                 "tools/build_data_bundle.py --min-tokens, repeats less)")
    return line


def planned_iters(settings: ReproSettings, configs: dict[str, Config]) -> int:
    """The probe's step count (probing the schemes not probed yet), or --train-iters when given."""
    if settings.train_iters is not None:
        return settings.train_iters
    path = probe_path(settings)
    record: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {"probes": {}}
    if "plan" not in record:
        if "probe" not in settings.phases:
            raise ValueError(f"--only {','.join(settings.phases)}: no step count yet ({path} is missing); run the "
                             "probe phase first or pass --train-iters")
        for scheme in settings.schemes:
            if scheme not in record["probes"]:
                log(settings, f"probe {scheme}: {settings.budget.probe_steps} steps")
                record["probes"][scheme] = probe_scheme(settings, scheme, configs[scheme])
                write_text_atomic(path, json.dumps(record, indent=1) + "\n")
        from megatron_lite.repro.training import TRAIN_COMMAND_RANKS, tokens_per_step

        step_tokens = tokens_per_step(configs[settings.schemes[0]], TRAIN_COMMAND_RANKS)  # the runs train_command starts
        record["plan"] = plan_train_iters(settings.budget, record["probes"], step_tokens, len(settings.schemes))
        write_text_atomic(path, json.dumps(record, indent=1) + "\n")
    plan = record["plan"]
    log(settings, f"probe: slowest {plan['slowest_tokens_per_sec']:,.0f} tokens/s, start-up {plan['startup_seconds']} s"
                  f" -> {plan['train_iters']:,} steps per model ({plan['limited_by']}; "
                  f"{plan['train_seconds_per_model']} s of training each)")
    iters = int(plan["train_iters"])
    if settings.dry_run:
        iters = max(1, min(iters, DRY_RUN_MAX_ITERS))
    elif iters < settings.budget.min_train_iters:
        raise ValueError(f"{path}: the probe allows only {iters} steps per model in the {settings.budget.total_seconds:g} s "
                         "budget; this device is too slow for the speedrun (pass --train-iters or --budget-seconds)")
    unpacked = unpacked_at(bundle_dir(settings))  # None before the data phase has unpacked the bundle
    if unpacked is not None:
        log(settings, data_passes_line(iters * int(plan["tokens_per_step"]), unpacked.tokens))
    return iters

