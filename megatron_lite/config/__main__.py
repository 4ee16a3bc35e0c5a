"""``python -m megatron_lite.config``: print the key reference, or load, validate and print a config
(after a comment naming its ``base:`` chain)."""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from megatron_lite.cli import cli_main, run_cli
from megatron_lite.config.loading import documentation_page, load, read_chain, to_dict


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_lite.config", description="Inspect megatron_lite configs.")
    parser.add_argument("--doc", action="store_true", help="print the Markdown reference of every key")
    parser.add_argument("--config", help="load, validate and print this YAML file resolved (bases merged, --set "
                        "overrides applied) after a comment naming its base chain")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    if args.doc:
        print(documentation_page(), end="")
    if args.config:
        resolved = to_dict(load(args.config, args.set))
        files = [str(path) for path, _ in read_chain(Path(args.config), f"config file {args.config} does not exist")]
        print(f"# base chain: {' -> '.join(files)} (each file's keys over the next's)" if len(files) > 1
              else f"# base chain: {files[0]} (no base)")
        print(yaml.safe_dump(resolved, sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    run_cli(main)
