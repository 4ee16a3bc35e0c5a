#!/usr/bin/env python
"""One-GPU acceptance check: environment, backend parity vs the fp32 reference, 32K-token forward memory,
training throughput and MFU (ours eager / compiled, and Hugging Face GPT-NeoX), a ~60 s real train.py run, the
users' command (deepspeed train.py --config configs/coca_350m.yml) on given data, and host-sync freedom of the
training step; rows in OUT/gpu_check.json and OUT/gpu_check.md.

    python tools/gpu_check.py --out OUT [--only env,parity,...] [--force] [--smoke] [--board PATH | --repo-board | --no-board]
    python tools/gpu_check.py --quick --out OUT [--schemes rope,coca_slack] [--micro-batch 64]
        [--compile-mode regional[,whole]] [--loss-gemm mixed,input_dtype] [--twin-loss eager,compiled]
        [--mix MIX --tokenizer TOKENIZER --vocab-size N]

--quick: at most ~6 minutes on an H100 (sections env, parity, memory, throughput, users_command, sync; rope
and coca_slack; one micro batch, no search). --mix/--tokenizer/--vocab-size give the users_command section its
data (tools/gpu/check_gpu.sh passes a bundle's); without them that section is a skipped row.
Each section's rows are written as it finishes; a re-run skips finished sections unless --force.
--smoke runs the sections on the tiny config on the CPU in seconds (to check the tool itself).
A finished check appends one row to the results board OUT/results_board.md (megatron_lite/results_board.py;
--board PATH elsewhere, --repo-board the repository's docs/results.md, --no-board none);
--board-only appends the row for what OUT already holds and measures nothing (a check cut short by a timeout).
The logic lives in megatron_lite/bench/gpu_check.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from megatron_lite import results_board
from megatron_lite.bench.gpu_check import load_results, run_check
from megatron_lite.bench.gpu_check_settings import (BENCH_COMPILE_MODES, LOSS_GEMMS, QUICK_SECTIONS, SDPA_KERNELS,
                                                    SECTIONS, TWIN_LOSSES, CheckSettings, parse_compile_modes,
                                                    parse_loss_gemms, parse_micro_batches, parse_schemes,
                                                    parse_sdpa_kernels, parse_sections, parse_twin_losses)
from megatron_lite.cli import cli_main, run_cli


def board_row(results: dict[str, Any], settings: CheckSettings, measured: list[str], smoke: bool) -> dict[str, str]:
    """The results board's GPU-checks cells; --quick names itself, and the users' command (a real train.py run)
    fills the train.py tokens/s cell where the check ran no train section."""
    board_results = dict(results)
    if "train" not in board_results and "users_command" in board_results:
        board_results["train"] = board_results.pop("users_command")
    sections = list(settings.sections or ())
    row = results_board.gpu_check_row(board_results, smoke=smoke, sections=sections,
                                      all_sections=settings.profile_sections, measured=measured,
                                      device=results_board.device_name(cpu=smoke))
    if settings.quick:
        row["run"] = row["run"].replace("gpu_check", "gpu_check --quick", 1)
    return row


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for gpu_check.json / gpu_check.md")
    parser.add_argument("--only", default=None, metavar="SECTION,...",
                        help=f"sections to run: {', '.join(SECTIONS)} (--quick: {', '.join(QUICK_SECTIONS)})")
    parser.add_argument("--force", action="store_true", help="redo sections already finished in OUT")
    parser.add_argument("--smoke", action="store_true", help="tiny config on the CPU, seconds: checks the tool")
    parser.add_argument("--quick", action="store_true",
                        help="the one-allocation profile, <= ~6 min on an H100: fewer sections and schemes, one batch")
    parser.add_argument("--schemes", default=None, metavar="LABEL,...",
                        help="scheme labels to check (default: every scheme; --quick: rope,coca_slack)")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="fixed throughput micro batch, no search (halved only on out-of-memory; --quick: 64)")
    parser.add_argument("--max-batch", type=int, default=64, help="largest micro batch the throughput search tries")
    parser.add_argument("--compile-mode", default="regional", metavar="MODE,...",
                        help=f"how our model is compiled ({', '.join(BENCH_COMPILE_MODES)}; "
                             "megatron_lite.model.compile; -cudagraphs: with inductor's CUDA graphs, -max-autotune: "
                             "with its GEMM autotuning and fused epilogues, -fewer-launches: with its combo kernels "
                             "and no mix-order reduction, measurements only): the first for every "
                             "compiled row of ours, each further one an extra compiled rope throughput row; the HF "
                             "twin: model.compile()")
    parser.add_argument("--loss-gemm", default="mixed", metavar="GEMM,...",
                        help=f"model.lm_head.gemm ({', '.join(LOSS_GEMMS)}): the first for every row of ours, each "
                             "further one an extra rope throughput row eager and one compiled")
    parser.add_argument("--sdpa-kernel", default="auto", metavar="KERNEL,...",
                        help=f"torch's SDPA kernel ({', '.join(SDPA_KERNELS)}; auto: torch's own choice, named in "
                             "env): the first for every throughput row, each further one an extra compiled rope row")
    parser.add_argument("--twin-loss", default="eager", metavar="WHERE,...",
                        help=f"where the Hugging Face twin's cross entropy runs when it is compiled "
                             f"({', '.join(TWIN_LOSSES)}: outside its compiled model, or compiled with it): the "
                             "first for the twin's compiled row, each further one an extra compiled twin row")
    parser.add_argument("--mix", type=Path, default=None, help="users_command: the data mix file")
    parser.add_argument("--tokenizer", type=Path, default=None, help="users_command: the mix's tokenizer model")
    parser.add_argument("--vocab-size", type=int, default=None, help="users_command: model.vocab_size for it")
    parser.add_argument("--users-micro-batch", default=None, metavar="N,...",
                        help="users_command: one run per micro batch (the global batch stays the config's 256; "
                             "default: the config's 16)")
    parser.add_argument("--users-no-cuda-graphs", default=None, metavar="N,...",
                        help="users_command: one more run per micro batch given here, with train.cuda_graphs=false "
                             "(the config's runs replay the compiled regions as CUDA graphs by default on a GPU; "
                             "default: none)")
    parser.add_argument("--users-cpp-wrapper", default=None, metavar="N,...",
                        help="users_command: one more run per micro batch given here, with "
                             "train.compile_cpp_wrapper=true (the compiled graphs launched from C++; default: none)")
    parser.add_argument("--board-only", action="store_true",
                        help="measure nothing: append the board row for the sections OUT already holds")
    results_board.add_board_arguments(parser)
    args = parser.parse_args(argv)
    if args.max_batch < 1:
        raise ValueError(f"--max-batch {args.max_batch}: must be >= 1")
    for flag, path in (("--mix", args.mix), ("--tokenizer", args.tokenizer)):
        if path is not None and not path.is_file():
            raise ValueError(f"{flag} {path}: no such file")
    compile_modes = parse_compile_modes(args.compile_mode)
    settings = CheckSettings(out=args.out, sections=parse_sections(args.only, quick=args.quick), smoke=args.smoke,
                             force=args.force, quick=args.quick, schemes=parse_schemes(args.schemes),
                             micro_batch=args.micro_batch, max_batch=args.max_batch, compile_mode=compile_modes[0],
                             extra_compile_modes=compile_modes[1:],
                             loss_gemms=parse_loss_gemms(args.loss_gemm),
                             sdpa_kernels=parse_sdpa_kernels(args.sdpa_kernel),
                             twin_losses=parse_twin_losses(args.twin_loss),
                             mix=args.mix.resolve() if args.mix else None,
                             tokenizer=args.tokenizer.resolve() if args.tokenizer else None, vocab_size=args.vocab_size,
                             users_micro_batches=parse_micro_batches(args.users_micro_batch),
                             users_no_cuda_graphs=parse_micro_batches(args.users_no_cuda_graphs,
                                                                      "--users-no-cuda-graphs") or [],
                             users_cpp_wrapper=parse_micro_batches(args.users_cpp_wrapper, "--users-cpp-wrapper") or [])
    board = results_board.board_from_args(args)
    if args.board_only:
        if board is None:
            raise ValueError("--board-only: there is no board to write (--no-board)")
        results = load_results(args.out)
        if not results:
            raise ValueError(f"--board-only: {args.out} holds no gpu_check.json")
        chosen = list(settings.sections or ())
        row = board_row({name: section for name, section in results.items() if name in chosen}, settings,
                        measured=[], smoke=args.smoke)
        missing = [name for name in chosen if name not in results]
        row["this call"] = ("row only, from OUT: " + ", ".join(name for name in chosen if name in results)
                            + (f"; not finished: {', '.join(missing)}" if missing else ""))
        board.append(results_board.GPU_CHECKS, row)
        print(f"appended a row to {board.path}")
        return 0
    previous = {} if args.force else load_results(args.out)
    results = run_check(settings, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(f"wrote {args.out / 'gpu_check.md'} and {args.out / 'gpu_check.json'}")
    if board is not None:
        measured = [name for name in settings.sections or () if name not in previous]
        board.append(results_board.GPU_CHECKS, board_row(results, settings, measured, smoke=args.smoke))
        print(f"appended a row to {board.path}")
    return 0


if __name__ == "__main__":
    run_cli(main)
