"""Datasets over real (synthetic) shards: shares from token content, seeds, ranks, resume, no leakage,
cache reuse, explicit weights, the inspect and bench tools."""

from __future__ import annotations

import json
import pickle
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from megatron_lite import config as config_lib
from megatron_lite.data.indexed import IndexedDatasetWriter
from megatron_lite.data.loader import build_train_valid_datasets, data_report
from megatron_lite.data.manifest import (
    Manifest,
    ShardRecord,
    SourceRecord,
    TokenizerRecord,
    load_manifest,
    save_manifest,
)
from script_loading import load_script

EOD = 0
SEQ = 32
# Token of position t in document d of source s: s * 10^7 + d * 1000 + t + 1, so every token says
# where it came from; EOD closes each document. (group, documents, shards)
VOCAB = 4 * 10**7  # the manifest's tokenizer vocabulary: every such id is inside it
SOURCES = {"prose": ("text", 150, 2), "books": ("text", 60, 1), "code": ("code", 120, 1)}
SOURCE_ID = {name: i + 1 for i, name in enumerate(SOURCES)}


def decode(token: int) -> tuple[int, int]:
    """(source id, document) of a non-EOD token."""
    return token // 10**7, (token % 10**7) // 1000


def write_cache(cache_dir: Path, weights: dict[str, float] | None = None,
                document_tokens: tuple[int, int] = (5, 300)) -> tuple[Path, Manifest]:
    """Shards of SOURCES whose documents have ``document_tokens`` (low, high) tokens, and their mix file."""
    rng = np.random.default_rng(0)
    manifest = Manifest(TokenizerRecord(path="tokenizer/tokenizer.model", sha256="", vocab_size=VOCAB, eod_id=EOD, pad_id=1))
    groups: dict = {"text": {"weight": 0.75, "sources": {}}, "code": {"weight": 0.25, "sources": {}}}
    for name, (group, num_documents, num_shards) in SOURCES.items():
        lengths = rng.integers(*document_tokens, size=num_documents)
        shards = []
        for k, documents in enumerate(np.array_split(np.arange(num_documents), num_shards)):
            prefix = f"shards/{name}/{name}_{k:05d}_text_document"
            (cache_dir / prefix).parent.mkdir(parents=True, exist_ok=True)
            with IndexedDatasetWriter(cache_dir / prefix, np.int32) as writer:
                for d in documents:
                    tokens = SOURCE_ID[name] * 10**7 + d * 1000 + np.arange(lengths[d]) + 1
                    tokens[-1] = EOD
                    writer.add_document(tokens)
            shards.append(ShardRecord(prefix, len(documents), int(lengths[documents].sum()), f"sha-{name}-{k}", "x"))
        manifest.sources[name] = SourceRecord(group, "h", shards, num_documents, int(lengths.sum()), complete=True)
        source = {"type": "jsonl", "path": f"{name}.jsonl"}
        if weights:
            source["weight"] = weights[name]
        groups[group]["sources"][name] = source
    save_manifest(manifest, cache_dir)
    mix = cache_dir / "mix.yml"
    mix.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return mix, manifest


def make_config(cache_dir: Path, mix: Path, seed: int = 5, validation_fraction: float = 0.1):
    return config_lib.from_dict({
        "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": SEQ, "vocab_size": 8000},
        "data": {"mix": str(mix), "cache_dir": str(cache_dir), "seed": seed, "validation_fraction": validation_fraction},
    })


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> tuple:
    cache_dir = tmp_path_factory.mktemp("cache")
    mix, manifest = write_cache(cache_dir)
    return cache_dir, mix, manifest


def stream(dataset, count: int | None = None) -> list[np.ndarray]:
    count = len(dataset) if count is None else count
    return [torch.cat([dataset[i]["input_ids"], dataset[i]["labels"][-1:]]).numpy() for i in range(count)]


def test_items_and_text_share_from_token_content(cache):
    cache_dir, mix, manifest = cache
    train, valid = build_train_valid_datasets(make_config(cache_dir, mix).data, SEQ, manifest, 10_000, 500)
    item = train[0]
    assert item["input_ids"].shape == (SEQ,) and item["input_ids"].dtype == torch.int64
    torch.testing.assert_close(item["labels"][:-1], item["input_ids"][1:])
    assert train.group_names == ["text", "code"] and train.source_names == list(SOURCES)
    is_text = np.zeros(10_000, dtype=bool)
    for k in range(10_000):
        sample = train[k]
        tokens = torch.cat([sample["input_ids"], sample["labels"][-1:]]).numpy()
        sources = {decode(t)[0] for t in tokens if t != EOD}
        assert sources == {SOURCE_ID[train.source_names[sample["source"]]]}  # one source, as labelled
        is_text[k] = sample["group"] == 0
    for n in (1000, 10_000):
        assert abs(is_text[:n].mean() - 0.75) <= 0.005, n
    windows = np.convolve(is_text, np.ones(1000), mode="valid") / 1000
    assert np.abs(windows - 0.75).max() <= 0.005
    batch = next(iter(torch.utils.data.DataLoader(train, batch_size=4)))
    assert batch["input_ids"].shape == (4, SEQ) and batch["group"].dtype == torch.int64
    assert len(valid) == 500


def test_same_seed_same_order_other_seed_different(cache, tmp_path):
    cache_dir, mix, manifest = cache
    first = stream(build_train_valid_datasets(make_config(cache_dir, mix).data, SEQ, manifest, 300, 0)[0])
    other_dir = tmp_path / "copy"  # a fresh cache dir: the order is rebuilt from scratch
    other_mix, other_manifest = write_cache(other_dir)
    again = stream(build_train_valid_datasets(make_config(other_dir, other_mix).data, SEQ, other_manifest, 300, 0)[0])
    reseeded = build_train_valid_datasets(make_config(cache_dir, mix, seed=6).data, SEQ, manifest, 300, 0)[0]
    np.testing.assert_array_equal(np.stack(first), np.stack(again))
    assert not np.array_equal(np.stack(first), np.stack(stream(reseeded)))
    base = build_train_valid_datasets(make_config(cache_dir, mix).data, SEQ, manifest, 300, 0)[0]
    assert (np.asarray(base.dataset.blend_source) != np.asarray(reseeded.dataset.blend_source)).any()


def test_ranks_are_disjoint_and_their_union_is_the_single_rank_stream(cache):
    cache_dir, mix, manifest = cache
    config = make_config(cache_dir, mix)
    single = stream(build_train_valid_datasets(config.data, SEQ, manifest, 401, 0)[0])
    world = 3
    ranks = [build_train_valid_datasets(config.data, SEQ, manifest, 401, 0, rank=r, world_size=world)[0] for r in range(world)]
    indices = [list(r.global_indices) for r in ranks]
    assert sorted(sum(indices, [])) == list(range(401))
    for r, rank in enumerate(ranks):
        assert all(k % world == r for k in indices[r])
        assert rank[len(rank) - 1]["index"] == indices[r][-1]
    merged = [None] * 401
    for rank in ranks:
        for i in range(len(rank)):
            item = rank[i]
            merged[item["index"]] = torch.cat([item["input_ids"], item["labels"][-1:]]).numpy()
    np.testing.assert_array_equal(np.stack(merged), np.stack(single))


def test_more_samples_extend_the_order_without_changing_its_beginning(cache):
    cache_dir, mix, manifest = cache
    config = make_config(cache_dir, mix)
    short = build_train_valid_datasets(config.data, SEQ, manifest, 250, 0)[0]
    long = build_train_valid_datasets(config.data, SEQ, manifest, 2500, 0)[0]
    assert short.dataset.index.directory != long.dataset.index.directory
    np.testing.assert_array_equal(np.stack(stream(short)), np.stack(stream(long, 250)))


@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_equals_uninterrupted_stream(cache, world_size):
    cache_dir, mix, manifest = cache
    config = make_config(cache_dir, mix)
    for consumed in (0, 57, 200):
        for rank in range(world_size):
            full = build_train_valid_datasets(config.data, SEQ, manifest, 300, 0, rank, world_size)[0]
            resumed = build_train_valid_datasets(config.data, SEQ, manifest, 300, 0, rank, world_size, consumed_samples=consumed)[0]
            expected = [k for k in full.global_indices if k >= consumed]
            assert list(resumed.global_indices) == expected
            for i in range(min(5, len(resumed))):
                torch.testing.assert_close(resumed[i]["input_ids"], full.dataset[expected[i]]["input_ids"])


def test_a_global_batch_of_long_documents_draws_from_across_the_corpus(tmp_path):
    """Documents of ~30 samples each: consecutive windows would put 1-3 documents per source in a batch; the
    shuffled order spans at least half as many documents as the batch has samples, and the index's own count
    (documents_per_batch, which tools/inspect_data.py prints) agrees with the tokens' content."""
    mix, manifest = write_cache(tmp_path, document_tokens=(900, 1000))
    train = build_train_valid_datasets(make_config(tmp_path, mix).data, SEQ, manifest, 4 * 64, 0)[0]
    counts = []
    for batch in np.array_split(np.stack(stream(train)), 4):  # 4 global batches of 64 samples
        counts.append(len({decode(int(token)) for token in batch.ravel() if token != EOD}))
    assert min(counts) >= 64 // 2, counts
    from megatron_lite.data.batch_documents import documents_per_batch
    from megatron_lite.data.loader import document_lengths

    lengths = [document_lengths(source) for source in train.dataset.sources]
    np.testing.assert_array_equal(documents_per_batch(train.dataset.index.arrays, lengths, SEQ, 64).sum(axis=1), counts)


def test_validation_documents_never_in_training_samples(cache):
    cache_dir, mix, manifest = cache
    train, valid = build_train_valid_datasets(make_config(cache_dir, mix).data, SEQ, manifest, 3000, 400)
    seen_train: set[tuple[int, int]] = set()
    seen_valid: set[tuple[int, int]] = set()
    for dataset, seen in ((train, seen_train), (valid, seen_valid)):
        for tokens in stream(dataset):
            seen.update(decode(t) for t in tokens if t != EOD)
    for name, (_, num_documents, _) in SOURCES.items():
        held_out = set(valid.dataset.documents(name).tolist())
        assert len(held_out) == round(0.1 * num_documents)
        assert held_out.isdisjoint(train.dataset.documents(name).tolist())
        held_out_keys = {(SOURCE_ID[name], d) for d in held_out}
        assert held_out_keys.isdisjoint(seen_train)
        assert {key for key in seen_valid if key[0] == SOURCE_ID[name]} <= held_out_keys
        # 3000 samples run several epochs: every training document shows up.
        assert {key for key in seen_train if key[0] == SOURCE_ID[name]} == {
            (SOURCE_ID[name], d) for d in range(num_documents) if d not in held_out}


def test_validation_set_is_the_same_samples_on_any_world_size(cache):
    """Ranks split one fixed validation set: equal-length shares (padding scores nothing), and the real
    items over all ranks are the world-1 samples, read identically."""
    cache_dir, mix, manifest = cache
    config = make_config(cache_dir, mix)
    single = build_train_valid_datasets(config.data, SEQ, manifest, 100, 10)[1]
    assert [single[i]["index"] for i in range(len(single))] == list(range(10))
    for world_size in (2, 3, 4, 16):
        shares = [build_train_valid_datasets(config.data, SEQ, manifest, 100, 10, rank, world_size)[1]
                  for rank in range(world_size)]
        assert {len(share) for share in shares} == {-(-10 // world_size)}
        scored = {}
        for share in shares:
            for i in range(len(share)):
                item = share[i]
                if item["index"] < 0:
                    assert (item["labels"] == -100).all()
                else:
                    scored[item["index"]] = item
        assert sorted(scored) == list(range(10))
        for k, item in scored.items():
            torch.testing.assert_close(item["input_ids"], single[k]["input_ids"])
            torch.testing.assert_close(item["labels"], single[k]["labels"])


def test_cache_reused_across_calls(cache):
    cache_dir, mix, manifest = cache
    config = make_config(cache_dir, mix, seed=11)
    first, _ = build_train_valid_datasets(config.data, SEQ, manifest, 1234, 0)
    mtimes = {p.name: p.stat().st_mtime_ns for p in first.dataset.index.directory.iterdir()}
    second, _ = build_train_valid_datasets(config.data, SEQ, manifest, 1234, 0, rank=1, world_size=2, consumed_samples=10)
    assert first.dataset.index.built and not second.dataset.index.built
    assert second.dataset.index.directory == first.dataset.index.directory
    assert {p.name: p.stat().st_mtime_ns for p in second.dataset.index.directory.iterdir()} == mtimes
    assert first.dataset.index.directory.parent == cache_dir / "index"


def test_explicit_within_group_weights_honoured(tmp_path):
    mix, manifest = write_cache(tmp_path, weights={"prose": 1.0, "books": 4.0, "code": 1.0})
    train, _ = build_train_valid_datasets(make_config(tmp_path, mix).data, SEQ, manifest, 4000, 0)
    names = [train.source_names[s] for s in np.asarray(train.dataset.blend_source)]
    assert names.count("code") == 1000 and names.count("books") == 2400 and names.count("prose") == 600


def test_pickled_dataset_reads_the_same_samples(cache):
    cache_dir, mix, manifest = cache
    train, _ = build_train_valid_datasets(make_config(cache_dir, mix).data, SEQ, manifest, 100, 0)
    clone = pickle.loads(pickle.dumps(train))
    for i in (0, 50, 99):
        torch.testing.assert_close(clone[i]["input_ids"], train[i]["input_ids"])


def test_user_errors_name_the_problem(cache, tmp_path):
    cache_dir, mix, manifest = cache
    config = make_config(cache_dir, mix)
    with pytest.raises(ValueError, match="num_train_samples=0"):
        build_train_valid_datasets(config.data, SEQ, manifest, 0, 0)
    with pytest.raises(ValueError, match="consumed_samples=11"):
        build_train_valid_datasets(config.data, SEQ, manifest, 10, 0, consumed_samples=11)
    with pytest.raises(ValueError, match="rank=2"):
        build_train_valid_datasets(config.data, SEQ, manifest, 10, 0, rank=2, world_size=2)
    partial = Manifest(manifest.tokenizer, {k: v for k, v in manifest.sources.items() if k != "books"})
    with pytest.raises(ValueError, match="'books'.*preprocess_data"):
        build_train_valid_datasets(config.data, SEQ, partial, 10, 0)
    with pytest.warns(UserWarning, match="validation_fraction"):
        assert build_train_valid_datasets(make_config(cache_dir, mix, validation_fraction=0.0).data, SEQ, manifest, 10, 5)[1] is None


def _write_run_config(tmp_path: Path, cache_dir: Path, mix: Path) -> Path:
    path = tmp_path / "run.yml"
    path.write_text(yaml.safe_dump({"model": {"seq_length": SEQ, "vocab_size": 8000},
                                    "data": {"mix": str(mix), "cache_dir": str(cache_dir)}}))
    return path


def test_inspect_data_json(cache, tmp_path, capsys):
    cache_dir, mix, manifest = cache
    assert load_script("tools/inspect_data.py").main(["--config", str(_write_run_config(tmp_path, cache_dir, mix)),
                                       "--num-samples", "1000", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["group_token_share"] == pytest.approx({"text": 0.75, "code": 0.25}, abs=0.005)
    assert sum(report["source_token_share"].values()) == pytest.approx(1.0)
    assert report["sources"]["books"]["documents"] == 60 and report["sources"]["books"]["validation_documents"] == 1
    assert report["sample"]["text"] is None and len(report["sample"]["input_ids"]) == SEQ  # no tokenizer file
    # The tool is a thin CLI: the same figures as the library call (config defaults: seed 1234, 1% held out).
    direct = data_report(make_config(cache_dir, mix, seed=1234, validation_fraction=0.01).data, SEQ, manifest, 1000)
    assert direct["source_token_share"] == report["source_token_share"]
    # the default global batch (train_batch_size null: one micro batch of 16 on one rank) over 1000 samples
    batches = report["documents_per_batch"]
    assert (batches["global_batch"], batches["batches"]) == (16, 62) and 8 <= batches["min"] <= batches["mean"]
    run = report["run"]  # the config's 2 epochs: every source's tokens held, drawn and passes
    assert run["tokens_drawn"] == run["steps"] * 16 * SEQ and run["warning"] is None
    assert sum(row["tokens_drawn"] for row in run["sources"].values()) == pytest.approx(run["tokens_drawn"])
    for row in run["sources"].values():
        assert row["passes"] == pytest.approx(row["tokens_drawn"] / row["tokens_held"])


def test_inspect_data_without_manifest(tmp_path, capsys, monkeypatch):
    empty = tmp_path / "empty"
    config_path = _write_run_config(tmp_path, empty, empty / "mix.yml")

    def prepare_data(data, vocab_size):  # stands in for megatron_lite.data.preprocess.prepare_data
        write_cache(Path(data.cache_dir))

    fake = types.ModuleType("megatron_lite.data.preprocess")
    fake.prepare_data = prepare_data
    monkeypatch.setitem(sys.modules, "megatron_lite.data.preprocess", fake)
    assert load_script("tools/inspect_data.py").main(["--config", str(config_path), "--num-samples", "100"]) == 0
    assert "| text |" in capsys.readouterr().out
    assert load_manifest(empty).sources.keys() == SOURCES.keys()


def test_bench_loader_on_synthetic_shards(tmp_path):
    from megatron_lite.bench.data_bench import format_report, run_benchmark

    config = make_config(tmp_path, tmp_path / "unused.yml")
    result = run_benchmark(config, synthetic_tokens=200_000, index_samples=20_000, loader_seconds=0.3,
                           preprocess=False, progress=lambda line: None)
    loader = result["loader"]
    assert loader["loader_samples"] > 0 and loader["ratio"] == loader["loader_samples_per_s"] / 60.0
    assert "loader / training consumption" in format_report(result)
