"""``python -m megatron_lite.config``: print the key reference, or load, validate and print a config."""

from __future__ import annotations

import argparse

import yaml

from megatron_lite.cli import cli_main, run_cli
from megatron_lite.config.loading import documentation_page, load, to_dict


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_lite.config", description="Inspect megatron_lite configs.")
    parser.add_argument("--doc", action="store_true", help="print the Markdown reference of every key")
    parser.add_argument("--config", help="load, validate and print this YAML file (with --set overrides)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    if args.doc:
        print(documentation_page(), end="")
    if args.config:
        print(yaml.safe_dump(to_dict(load(args.config, args.set)), sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    run_cli(main)
