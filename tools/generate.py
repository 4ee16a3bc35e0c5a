#!/usr/bin/env python
"""Sample text from a checkpoint: the smallest way to see that a model works.

    python tools/generate.py runs/coca_slack --prompt "The old man" --max-new-tokens 80 \\
        --temperature 0.8 --top-p 0.9 --scaling dynamic:4
"""

from __future__ import annotations

import argparse

from megatron_lite.cli import cli_main, run_cli
from megatron_lite.data.tokenizer import model_tokenizer
from megatron_lite.eval.generation import generate_text
from megatron_lite.eval.scaling import parse_scaling
from megatron_lite.model.gpt import DTYPES
from megatron_lite.weights import load_model


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("checkpoint", help="run dir (latest checkpoint), step dir or consolidated dir")
    parser.add_argument("--prompt", default="", help="text to continue (empty: start a new document)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument("--scaling", default="none", help="RoPE scaling: none | dynamic:F | linear:F | ntk:F | yarn:F")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    parser.add_argument("--tokenizer", default=None,
                        help="SentencePiece .model, tokenizer.json or a directory holding one (default: the checkpoint's)")
    return parser.parse_args(argv)


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    scaling = parse_scaling(args.scaling)
    loaded = load_model(args.checkpoint, args.device, DTYPES[args.dtype])
    if scaling.type != "none":
        loaded.model.set_rope_scaling(scaling.config())
    tokenizer = model_tokenizer(args.tokenizer, loaded.tokenizer_path, loaded.config.model, args.checkpoint)
    texts = generate_text(loaded.model, tokenizer, args.prompt, args.max_new_tokens,
                          args.temperature, args.top_k, args.top_p, args.num_samples, args.seed)
    for index, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- sample {index + 1}")
        print(args.prompt + text)
    return 0


if __name__ == "__main__":
    run_cli(main)
