"""Distinct documents per global batch of a config's training order, for docs/data_loading.md's before/after table.

    python -m dev.batch_mix --config CONFIG [--set KEY=VALUE ...] [--global-batch 256] [--batches 40]

Runs on any checkout with the blend index's array layout (doc_order_i, sample_idx_i, blend_source, blend_sample):
to measure an older checkout's order, run ``PYTHONPATH=. python THIS_CHECKOUT/dev/batch_mix.py ...`` from its root;
the counting module (megatron_lite/data/batch_documents.py) is then loaded from this file's checkout.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import numpy as np

from megatron_lite import config as config_lib
from megatron_lite.data.loader import build_blended_dataset, document_lengths
from megatron_lite.data.manifest import load_manifest


def _counter():  # type: ignore[no-untyped-def]
    try:
        from megatron_lite.data.batch_documents import documents_per_batch
    except ImportError:  # an older checkout: this checkout's module (numpy only)
        path = Path(__file__).resolve().parents[1] / "megatron_lite" / "data" / "batch_documents.py"
        spec = importlib.util.spec_from_file_location("batch_documents", path)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        documents_per_batch = module.documents_per_batch
    return documents_per_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--batches", type=int, default=40)
    args = parser.parse_args()
    config = config_lib.load(args.config, args.set)
    manifest = load_manifest(config.data.cache_dir)
    dataset = build_blended_dataset(config.data, config.model.seq_length, manifest, "train",
                                    args.global_batch * args.batches)
    lengths = [document_lengths(source) for source in dataset.sources]
    per_source = _counter()(dataset.index.arrays, lengths, dataset.seq_length, args.global_batch)  # (batches, sources)
    counts = per_source.sum(axis=1)
    sources = {name: {"documents": len(length), "mean_per_batch": round(float(per_source[:, i].mean()), 1),
                      "median_document_tokens": int(np.median(length))}
               for i, (name, length) in enumerate(zip(dataset.source_names, lengths))}
    print(json.dumps({"config": args.config, "seq_length": dataset.seq_length, "global_batch": args.global_batch,
                      "batches": len(counts), "min": int(counts.min()), "mean": round(float(counts.mean()), 1),
                      "max": int(counts.max()), "sources": sources, "index": str(dataset.index.directory)}))


if __name__ == "__main__":
    main()
