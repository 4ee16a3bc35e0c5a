#!/usr/bin/env python
"""Show what training will read: token shares of the first N samples, sources, distinct documents per global
batch, what the run draws from each source (tokens held, drawn, passes), one decoded sample.

    python tools/inspect_data.py --config configs/tiny/coca_slack.yml --num-samples 10000 [--json]

Reads the prepared data.cache_dir. Without a manifest it runs preprocessing first
(megatron_lite.data.preprocess.prepare_data).
The first N samples' order is built (and cached under <cache_dir>/index/) like the training one.
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_lite import config as config_lib
from megatron_lite.cli import cli_main, run_cli
from megatron_lite.config import Config
from megatron_lite.data.loader import data_report, decode_tokens
from megatron_lite.data.eval_overlap import evaluation_line
from megatron_lite.data.manifest import Manifest, load_manifest, manifest_path
from megatron_lite.data.mix import load_mix, repeat_warning
from megatron_lite.data.preprocess import prepare_data
from megatron_lite.training.data import run_passes, total_steps_for
from megatron_lite.training.deepspeed_config import BatchSizes, resolve_batch_sizes


def ensure_manifest(config: Config) -> Manifest:
    """The manifest of data.cache_dir, preparing the data first when there is none."""
    if not manifest_path(config.data.cache_dir).is_file():
        print(f"no manifest in {config.data.cache_dir}: preparing the data first", file=sys.stderr)
        prepare_data(config.data, config.model.vocab_size)
    return load_manifest(config.data.cache_dir)


def format_text(report: dict) -> str:
    lines = [f"first {report['num_samples']:,} training samples of {report['seq_length']} tokens "
             f"(index {report['index']})", "", "| group | token share | target |", "|---|---|---|"]
    for group, share in report["group_token_share"].items():
        lines.append(f"| {group} | {share:.4f} | {report['group_weights'].get(group, 0.0):.4f} |")
    lines += ["", "| source | group | documents | tokens | train docs | valid docs | weight in group | epochs | token share |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, s in report["sources"].items():
        lines.append(f"| {name} | {s['group']} | {s['documents']:,} | {s['tokens']:,} | {s['train_documents']:,} | "
                     f"{s['validation_documents']:,} | {s['weight_in_group']:.4f} | {s['epochs']} | "
                     f"{report['source_token_share'][name]:.4f} |")
    batches = report["documents_per_batch"]
    lines += ["", f"distinct documents per global batch of {batches['global_batch']:,} samples "
              f"({batches['batches']:,} batches): min {batches['min']:,}, mean {batches['mean']:,.1f}"]
    run = report["run"]
    lines += ["", f"the run: {run['steps']:,} steps ({run['steps_source']}) draw {run['tokens_drawn']:,} tokens",
              "| source | tokens held | tokens drawn | passes |", "|---|---|---|---|"]
    for name, row in run["sources"].items():
        lines.append(f"| {name} | {row['tokens_held']:,.0f} | {row['tokens_drawn']:,.0f} | {row['passes']:.2f} |")
    if run["warning"]:
        lines.append(f"warning: {run['warning']}")
    sample = report["sample"]
    lines += ["", report["evaluation"]] if "evaluation" in report else []
    lines += ["", f"sample 0 ({sample['source']}, {sample['group']}):"]
    lines.append(sample["text"] if sample.get("text") is not None else f"token ids: {sample['input_ids']}")
    return "\n".join(lines) + "\n"


def run_report(config: Config, manifest: Manifest, batch: BatchSizes) -> dict:
    """What the configured run draws from each source (train.py prints the same at its start)."""
    steps, steps_source = total_steps_for(config, manifest, batch, None)
    rows = run_passes(config, manifest, load_mix(config.data.mix), steps, batch)
    return {"steps": steps, "steps_source": steps_source, "tokens_drawn": steps * batch.tokens_per_step(
                config.model.seq_length), "warning": repeat_warning(rows),
            "sources": {row.name: {"group": row.group, "tokens_held": row.tokens_held,
                                   "tokens_drawn": row.tokens_drawn, "passes": row.passes} for row in rows}}


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="run config (YAML)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--num-samples", type=int, default=10_000, help="training samples to measure (default 10000)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if args.num_samples <= 0:
        raise ValueError(f"--num-samples={args.num_samples}: must be positive")
    config = config_lib.load(args.config, args.set)
    manifest = ensure_manifest(config)
    batch = resolve_batch_sizes(config, 1)  # the global batch is the same on every world size
    report = data_report(config.data, config.model.seq_length, manifest, args.num_samples,
                         global_batch=batch.global_batch_size)
    report["run"] = run_report(config, manifest, batch)
    report["sample"]["text"] = decode_tokens(report["sample"]["input_ids"], config.data.cache_dir, manifest)
    report["evaluation"] = evaluation_line(manifest)  # the evaluation texts checked, the training documents dropped
    print(json.dumps(report, indent=2) if args.json else format_text(report), end="\n" if args.json else "")
    return 0


if __name__ == "__main__":
    run_cli(main)
