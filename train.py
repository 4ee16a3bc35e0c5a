#!/usr/bin/env python
"""Train a GPT with DeepSpeed: deepspeed train.py --config FILE (1..N GPUs, multi-node), or plain
python train.py --config FILE (one process, CPU or GPU).

Everything a run writes goes to --run-dir (default runs/<config name>): config.yml, metrics.jsonl,
loss_curve.png, checkpoints/, wandb/. Data (tokenizer, shards, sample order) is cached in
data.cache_dir and built on first use.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_lite.cli import cli_main, run_cli
from megatron_lite.training.resume_target import check_resume_target

if TYPE_CHECKING:
    from megatron_lite.config import Config


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="example: python train.py --config configs/tiny/coca_slack.yml "
                                            "--set model.position.constraint=strict --train-iters 100")
    parser.add_argument("--config", required=True, help="YAML config, e.g. configs/coca_350m.yml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set train.zero_stage=2 (repeatable)")
    parser.add_argument("--run-dir", type=Path, default=None, help="output directory (default runs/<config name>)")
    parser.add_argument("--train-iters", type=int, default=None, help="optimizer steps (overrides train.train_iters)")
    parser.add_argument("--resume", default="auto", metavar="auto|PATH|none",
                        help="auto: continue from the run dir's latest complete checkpoint if any (default); "
                             "PATH: a run dir or a step dir; none: start fresh (a consolidated or Hugging Face dir: "
                             "--set train.init_from=PATH)")
    parser.add_argument("--wait-for-lock", type=float, default=0.0, metavar="SECONDS",
                        help="if another live run holds the run dir's lock (run.lock), wait up to SECONDS for it to "
                             "end instead of stopping at once (a re-queued job waiting out its predecessor)")
    parser.add_argument("--verify-data", action="store_true",
                        help="check every data shard's sha256 and token ids, even if the cache records them as "
                             "verified (done once per shard set anyway)")
    parser.add_argument("--verbose", action="store_true",
                        help="print the data cache's full summary (sources, skipped records) even when the cache is "
                             "reused as it was (default: in full once, when built; one line after)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    return parser


def validate_arguments(args: argparse.Namespace, run_dir: Path) -> None:
    """The command line's own errors, before DeepSpeed starts or any directory is made."""
    if args.train_iters is not None and args.train_iters <= 0:
        raise ValueError(f"--train-iters {args.train_iters}: must be positive")
    if not args.wait_for_lock >= 0:
        raise ValueError(f"--wait-for-lock {args.wait_for_lock}: must be a number of seconds >= 0")
    check_resume_target(args.resume)  # the kind of dir it names; a consolidated or HF dir: train.init_from
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"--run-dir {run_dir}: exists and is not a directory")


def check_launch(config: Config) -> None:
    """What the ranks launched (WORLD_SIZE, set by the launcher; 1 without one) decide for ``config``, checked
    before DeepSpeed starts: the batch triple and the sequence-parallel size. Found only after the process
    group is up, each would cost a first start its JIT build of DeepSpeed's CPU op (40 s to 2 minutes) first."""
    world = os.environ.get("WORLD_SIZE", "1")
    if not world.isdigit() or int(world) < 1:
        return  # the launcher's business; init_distributed reports it
    import torch

    from megatron_lite.training.deepspeed_config import resolve_batch_sizes
    from megatron_lite.training.distributed import DistributedInfo
    from megatron_lite.training.sequence_parallel import with_sequence_parallel

    ranks = DistributedInfo(rank=0, local_rank=0, world_size=int(world), device=torch.device("cpu"))
    resolve_batch_sizes(config, with_sequence_parallel(ranks, config.train.sequence_parallel_size).data_parallel_size)


def check_float8_device(config: Config) -> None:
    """train.fp8's device check, before any data work (a tokenizer trained, a dataset fetched from the hub) or
    anything written: a run that cannot train in FP8 here stops first, with one line."""
    if config.train.fp8 == "none":
        return
    import torch

    from megatron_lite.model.float8 import float8_problem

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    problem = float8_problem(config.train.fp8, config.train.fused_loss, device)
    if problem:
        raise ValueError(problem)


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run_dir = args.run_dir or Path("runs") / Path(args.config).stem
    validate_arguments(args, run_dir)
    from megatron_lite import config as config_lib

    config = config_lib.load(args.config, args.set)
    check_launch(config)
    check_float8_device(config)
    from megatron_lite.training.data import set_verbose_summary

    set_verbose_summary(args.verbose)
    from megatron_lite.training.loop import run_training

    from megatron_lite.training.distributed import shutdown_distributed

    try:
        result = run_training(config, run_dir, resume=args.resume, train_iters=args.train_iters,
                              verify_data=args.verify_data, wait_for_lock=args.wait_for_lock)
    except ValueError:  # a refusal (the run dir locked, a checkpoint of another width, ...), met on every rank
        # The launcher SIGTERMs the ranks still running once one has exited 2; each exits 2 by itself in a moment.
        # SIG_IGN, not a Python handler: the interpreter resets its own handlers to the default as it finalizes,
        # and the signal may land then. Nothing starts a process from here on, so none inherits it.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        shutdown_distributed()  # else a rank may abort in gloo's teardown instead of exiting 2
        raise
    shutdown_distributed()  # several ranks: every one returned past the run's last barrier; the process exits next
    return result.exit_code


if __name__ == "__main__":
    run_cli(main)
