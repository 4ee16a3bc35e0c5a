"""The paper-350m profile: the CoCA paper's own run, four 350M models on 8 GPUs (docs/reproduction.md).

The models are configs/repro/paper350m/*.yml, each naming one of the repository's 350M configs as its base
(the paper's model, AdamW schedule and global batch 256 x 512 tokens). They train on a mix file read in
place (``--mix``, default configs/data/paper_mix.yml) for one step count that a token budget sets
(``--tokens``, default the paper's: ``train.train_epochs`` = 2 passes over its ~50B-token sample). Every
model is launched through the deepspeed launcher on all local GPUs (``--num-gpus``) or a hostfile.

Before anything runs, the budget is printed and kept in ``OUT/budget.json``: tokens per model and in all,
and hours on 1 and 8 GPUs (``run_length.PLAN_DEVICES``) from ``model_flops_per_token`` and ``KNOWN_PEAK_TFLOPS``
at an MFU given (``--mfu``), measured by the user (``--gpu-check``, a paper-350m row on the results board) or
else the project's own measurement (``run_length.MEASURED``), said which.

``--dry-run``: the same phases on CPU, 2 ranks through the real launcher, a toy model and a few steps.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_lite.config import Config
from megatron_lite.files import write_text_atomic
from megatron_lite.repro.settings import REPO_ROOT, SCHEMES, ReproSettings, config_path

DRY_RUN_RANKS = 2
# The toy model of a dry run: 2 layers, width 32, length 32, fp32, a 384-piece tokenizer; global batch 16 =
# micro 4 x 2 accumulation x 2 ranks (the accumulation derived, as in the real run); a checkpoint every 2 steps.
DRY_RUN_MODEL = ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=2",
                 "model.intermediate_size=64", "model.seq_length=32", "model.max_position_embeddings=32",
                 "model.vocab_size=384", "precision=fp32", "train.compile=false", "train.train_batch_size=16",
                 "train.train_micro_batch_size_per_gpu=4", "train.log_interval=1", "train.eval_interval=0",
                 "train.save_interval=2", "train.num_workers=0", "train.wandb.mode=disabled",
                 "data.num_workers=1", "data.validation_fraction=0.05", "data.tokenizer.sample_chars=200000"]
DRY_RUN_TOKENS = 4 * 16 * 32  # 4 steps of the toy model
_SUFFIXES = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def parse_tokens(text: str) -> int:
    """A token count: 100B, 2.5B, 300M, 5e9 or 1000000."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", text)
    if match is None:
        raise ValueError(f"--tokens {text!r}: expected a number of tokens such as 100B, 300M or 5e9")
    tokens = round(float(match.group(1)) * _SUFFIXES[match.group(2).upper()])
    if tokens < 1:
        raise ValueError(f"--tokens {text!r}: must be at least one token")
    return tokens


def paper_tokens(config: Config) -> int:
    """The paper's tokens per model: ``train.train_epochs`` passes over its ~50B-token sample."""
    # imported here, not at the top: `python -m megatron_lite.repro.run_length` imports this module first
    from megatron_lite.repro.run_length import PAPER_SAMPLE_TOKENS

    return round(config.train.train_epochs * PAPER_SAMPLE_TOKENS)


# ----------------------------------------------------------------------------------------------
# The launcher


def hostfile_slots(hostfile: Path) -> int:
    """The GPU slots a DeepSpeed hostfile names, read by DeepSpeed's own parser."""
    from deepspeed.launcher.runner import fetch_hostfile
    from deepspeed.utils import logger

    level = logger.level
    logger.setLevel(logging.CRITICAL)  # it logs the whole file before raising: the error below says it in one line
    try:
        resources = fetch_hostfile(str(hostfile))
    except ValueError as error:
        raise ValueError(f"--hostfile {hostfile}: {error}") from None
    finally:
        logger.setLevel(level)
    if not resources:
        raise ValueError(f"--hostfile {hostfile}: names no host (lines 'HOST slots=N')")
    return sum(resources.values())


def world_size(settings: ReproSettings) -> int:
    """Data-parallel ranks of every model: the hostfile's slots, --num-gpus, 2 in a dry run, else every local
    GPU."""
    paper = settings.paper
    if paper.hostfile is not None:
        return hostfile_slots(paper.hostfile)
    if paper.num_gpus is not None:
        return paper.num_gpus
    if settings.dry_run:
        return DRY_RUN_RANKS
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        raise ValueError("--num-gpus: this machine has no CUDA GPU; give --hostfile for other nodes, or --dry-run "
                         "for the CPU check")
    return count


def launcher_prefix(settings: ReproSettings, ranks: int) -> list[str]:
    """``python -m deepspeed.launcher.runner`` (the ``deepspeed`` command) with the hostfile or the rank count;
    a dry run takes a free port, so it never meets another job's rendezvous."""
    from megatron_lite.training.distributed import free_port

    paper = settings.paper
    command = [settings.python, "-m", "deepspeed.launcher.runner"]
    command += ["--hostfile", str(paper.hostfile)] if paper.hostfile is not None else ["--num_gpus", str(ranks)]
    port = paper.master_port if paper.master_port is not None else free_port() if settings.dry_run else None
    return command + ([] if port is None else ["--master_port", str(port)])


def profile_overrides(settings: ReproSettings) -> list[str]:
    return list(DRY_RUN_MODEL) if settings.dry_run else []


def environment(settings: ReproSettings) -> dict[str, str]:
    """Environment of the launcher: a dry run hides every GPU, so it runs on CPU on a GPU machine too."""
    return {"CUDA_VISIBLE_DEVICES": ""} if settings.dry_run else {}


# ----------------------------------------------------------------------------------------------
# MFU: measured, given or assumed


@dataclass(frozen=True)
class MfuEstimate:
    value: float
    kind: str  # "measured", "given" or "assumed"
    source: str  # where the number comes from, in words


def mfu_from_gpu_check(path: Path) -> MfuEstimate | None:
    """The MFU of a gpu_check.json: its users' command (train.py through DeepSpeed, what the run is), else the
    slowest of the four schemes' training-step MFU (compiled rows where there are any): every model must train,
    so the slowest sets the time. None when no row has an MFU (e.g. --smoke)."""
    try:
        results = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"--gpu-check {path}: not a readable gpu_check.json ({error})") from None
    device = next((row["value"] for row in results.get("env", {}).get("rows", []) if row.get("item") == "device"),
                  "unknown device")
    users = [row for row in results.get("users_command", {}).get("rows", [])
             if row.get("status") == "ok" and row.get("mfu")]
    if users:
        return MfuEstimate(float(users[-1]["mfu"]), "measured",
                           f"gpu_check {path} on {device}: the users' command, one GPU")
    rows = [row for row in results.get("throughput", {}).get("rows", [])
            if row.get("model") in SCHEMES and row.get("status") == "ok" and row.get("mfu")]
    rows = [row for row in rows if row["mode"] == "compiled"] or rows
    if not rows:
        return None
    slowest = min(rows, key=lambda row: row["mfu"])
    return MfuEstimate(float(slowest["mfu"]), "measured",
                       f"gpu_check {path} on {device}: the slowest scheme, {slowest['model']} {slowest['mode']}, "
                       f"micro batch {slowest.get('micro_batch')}, one GPU")


def _percent(cell: str) -> float | None:
    match = re.fullmatch(r"\s*([0-9.]+)\s*%\s*", cell)
    return float(match.group(1)) / 100 if match else None


def mfu_from_board(path: Path) -> MfuEstimate | None:
    """The newest real (``full``) paper-350m reproduction row with an MFU on the results board (8-GPU training,
    the best evidence). None when there is none. A GPU check's MFU column is not used: it is the bare model's at
    micro batch 64 (45.5% for CoCA slack on the H200 whose users' command trained at 43.5%), above what training reaches."""
    from megatron_lite import results_board

    if not path.is_file():
        return None
    measured = [(mfu, row) for row in results_board.read_rows(path, results_board.REPRODUCTIONS)
                if row.get("kind") == "full" and row.get("run") == "reproduce paper-350m"
                and (mfu := _percent(row.get("MFU", ""))) is not None]
    if not measured:
        return None
    mfu, row = measured[-1]
    return MfuEstimate(mfu, "measured", f"results board {path}, '{results_board.REPRODUCTIONS}' row of {row['date']} "
                                        f"on {row['device']} ({row['run']}, commit {row['commit']})")


def budget_mfu(settings: ReproSettings) -> MfuEstimate:
    """--mfu, else gpu_check.json's measurement, else the board's, else the project's (run_length.MEASURED)."""
    from megatron_lite.repro.run_length import MEASURED

    paper = settings.paper
    if paper.mfu is not None:
        return MfuEstimate(paper.mfu, "given", "--mfu")
    measured = mfu_from_gpu_check(paper.gpu_check) if paper.gpu_check is not None else None
    if measured is None and paper.board is not None:
        measured = mfu_from_board(paper.board)
    if measured is not None:
        return measured
    return MfuEstimate(MEASURED.mfu, "measured", MEASURED.describe())


# ----------------------------------------------------------------------------------------------
# The budget


def plan_budget(settings: ReproSettings, config: Config, ranks: int, mfu: MfuEstimate) -> dict[str, Any]:
    """Tokens, steps and hours of the run (every model trains the same steps)."""
    from megatron_lite.model.params import counted_parameter_count
    from megatron_lite.repro.run_length import PAPER_SAMPLE_TOKENS, RunLength, plan_hours
    from megatron_lite.training.deepspeed_config import resolve_batch_sizes
    from megatron_lite.training.metrics import model_flops_per_token

    scheme = settings.schemes[0]
    if settings.paper.tokens is not None:
        requested, source = settings.paper.tokens, "--tokens"
    elif settings.dry_run:
        requested, source = DRY_RUN_TOKENS, "the dry run's 4 toy steps"
    else:
        requested = paper_tokens(config)
        source = (f"the paper's: {config.train.train_epochs:g} epochs (train.train_epochs of "
                  f"{_shown(config_path(settings, scheme))}) x its ~{PAPER_SAMPLE_TOKENS / 1e9:g}B-token sample "
                  "(section 4)")
    # ValueError (one line) when the global batch does not divide over the ranks
    step_tokens = resolve_batch_sizes(config, ranks).tokens_per_step(config.model.seq_length)
    run = RunLength(requested, step_tokens)
    train_iters, per_model = run.steps, run.tokens
    models = len(settings.schemes)
    flops = model_flops_per_token(config.model)
    hours = {name: {"peak_tflops": row["peak_tflops"], "hours_per_model": round(row["hours"], 2),
                    "hours_total": round(models * row["hours"], 2)}
             for name, row in plan_hours(per_model, flops, mfu.value).items()}
    return {"schemes": list(settings.schemes), "tokens_requested": requested, "tokens_source": source,
            "ranks": ranks, "global_batch": step_tokens // config.model.seq_length,
            "seq_length": config.model.seq_length, "tokens_per_step": step_tokens, "train_iters": train_iters,
            "tokens_per_model": per_model, "tokens_total": models * per_model,
            "parameters": counted_parameter_count(config.model), "flops_per_token": flops,
            "mfu": mfu.value, "mfu_kind": mfu.kind, "mfu_source": mfu.source, "hours": hours,
            "dry_run": settings.dry_run}


def _shown(path: Path) -> str:
    """``path`` relative to the repository when inside it."""
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def budget_text(plan: dict[str, Any]) -> str:
    """The budget arithmetic, as printed before the run and written to tables.md."""
    models = len(plan["schemes"])
    lines = [
        f"Budget{' (dry run: the toy model)' if plan['dry_run'] else ''}: {models} models "
        f"({', '.join(plan['schemes'])}), {plan['parameters']:,} parameters each, on {plan['ranks']} rank(s)",
        f"  tokens per model  {plan['tokens_requested']:,} requested ({plan['tokens_source']})",
        f"                    = {plan['train_iters']:,} steps x {plan['tokens_per_step']:,} tokens (global batch "
        f"{plan['global_batch']} x length {plan['seq_length']}) = {plan['tokens_per_model']:,} tokens",
        f"  tokens in all     {plan['tokens_total']:,}",
        f"  FLOPs per token   {plan['flops_per_token'] / 1e9:.4g} GFLOP (training, "
        "megatron_lite.training.metrics.model_flops_per_token)",
        f"  MFU               {plan['mfu']:.1%}, {plan['mfu_kind']} ({plan['mfu_source']})",
    ]
    for name, row in plan["hours"].items():
        lines.append(f"  {name.replace('x', ' x ', 1):<16}  {row['hours_per_model']:,.1f} h per model, "
                     f"{row['hours_total']:,.1f} h in all ({row['peak_tflops']:g} TFLOP/s bf16 dense peak each, "
                     "KNOWN_PEAK_TFLOPS)")
    lines.append("  hours = tokens x FLOPs per token / (GPUs x peak x MFU); data preparation, start-up and "
                 "evaluation not included")
    return "\n".join(lines)


def budget_path(settings: ReproSettings) -> Path:
    return settings.out_dir / "budget.json"


def announce_budget(settings: ReproSettings, configs: dict[str, Config]) -> dict[str, Any]:
    """Plan the run, print the arithmetic unless printed already (also with --quiet: it is what the user is
    about to spend) and keep it in OUT/budget.json."""
    first = configs[settings.schemes[0]]
    plan = plan_budget(settings, first, world_size(settings), budget_mfu(settings))
    if not settings.paper.budget_printed:
        print(budget_text(plan), flush=True)
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(budget_path(settings), json.dumps(plan, indent=1) + "\n")
    return plan
