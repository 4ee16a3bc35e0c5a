#!/usr/bin/env python
"""Peak memory of the LM loss forward+backward on CPU, fused chunked head vs plain, in one run, at the
350M head by default (hidden 1024, vocabulary 50,048, 8 x 512 tokens; target: fused <= 25% of plain);
wall time of each, informational.

    python tools/bench_loss_memory.py [--hidden 1024] [--vocab 50048] [--tokens 4096] [--chunk-tokens 1024]
        [--json OUT.json]

The logic lives in megatron_lite/bench/loss_memory.py.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_lite.bench.loss_memory import LossMemorySettings, format_report, run
from megatron_lite.cli import cli_main, run_cli


@cli_main
def main(argv: list[str] | None = None) -> int:
    defaults = LossMemorySettings()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=defaults.hidden, help="hidden size C")
    parser.add_argument("--vocab", type=int, default=defaults.vocab, help="vocabulary size V")
    parser.add_argument("--tokens", type=int, default=defaults.tokens, help="tokens N (batch x sequence)")
    parser.add_argument("--chunk-tokens", type=int, default=defaults.chunk_tokens, help="fused chunk size")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT.json")
    args = parser.parse_args(argv)
    settings = LossMemorySettings(hidden=args.hidden, vocab=args.vocab, tokens=args.tokens,
                                  chunk_tokens=args.chunk_tokens)
    result = run(settings)
    print(format_report(result), end="")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result.to_json(), indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    run_cli(main)
