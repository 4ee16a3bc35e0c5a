#!/usr/bin/env python
"""The fused loss head's GEMM modes (train.loss_gemm: fp32, mixed, input_dtype) and Hugging Face's plain head:
loss and gradient errors against float64 on CPU; with a GPU also milliseconds and peak memory per forward +
backward at the 350M head (64 x 512 tokens, hidden 1024, vocabulary 50,048).

    python tools/bench_loss_precision.py [--tokens 2048 --hidden 256 --vocab 8192] [--gpu-only]

The logic lives in megatron_lite/bench/loss_precision.py.
"""

from __future__ import annotations

import argparse

import torch

from megatron_lite.bench.loss_precision import HeadSettings, cuda_rows, format_rows, precision_rows
from megatron_lite.cli import cli_main, run_cli

GPU_HEAD = HeadSettings(tokens=64 * 512, hidden=1024, vocab=50_048, chunk_tokens=4096)


@cli_main
def main(argv: list[str] | None = None) -> int:
    defaults = HeadSettings()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=defaults.tokens)
    parser.add_argument("--hidden", type=int, default=defaults.hidden)
    parser.add_argument("--vocab", type=int, default=defaults.vocab)
    parser.add_argument("--chunk-tokens", type=int, default=defaults.chunk_tokens)
    parser.add_argument("--gpu-only", action="store_true", help="skip the CPU precision table")
    args = parser.parse_args(argv)
    settings = HeadSettings(tokens=args.tokens, hidden=args.hidden, vocab=args.vocab, chunk_tokens=args.chunk_tokens)
    if not args.gpu_only:
        print(format_rows(precision_rows(settings), f"bf16 heads vs float64 on CPU: {settings.tokens} tokens, hidden "
                                                    f"{settings.hidden}, vocabulary {settings.vocab}"))
    if torch.cuda.is_available():
        print(format_rows(cuda_rows(GPU_HEAD), f"on {torch.cuda.get_device_name()}: {GPU_HEAD.tokens} tokens, hidden "
                                               f"{GPU_HEAD.hidden}, vocabulary {GPU_HEAD.vocab}, chunk "
                                               f"{GPU_HEAD.chunk_tokens}; peak above the inputs"))
    return 0


if __name__ == "__main__":
    run_cli(main)
