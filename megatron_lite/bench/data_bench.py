"""Data pipeline benchmark (tools/bench_data.py): preprocessing tokens/s with 1 and 2 workers, index
build time, and loader samples/s against what training consumes.

Preprocessing is timed through ``megatron_lite.data.preprocess.prepare_data``: one untimed
run trains the tokenizer, then the same corpus is tokenised with 1 and 2 workers into fresh cache
dirs. The loader is timed on a prepared cache, or on synthetic shards written here.
"""

from __future__ import annotations

import copy
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from megatron_lite.config import Config
from megatron_lite.data.indexed import IndexedDatasetWriter, dtype_for_vocab
from megatron_lite.data.loader import RankSlice, build_blended_dataset
from megatron_lite.data.manifest import Manifest, ShardRecord, SourceRecord, TokenizerRecord, load_manifest, save_manifest
from megatron_lite.data.mix import load_mix
from megatron_lite.data.preprocess import prepare_data
from megatron_lite.data.records import Document
from megatron_lite.data.sources import read_source
from megatron_lite.files import file_sha256

# name: (group, share of the synthetic tokens): a 75/25 text/code mix of three sources.
SYNTHETIC_SOURCES = {"synthetic_prose": ("text", 0.45), "synthetic_books": ("text", 0.30), "synthetic_code": ("code", 0.25)}
DEFAULT_CONSUMED_SAMPLES_PER_S = 60.0  # tiny config: ~8 samples/step x ~7 steps/s on 2 CPU cores
LOADER_TARGET_RATIO = 100.0
PREPROCESS_TARGET_SPEEDUP = 1.7


def write_synthetic_cache(cache_dir: str | Path, num_tokens: int, vocab_size: int = 8000, seed: int = 0,
                          mean_document_tokens: int = 600) -> Path:
    """Random-token shards + manifest for SYNTHETIC_SOURCES in cache_dir; returns the mix file path.

    Document lengths are log-normal around ``mean_document_tokens``; each document ends with EOD
    (id 0), as preprocessing writes them.
    """
    cache_dir = Path(cache_dir)
    rng = np.random.default_rng(seed)
    dtype = dtype_for_vocab(vocab_size)
    manifest = Manifest(TokenizerRecord(path="tokenizer/tokenizer.model", sha256="", vocab_size=vocab_size, eod_id=0, pad_id=1))
    groups: dict[str, dict[str, Any]] = {}
    for name, (group, share) in SYNTHETIC_SOURCES.items():
        target = max(int(num_tokens * share), 2)
        lengths = np.maximum(2, rng.lognormal(np.log(mean_document_tokens), 0.8, size=target // 100 + 2).astype(np.int64))
        lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), target)) + 1]  # (documents,) ~ target tokens
        tokens = rng.integers(2, vocab_size, size=int(lengths.sum()), dtype=np.int64)  # (tokens,)
        ends = np.cumsum(lengths)
        tokens[ends - 1] = 0  # EOD closes every document
        prefix = f"shards/{name}/{name}_00000_text_document"
        (cache_dir / prefix).parent.mkdir(parents=True, exist_ok=True)
        with IndexedDatasetWriter(cache_dir / prefix, dtype) as writer:
            for document in np.split(tokens, ends[:-1]):
                writer.add_document(document)
        shard = ShardRecord(prefix, len(lengths), int(lengths.sum()), file_sha256(str(cache_dir / prefix) + ".bin"),
                            file_sha256(str(cache_dir / prefix) + ".idx"))
        manifest.sources[name] = SourceRecord(group=group, config_hash="synthetic", shards=[shard],
                                              documents=shard.documents, tokens=shard.tokens, complete=True)
        groups.setdefault(group, {"weight": 0.75 if group == "text" else 0.25, "sources": {}})
        groups[group]["sources"][name] = {"type": "jsonl", "path": "synthetic"}
    save_manifest(manifest, cache_dir)
    mix_path = cache_dir / "synthetic_mix.yml"
    mix_path.write_text(yaml.safe_dump({"description": "synthetic benchmark shards", "groups": groups}, sort_keys=False))
    return mix_path


def with_data(config: Config, **data: Any) -> Config:
    """A copy of config with data.* fields replaced."""
    config = copy.deepcopy(config)
    for key, value in data.items():
        setattr(config.data, key, value)
    return config


def bench_loader(config: Config, manifest: Manifest, num_samples: int, seconds: float = 5.0, batch_size: int = 8,
                 max_samples: int = 200_000) -> dict[str, Any]:
    """Index build time for ``num_samples`` (rank 0, uncached) and DataLoader samples/s (1 process)."""
    start = time.perf_counter()
    dataset = build_blended_dataset(config.data, config.model.seq_length, manifest, "train", num_samples)
    build_seconds = time.perf_counter() - start
    loader = torch.utils.data.DataLoader(RankSlice(dataset), batch_size=batch_size, shuffle=False)
    count, start = 0, time.perf_counter()
    for batch in loader:
        count += batch["input_ids"].shape[0]
        if count >= max_samples or time.perf_counter() - start > seconds:
            break
    elapsed = time.perf_counter() - start
    return {"index_samples": num_samples, "index_build_s": build_seconds, "index_reused": not dataset.index.built,
            "loader_samples": count, "loader_samples_per_s": count / elapsed, "batch_size": batch_size,
            "seq_length": dataset.seq_length}


def export_mix_to_jsonl(config: Config, out_dir: Path, repeat: int = 1) -> Path:
    """The mix's documents as one jsonl file per source (``repeat`` copies each, dedup off), and a mix
    file with the same groups reading them: the hub/jsonl case, where reading is cheap next to
    tokenisation (the built-in python_docs source parses the stdlib with ``ast``, serially)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    groups: dict[str, Any] = {}
    for group_name, group in load_mix(config.data.mix).groups.items():
        sources: dict[str, Any] = {}
        for name, source in group.sources.items():
            texts = [record.text for record in read_source(source, name) if isinstance(record, Document)]
            path = out_dir / f"{name}.jsonl"
            with path.open("w") as handle:
                for _ in range(repeat):
                    handle.writelines(json.dumps({"text": text}) + "\n" for text in texts)
            sources[name] = {"type": "jsonl", "path": str(path), "deduplicate": False}
        groups[group_name] = {"weight": group.weight, "sources": sources}
    mix_path = out_dir / "mix.yml"
    mix_path.write_text(yaml.safe_dump({"description": "bench_data jsonl export", "groups": groups}, sort_keys=False))
    return mix_path


def bench_preprocess(config: Config, workdir: str | Path, workers: tuple[int, ...] = (1, 2), repeat: int = 2,
                     progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Tokens/s of prepare_data per worker count on the config's mix exported to jsonl."""
    workdir = Path(workdir)
    warm = with_data(config, cache_dir=str(workdir / "warmup"))
    progress("preprocess: warm-up run (trains the tokenizer, warms the file cache)")
    prepare_data(warm.data, warm.model.vocab_size, progress=False)
    tokenizer = workdir / "warmup" / load_manifest(warm.data.cache_dir).tokenizer.path
    progress(f"preprocess: exporting the mix to jsonl ({repeat} copies)")
    jsonl_mix = export_mix_to_jsonl(config, workdir / "jsonl", repeat)
    result: dict[str, Any] = {"runs": {}, "input": f"{config.data.mix} as jsonl, {repeat} copies"}
    for count in workers:
        run = with_data(config, cache_dir=str(workdir / f"workers_{count}"), num_workers=count, mix=str(jsonl_mix))
        run.data.tokenizer.model = str(tokenizer)
        progress(f"preprocess: {count} worker(s)")
        start = time.perf_counter()
        prepare_data(run.data, run.model.vocab_size, progress=False)
        seconds = time.perf_counter() - start
        tokens = sum(source.tokens for source in load_manifest(run.data.cache_dir).sources.values())
        result["runs"][str(count)] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
    if len(workers) >= 2:
        runs = result["runs"]
        result["speedup"] = runs[str(workers[-1])]["tokens_per_s"] / runs[str(workers[0])]["tokens_per_s"]
    return result


def run_benchmark(config: Config, *, cache_dir: str | None = None, synthetic_tokens: int = 20_000_000,
                  index_samples: int = 10_000_000, loader_seconds: float = 5.0, batch_size: int = 8,
                  consumed_samples_per_s: float = DEFAULT_CONSUMED_SAMPLES_PER_S, preprocess: bool = True,
                  progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Both measurements; a prepared ``cache_dir`` (with config's mix) or synthetic shards."""
    with tempfile.TemporaryDirectory(prefix="bench_data_") as workdir:
        result: dict[str, Any] = {"seq_length": config.model.seq_length}
        if preprocess:
            result["preprocess"] = bench_preprocess(config, Path(workdir) / "preprocess", progress=progress)
        if cache_dir is None:
            progress(f"loader: writing {synthetic_tokens:,} synthetic tokens")
            synthetic = Path(workdir) / "synthetic"
            mix = write_synthetic_cache(synthetic, synthetic_tokens, vocab_size=config.model.vocab_size)
            config = with_data(config, cache_dir=str(synthetic), mix=str(mix))
        else:
            config = with_data(config, cache_dir=cache_dir)
        progress(f"loader: building the index for {index_samples:,} samples, then reading for {loader_seconds:g} s")
        loader = bench_loader(config, load_manifest(config.data.cache_dir), index_samples, loader_seconds, batch_size)
        loader["data"] = "synthetic" if cache_dir is None else cache_dir
        loader["consumed_samples_per_s"] = consumed_samples_per_s
        loader["ratio"] = loader["loader_samples_per_s"] / consumed_samples_per_s
        result["loader"] = loader
    return result


def format_report(result: dict[str, Any]) -> str:
    """Markdown table of the figures and their targets."""
    rows = ["| measure | value | target | status |", "|---|---|---|---|"]
    pre = result.get("preprocess")
    if pre is not None:
        for count, run in pre["runs"].items():
            rows.append(f"| preprocess tokens/s, {count} worker(s) | {run['tokens_per_s']:,.0f} "
                        f"({run['tokens']:,} tokens, {run['seconds']:.1f} s) | | |")
        if "speedup" in pre:
            ok = "ok" if pre["speedup"] >= PREPROCESS_TARGET_SPEEDUP else "below target"
            rows.append(f"| preprocess speed-up, 2 vs 1 workers | {pre['speedup']:.2f}x | >= {PREPROCESS_TARGET_SPEEDUP}x | {ok} |")
    loader = result["loader"]
    rows.append(f"| index build, {loader['index_samples']:,} samples | {loader['index_build_s']:.2f} s"
                f"{' (cached)' if loader['index_reused'] else ''} | seconds | |")
    ok = "ok" if loader["ratio"] >= LOADER_TARGET_RATIO else "below target"
    rows.append(f"| loader samples/s (seq {loader['seq_length']}, batch {loader['batch_size']}, 1 process) | "
                f"{loader['loader_samples_per_s']:,.0f} | >= {LOADER_TARGET_RATIO:g} x consumed | |")
    rows.append(f"| loader / training consumption ({loader['consumed_samples_per_s']:g} samples/s) | "
                f"{loader['ratio']:,.0f}x | >= {LOADER_TARGET_RATIO:g}x | {ok} |")
    return "\n".join(rows) + "\n"
