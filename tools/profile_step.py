#!/usr/bin/env python
"""Profile training steps of one model on a GPU: torch.profiler's table, sorted by self CUDA time.

    python tools/profile_step.py [--scheme coca_slack] [--micro-batch 64] [--compile regional|whole]
        [--loss-gemm mixed|input_dtype|fp32] [--model ours|hf_twin] [--out TABLE.txt] [--trace TRACE.json.gz]

--model hf_twin profiles the Hugging Face twin the GPU check times (--compile: its own model.compile()). Below the
table, the GEMMs by shape and the TFLOP/s each ran at; --trace keeps the profiler's trace (for Perfetto, or
tools/gemm_table.py).

The logic lives in megatron_lite/bench/step_profile.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_lite.bench.step_profile import MODELS, ProfileSettings, profile_step
from megatron_lite.cli import cli_main, run_cli
from megatron_lite.model.compile import COMPILE_MODES
from megatron_lite.model.loss import LOSS_GEMMS
from megatron_lite.model.variants import LABELS


@cli_main
def main(argv: list[str] | None = None) -> int:
    defaults = ProfileSettings()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheme", choices=LABELS, default=defaults.label)
    parser.add_argument("--micro-batch", type=int, default=defaults.micro_batch)
    parser.add_argument("--compile", choices=COMPILE_MODES, default=None, help="default: eager")
    parser.add_argument("--loss-gemm", choices=LOSS_GEMMS, default=defaults.loss_gemm)
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--model", choices=MODELS, default=defaults.model,
                        help="ours (--scheme) or the Hugging Face twin (GPT-NeoX, RoPE, bf16 logits)")
    parser.add_argument("--out", type=Path, default=None, metavar="TABLE.txt")
    parser.add_argument("--trace", type=Path, default=None, metavar="TRACE.json.gz", help="keep the trace here")
    args = parser.parse_args(argv)
    table = profile_step(ProfileSettings(label=args.scheme, micro_batch=args.micro_batch, compile_mode=args.compile,
                                         loss_gemm=args.loss_gemm, steps=args.steps, model=args.model,
                                         trace_path=args.trace))
    print(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    run_cli(main)
