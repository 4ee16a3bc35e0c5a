"""Blend index algorithms (no shards): greedy interleave, exact windows, seeds, split, packing, cache."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from megatron_lite.data import blend
from megatron_lite.data.blend import (
    BlendSource,
    build_blend,
    greedy_interleave,
    interleave,
    load_or_build,
    sample_order,
    source_stream,
    split_documents,
)


def reference_greedy(weights: list[float], n: int) -> list[int]:
    """The rule as stated in the issue: at step i pick argmax w·(i+1) − count (i from 0), first on ties."""
    total = sum(weights)
    w = [x / total for x in weights]
    counts = [0] * len(w)
    out = []
    for i in range(n):
        errors = [w[d] * (i + 1) - counts[d] for d in range(len(w))]
        best = max(range(len(w)), key=lambda d: (errors[d], -d))
        counts[best] += 1
        out.append(best)
    return out


def max_window_error(is_member: np.ndarray, weight: float, window: int) -> float:
    """Largest |share − weight| over every window of ``window`` consecutive samples."""
    cumulative = np.concatenate([[0], np.cumsum(is_member)])
    counts = cumulative[window:] - cumulative[:-window]
    return float(np.abs(counts / window - weight).max())


@pytest.mark.parametrize("weights", [[0.75, 0.25], [0.5, 0.5], [0.9, 0.1], [0.5, 0.3, 0.2], [4, 2, 1, 1]])
def test_greedy_interleave_matches_the_stated_rule(weights):
    assert greedy_interleave(weights, 3000).tolist() == reference_greedy(weights, 3000)


def test_greedy_two_sources_closed_form_agrees_up_to_float_ties():
    rng = np.random.default_rng(3)
    for _ in range(20):
        w = rng.dirichlet([1.0, 1.0]).tolist()
        fast, slow = greedy_interleave(w, 4000), np.array(reference_greedy(w, 4000))
        # Any disagreement is a float tie; it can only swap neighbours, counts stay within one sample.
        assert np.abs(np.cumsum(fast == 0) - np.cumsum(slow == 0)).max() <= 1


@pytest.mark.parametrize("weights", [[0.75, 0.25], [0.5, 0.5], [0.6, 0.25, 0.15]])
def test_text_share_exact_in_prefixes_and_every_window(weights):
    order = interleave(weights, 20_000, blend.DEFAULT_SHUFFLE_BLOCK, np.random.default_rng(11))
    w = weights[0] / sum(weights)
    is_first = order == 0
    for n in (1000, 10_000):
        assert abs(is_first[:n].mean() - w) <= 0.005
    assert max_window_error(is_first, w, 1000) <= 0.005
    assert max_window_error(is_first, w, 5000) <= 0.005


def test_seed_changes_the_interleave_and_the_same_seed_repeats_it():
    a = interleave([0.75, 0.25], 5000, 4, np.random.default_rng(1))
    b = interleave([0.75, 0.25], 5000, 4, np.random.default_rng(1))
    c = interleave([0.75, 0.25], 5000, 4, np.random.default_rng(2))
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()
    # Without blocks the seed does not matter: plain greedy.
    np.testing.assert_array_equal(interleave([0.75, 0.25], 100, 1, np.random.default_rng(9)),
                                  reference_greedy([0.75, 0.25], 100))


def test_interleave_is_prefix_stable():
    long = interleave([0.5, 0.3, 0.2], 4003, 4, np.random.default_rng(5))
    short = interleave([0.5, 0.3, 0.2], 1001, 4, np.random.default_rng(5))
    np.testing.assert_array_equal(short, long[:1001])


def test_split_documents():
    train, valid = split_documents(1000, 0.05, 7, "wiki")
    assert len(valid) == 50 and len(train) == 950
    assert set(train).isdisjoint(valid) and set(train) | set(valid) == set(range(1000))
    np.testing.assert_array_equal(valid, split_documents(1000, 0.05, 7, "wiki")[1])
    assert not np.array_equal(valid, split_documents(1000, 0.05, 8, "wiki")[1])  # seeded
    assert not np.array_equal(valid, split_documents(1000, 0.05, 7, "books")[1])  # per source
    assert len(split_documents(2, 0.01, 0, "s")[1]) == 1  # at least one with >= 2 documents
    assert len(split_documents(1, 0.5, 0, "s")[1]) == 0  # never the only document
    assert len(split_documents(3, 0.99, 0, "s")[0]) == 1  # never all documents
    assert len(split_documents(50, 0.0, 0, "s")[1]) == 0
    with pytest.raises(ValueError, match="validation_fraction"):
        split_documents(10, 1.0, 0, "s")


def test_source_stream_packs_windows_with_one_token_overlap_over_reshuffled_epochs():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, size=30)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    documents = np.arange(5, 30)  # documents 0..4 held out
    seq = 16
    doc_order, sample_idx, epochs = source_stream(lengths, documents, 200, seq, 3, "src", "train")
    draws = sample_order(200, int(lengths[documents].sum()), seq, 3, "src", "train")  # stream sample of each draw
    assert epochs == -(-((draws.max() + 1) * seq + 1) // int(lengths[documents].sum())) and epochs >= 3
    per_epoch = doc_order.reshape(epochs, len(documents))
    for epoch in per_epoch:
        assert sorted(epoch) == documents.tolist()  # each epoch: every document exactly once
    assert len({tuple(e) for e in per_epoch}) == epochs  # reshuffled every epoch
    # Token t of document d is starts[d] + t: the stream is checkable position by position.
    stream = np.concatenate([np.arange(starts[d], starts[d + 1]) for d in doc_order])
    for j, (position, offset) in zip(draws, sample_idx):
        window = []
        p, o = int(position), int(offset)
        while len(window) < seq + 1:
            d = doc_order[p]
            window.extend(range(starts[d] + o, starts[d + 1]))
            p, o = p + 1, 0
        np.testing.assert_array_equal(window[: seq + 1], stream[j * seq : j * seq + seq + 1])
    # Prefix stable: fewer samples give the same beginning.
    _, fewer, _ = source_stream(lengths, documents, 50, seq, 3, "src", "train")
    np.testing.assert_array_equal(fewer, sample_idx[:50])


def test_sample_order_permutes_each_sample_epoch_whole():
    per_epoch = 1000 // 16  # tokens per epoch // seq_length
    order = sample_order(150, 1000, 16, 3, "src", "train")
    for epoch in range(2):  # each complete sample epoch: a permutation of its own stream samples
        block = order[epoch * per_epoch:(epoch + 1) * per_epoch]
        assert sorted(block) == list(range(epoch * per_epoch, (epoch + 1) * per_epoch))
        assert not np.array_equal(block, np.sort(block))
    assert set(order[2 * per_epoch:]) <= set(range(2 * per_epoch, 3 * per_epoch))
    np.testing.assert_array_equal(sample_order(40, 1000, 16, 3, "src", "train"), order[:40])  # prefix-stable
    assert not np.array_equal(sample_order(40, 1000, 16, 4, "src", "train"), order[:40])  # the seed moves it
    assert not np.array_equal(sample_order(40, 1000, 16, 3, "src", "valid"), order[:40])  # so does the split
    np.testing.assert_array_equal(sample_order(5, 10, 16, 3, "src", "train"), np.arange(5))  # < 1 sample per epoch


def _sources(seed: int = 0) -> list[BlendSource]:
    rng = np.random.default_rng(seed)
    return [
        BlendSource("a", "text", rng.integers(10, 200, size=300)),
        BlendSource("b", "text", rng.integers(10, 200, size=100)),
        BlendSource("c", "code", rng.integers(10, 200, size=200)),
    ]


def test_build_blend_natural_and_explicit_source_weights():
    sources = _sources()
    result = build_blend(sources, {"text": 0.75, "code": 0.25}, split="train", num_samples=20_000, seq_length=32,
                         seed=1, validation_fraction=0.1)
    meta = {s["name"]: s for s in result.meta["sources"]}
    natural_a = meta["a"]["tokens"] / (meta["a"]["tokens"] + meta["b"]["tokens"])
    assert meta["a"]["weight_in_group"] == pytest.approx(natural_a)
    assert meta["a"]["num_samples"] / 20_000 == pytest.approx(0.75 * natural_a, abs=2e-4)
    assert meta["c"]["num_samples"] == 5000
    sources[0].weight, sources[1].weight = 1.0, 3.0  # explicit: b gets 3/4 of the text samples
    result = build_blend(sources, {"text": 0.75, "code": 0.25}, split="train", num_samples=20_000, seq_length=32,
                         seed=1, validation_fraction=0.1)
    counts = np.bincount(result.arrays["blend_source"], minlength=3)
    assert counts.tolist() == [3750, 11250, 5000]
    text_positions = np.flatnonzero(result.arrays["blend_source"] < 2)
    assert max_window_error(result.arrays["blend_source"][text_positions] == 1, 0.75, 1000) <= 0.005


def test_build_blend_validation_split_leaves_out_sources_without_documents():
    sources = _sources() + [BlendSource("tiny", "code", np.array([50]))]  # one document: training only
    result = build_blend(sources, {"text": 0.75, "code": 0.25}, split="valid", num_samples=1000, seq_length=32,
                         seed=1, validation_fraction=0.1)
    meta = {s["name"]: s for s in result.meta["sources"]}
    assert meta["tiny"]["num_samples"] == 0 and meta["tiny"]["documents"] == 0
    assert meta["a"]["documents"] == 30 and meta["c"]["num_samples"] == 250
    with pytest.raises(ValueError, match="group"):
        build_blend(sources, {"text": 1.0}, split="train", num_samples=10, seq_length=8, seed=0, validation_fraction=0.0)
    with pytest.raises(ValueError, match="data.seed"):
        build_blend(sources, {"text": 1, "code": 1}, split="train", num_samples=10, seq_length=8, seed=-1,
                    validation_fraction=0.0)


def _build_counter(counter: list[int]):
    def build() -> blend.BlendArrays:
        counter.append(1)
        return build_blend(_sources(), {"text": 0.75, "code": 0.25}, split="train", num_samples=500, seq_length=16,
                           seed=0, validation_fraction=0.0)
    return build


def test_cache_is_built_once_and_reused(tmp_path: Path):
    counter: list[int] = []
    inputs = {"num_samples": 500, "seed": 0}
    first = load_or_build(tmp_path, inputs, _build_counter(counter), is_builder=True)
    assert first.built and counter == [1]
    files = sorted(first.directory.iterdir())
    mtimes = [f.stat().st_mtime_ns for f in files]
    second = load_or_build(tmp_path, inputs, _build_counter(counter), is_builder=True)
    assert not second.built and counter == [1]
    assert [f.stat().st_mtime_ns for f in sorted(second.directory.iterdir())] == mtimes
    assert isinstance(second.arrays["blend_source"], np.memmap)
    np.testing.assert_array_equal(first.arrays["blend_source"], second.arrays["blend_source"])
    other = load_or_build(tmp_path, {"num_samples": 500, "seed": 1}, _build_counter(counter), is_builder=True)
    assert other.directory != first.directory and counter == [1, 1]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp dirs left


def test_non_builder_waits_for_the_builder(tmp_path: Path):
    counter: list[int] = []
    inputs = {"case": "wait"}
    results = {}

    def follower() -> None:
        results["follower"] = load_or_build(tmp_path, inputs, _build_counter(counter), is_builder=False, poll_s=0.01)

    thread = threading.Thread(target=follower)
    thread.start()
    time.sleep(0.1)
    assert "follower" not in results  # still waiting: nothing built yet
    load_or_build(tmp_path, inputs, _build_counter(counter), is_builder=True)
    thread.join(timeout=10)
    assert counter == [1] and not results["follower"].built
    with pytest.raises(TimeoutError, match="rank 0 builds it"):
        load_or_build(tmp_path, {"case": "never"}, _build_counter(counter), is_builder=False, wait_timeout_s=0.05,
                      poll_s=0.01)


def test_write_is_atomic_when_writing_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    real_save, calls = np.save, []

    def failing_save(path, array):  # the disk fills up after the first file
        calls.append(path)
        if len(calls) > 1:
            raise OSError("No space left on device")
        real_save(path, array)

    monkeypatch.setattr(np, "save", failing_save)
    with pytest.raises(OSError, match="No space"):
        load_or_build(tmp_path, {"case": "broken"}, _build_counter([]), is_builder=True)
    assert os.listdir(tmp_path) == []  # neither a partial index nor its temp directory
