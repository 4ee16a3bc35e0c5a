#!/usr/bin/env python
"""What inductor generates for CUDA for the compiled regions, on a machine without a GPU.

    python -m dev.inductor_cuda_code [--scheme rope] [--micro-batch 16] [--inductor NAME=VALUE ...]
        [--compile-mode regional|whole] [--layers N] [--blocks-per-region K] [--out DIR]

Prints, for each compiled region's forward and backward (regional: one transformer block, or --blocks-per-region K
of them, and the LM head; whole: the model at --layers layers; bf16, an H200's device answers), the Triton kernels
its wrapper launches, its library calls (GEMMs, attention), the ATen reductions it runs between them, and inductor's
bytes per token; --out keeps each generated wrapper. --inductor takes inductor settings as train.compile_options
does (e.g. triton.mix_order_reduction=false). Needs a CUDA build of torch (pip's default wheel, which runs without
a GPU) and triton; written against the GPU node's torch 2.11.0+cu130 with triton 3.6. Run from the repository root
(dev/ is not installed). The logic lives in dev/cuda_lowering.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dev.cuda_lowering import format_lowering, lower_for_cuda, lowering_settings
from megatron_lite.cli import cli_main, run_cli
from megatron_lite.model.compile import COMPILE_MODES
from megatron_lite.model.variants import LABELS


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/coca_350m.yml")
    parser.add_argument("--scheme", choices=LABELS, default="rope")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--inductor", action="append", default=[], metavar="NAME=VALUE",
                        help="an inductor setting (torch._inductor.config name), as train.compile_options takes it")
    parser.add_argument("--compile-mode", choices=COMPILE_MODES, default="regional")
    parser.add_argument("--layers", type=int, default=1, help="the model's depth with --compile-mode whole")
    parser.add_argument("--blocks-per-region", type=int, default=1,
                        help="blocks of one compiled region with --compile-mode regional "
                             "(train.compile_blocks_per_region)")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR", help="write each generated wrapper here")
    args = parser.parse_args(argv)
    settings = lowering_settings(args.config, args.scheme, args.micro_batch, args.inductor, args.compile_mode,
                                 args.layers, args.blocks_per_region)
    graphs = lower_for_cuda(settings)
    print(format_lowering(graphs, settings))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        for graph in graphs:
            name = f"{settings.scheme}_micro_batch_{settings.micro_batch}_{graph.name.replace(' ', '_')}.py"
            (args.out / name).write_text(graph.code)
    return 0


if __name__ == "__main__":
    run_cli(main)
