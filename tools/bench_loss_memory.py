#!/usr/bin/env python
"""Peak memory of the LM loss forward+backward at the 350M head (hidden 1024, vocabulary 50,048,
8 x 512 tokens), fused chunked head vs plain, in one run (target: fused <= 25% of plain).

    python tools/bench_loss_memory.py [--hidden 1024] [--vocab 50048] [--tokens 4096] [--chunk-tokens 512] [--json OUT]

The logic lives in megatron_lite/bench/loss_memory.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from megatron_lite.bench.loss_memory import format_report, run
from megatron_lite.cli import cli_main, run_cli


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50_048)
    parser.add_argument("--tokens", type=int, default=8 * 512)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--json", type=Path, default=None, metavar="OUT.json")
    args = parser.parse_args(argv)
    result = run(args.hidden, args.vocab, args.tokens, args.chunk_tokens)
    print(format_report(result), end="")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**dataclasses.asdict(result), "ratio": result.ratio}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    run_cli(main)
