#!/usr/bin/env python
"""Convert checkpoints: DeepSpeed run/step dirs, consolidated safetensors dirs, Hugging Face dirs.

    python tools/convert_checkpoint.py runs/coca_350m hf/coca_350m --to hf            # -> transformers
    python tools/convert_checkpoint.py runs/coca_350m/checkpoints/step_00001000 ckpt --to safetensors
    python tools/convert_checkpoint.py pythia-160m pythia_ml --to megatron_lite [--coca slack]
    python tools/convert_checkpoint.py runs/coca_350m/checkpoints/step_00001000 ucp --to universal

INPUT is a run dir (latest complete checkpoint), a DeepSpeed step dir (any ZeRO stage, any world
size), a consolidated dir (config.yml + model.safetensors) or an HF model dir; the line printed
names the training step exported from a run or step dir. Outputs are safetensors only, except
--to universal: DeepSpeed's universal checkpoint of a run or step dir (weights and optimizer state,
loadable on any number of ranks; STEP/universal is the one a resume on another GPU count makes and reuses). A
non-empty OUTPUT is refused unless --force. The logic lives in megatron_lite/convert/;
docs/conversion.md explains every direction.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_lite import checkpoint_dirs
from megatron_lite.cli import cli_main, run_cli
from megatron_lite.convert import TARGETS, convert_checkpoint
from megatron_lite.convert.conversion import ConversionResult
from megatron_lite.model.gpt import DTYPES
from megatron_lite.training.run_lock import live_run_holds


def describe_input(input_path: str, result: ConversionResult) -> str:
    """What INPUT was, in the line printed: a run dir is named as one (the converter read its latest complete
    checkpoint, a step dir), with the training step exported."""
    try:
        kind = checkpoint_dirs.checkpoint_kind(Path(input_path))
    except ValueError:
        kind = result.source_kind
    step = "" if result.step is None else f", training step {result.step}"
    if kind == "run":
        return f"run dir: its latest complete checkpoint{step}"
    names = {"step": "step dir", "consolidated": "consolidated dir", "hf": "Hugging Face dir"}
    return names.get(kind, f"{kind} dir") + step


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("input", help="run dir, step dir, consolidated dir or Hugging Face model dir")
    parser.add_argument("output", help="directory to write (must be empty or absent unless --force)")
    parser.add_argument("--to", required=True, choices=TARGETS,
                        help="hf: transformers model dir; safetensors / megatron_lite: consolidated dir for load_model and "
                             "training; universal: DeepSpeed universal checkpoint of a run or step dir")
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES), help="weight dtype of the output (default fp32)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty OUTPUT")
    parser.add_argument("--coca", choices=("slack", "strict"), default=None,
                        help="turn a RoPE model into CoCA (T initialised from the K projection; logits change until fine-tuned)")
    args = parser.parse_args(argv)
    run_dir = Path(args.input)
    if (run_dir / checkpoint_dirs.CHECKPOINTS_DIR).is_dir() and not live_run_holds(run_dir):
        checkpoint_dirs.remove_abandoned_saves(run_dir / checkpoint_dirs.CHECKPOINTS_DIR)  # no writer left
    result = convert_checkpoint(args.input, args.output, args.to, dtype=args.dtype, force=args.force, coca=args.coca)
    scheme = result.config.model.position.label
    print(f"{args.input} ({describe_input(args.input, result)}) -> {result.output} (--to {args.to}, {args.dtype}, "
          f"scheme {scheme})")
    if args.to == "hf":
        remote = ", trust_remote_code=True" if result.needs_remote_code else ""
        print(f"load with: AutoModelForCausalLM.from_pretrained({str(result.output)!r}{remote})")
    return 0


if __name__ == "__main__":
    run_cli(main)
