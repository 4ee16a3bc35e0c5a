"""A data cache is built once, under a lock: runs started together on one fresh cache (real processes, the
training path's preparation) build it once and share it when their settings agree; with other settings one run is
refused with one line naming the other, and the cache stays whole; a killed builder's lock is taken over."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from megatron_lite import config as config_lib
from megatron_lite.console import Notice, show_notices
from megatron_lite.data import cache_lock
from megatron_lite.data.manifest import load_manifest
from megatron_lite.data.preprocess import prepare_data
from megatron_lite.data.tokenizer import Tokenizer, train_tokenizer
from megatron_lite.data.verify import ensure_verified
from megatron_lite.training.data import _prepare_on_rank0
from megatron_lite.training.distributed import DistributedInfo

WORDS = "the of and to in is was for on that with as by at from his her it an were are which this be".split()
RANK0 = DistributedInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
TRIES = 5
FORK = multiprocessing.get_context("fork")  # cheap: the children start with this process's imports


def _texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 80))).capitalize() + "." for _ in range(count)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A one-source mix and a given SentencePiece model of another vocabulary than the mix would train."""
    root = tmp_path_factory.mktemp("corpus")
    (root / "prose.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in _texts(150, 0)))
    (root / "mix.yml").write_text(
        f"groups:\n  text: {{weight: 1.0, sources: {{prose: {{type: jsonl, path: {root / 'prose.jsonl'}}}}}}}\n")
    given = train_tokenizer(_texts(100, 1), root / "given.model", vocab_size=300).path
    return {"mix": root / "mix.yml", "given": given}


def _config(corpus: dict[str, Path], cache: Path, given: bool) -> config_lib.Config:
    """Trained from the mix (vocab 320), or the given model (vocab 300): settings that cannot share a cache."""
    return config_lib.from_dict({
        "model": {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "vocab_size": 320},
        "data": {"mix": str(corpus["mix"]), "cache_dir": str(cache), "num_workers": 1,
                 "tokenizer": {"model": str(corpus["given"]) if given else None, "sample_chars": 30_000}},
    })


def _run(config: config_lib.Config, log: Path, start: Any, stop: Any, results: Any) -> None:
    """One run's data preparation (rank 0 of a one-rank run, as train.py does it); stays alive, reading the
    cache, until ``stop``."""
    sys.stdout = sys.stderr = log.open("w", buffering=1)
    show_notices()  # as train.py: each notice a "warning: ..." line (the parent's pytest would record them)
    os.environ[cache_lock.SLOW_BUILD_ENV] = "0.5"  # the first run still builds when the second asks
    start.wait()
    try:
        _prepare_on_rank0(config, RANK0)
        results.put((os.getpid(), "ok"))
    except ValueError as error:
        results.put((os.getpid(), f"error: {error}"))
    except BaseException as error:  # noqa: BLE001 - the parent reports it
        results.put((os.getpid(), f"crash: {error!r}"))
    results.close()
    results.join_thread()  # the outcome sent before the exit below
    stop.wait(60)
    os._exit(0)


def _race(configs: list[config_lib.Config], logs: list[Path]) -> tuple[dict[int, str], dict[int, str]]:
    """Start one run per config at once; (pid -> outcome, pid -> its output) once every run has prepared."""
    start, stop, results = FORK.Event(), FORK.Event(), FORK.Queue()
    runs = [FORK.Process(target=_run, args=(config, log, start, stop, results)) for config, log in zip(configs, logs)]
    for run in runs:
        run.start()
    start.set()
    try:
        outcomes = dict(results.get(timeout=120) for _ in runs)
    finally:
        stop.set()
        for run in runs:
            run.join(30)
    output = {run.pid: log.read_text() for run, log in zip(runs, logs)}
    assert all(run.exitcode == 0 for run in runs), output
    return outcomes, output


def _assert_whole(cache: Path, vocab: int) -> None:
    manifest = load_manifest(cache)
    assert manifest.tokenizer.vocab_size == vocab
    assert Tokenizer(cache / manifest.tokenizer.path).vocab_size == vocab
    ensure_verified(cache, manifest, force=True)  # every shard hashed against the manifest


def test_same_settings_build_once_and_share(tmp_path: Path, corpus: dict[str, Path]) -> None:
    for attempt in range(TRIES):
        cache = tmp_path / f"cache{attempt}"
        config = _config(corpus, cache, given=False)
        outcomes, output = _race([config, config], [tmp_path / f"a{attempt}.log", tmp_path / f"b{attempt}.log"])
        assert set(outcomes.values()) == {"ok"}, output
        trained = [pid for pid, text in output.items() if "tokenizer: trained" in text]
        waited = [pid for pid, text in output.items() if "waiting for PID" in text]
        assert len(trained) == 1 and len(waited) == 1 and waited != trained, output  # built once; the other waited
        builder = trained[0]
        assert f"waiting for PID {builder} on " in output[waited[0]] and "reused" in output[waited[0]], output
        _assert_whole(cache, 320)


def test_other_settings_never_rebuild_a_cache_in_use(tmp_path: Path, corpus: dict[str, Path]) -> None:
    for attempt in range(TRIES):
        cache = tmp_path / f"cache{attempt}"
        configs = [_config(corpus, cache, given=False), _config(corpus, cache, given=True)]
        outcomes, output = _race(configs, [tmp_path / f"trained{attempt}.log", tmp_path / f"given{attempt}.log"])
        ok = [pid for pid, outcome in outcomes.items() if outcome == "ok"]
        refused = [outcome for outcome in outcomes.values() if outcome != "ok"]
        assert len(ok) == 1 and len(refused) == 1, (outcomes, output)  # neither killed by the other
        assert refused[0].startswith(f"error: data: data cache {cache} is in use by PID {ok[0]} on "), refused
        assert "\n" not in refused[0] and "data.cache_dir" in refused[0]
        winner_given = output[ok[0]].count("tokenizer: trained") == 0
        _assert_whole(cache, 300 if winner_given else 320)  # the winner's cache, whole


def _build_then_hang(config: config_lib.Config, log: Path) -> None:
    sys.stdout = sys.stderr = log.open("w", buffering=1)
    os.environ[cache_lock.SLOW_BUILD_ENV] = "60"  # holds the lock until killed
    prepare_data(config.data, config.model.vocab_size, progress=False)
    os._exit(0)


def test_a_killed_builders_lock_is_taken_over(tmp_path: Path, corpus: dict[str, Path]) -> None:
    cache = tmp_path / "cache"
    config = _config(corpus, cache, given=True)
    builder = FORK.Process(target=_build_then_hang, args=(config, tmp_path / "builder.log"))
    builder.start()
    record = cache / cache_lock.LOCKS_DIR / "builder.json"
    deadline = time.monotonic() + 30
    while not record.is_file() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert record.is_file(), "the builder never took the lock"
    os.kill(builder.pid, signal.SIGKILL)
    builder.join(10)
    start = time.monotonic()
    with pytest.warns(Notice, match=f"taking over the build lock of PID {builder.pid} on .*its process is gone"):
        manifest = prepare_data(config.data, config.model.vocab_size, progress=False)
    assert time.monotonic() - start < 20 and manifest.tokenizer.vocab_size == 300
    assert not record.exists()  # released
    _assert_whole(cache, 300)


def _read_until(config: config_lib.Config, ready: Any, stop: Any) -> None:
    _prepare_on_rank0(config, RANK0)  # a run reading the cache
    ready.set()
    stop.wait(60)
    os._exit(0)


def test_a_source_change_under_a_live_reader_is_refused_before_anything_is_written(
        tmp_path: Path, corpus: dict[str, Path]) -> None:
    cache = tmp_path / "cache"
    config = _config(corpus, cache, given=True)
    ready, stop = FORK.Event(), FORK.Event()
    reader = FORK.Process(target=_read_until, args=(config, ready, stop))
    reader.start()
    try:
        assert ready.wait(60)
        files = {path: path.stat().st_mtime_ns for path in cache.rglob("*") if path.is_file() and ".locks" not in path.parts}
        built_for = load_manifest(cache).sources["prose"].config_hash
        mix = yaml.safe_load(corpus["mix"].read_text())
        mix["groups"]["text"]["sources"]["prose"]["min_chars"] = 50  # another cleaning setting: a rebuilt source
        (tmp_path / "mix.yml").write_text(yaml.safe_dump(mix))
        other = config_lib.with_overrides(config, [f"data.mix={tmp_path / 'mix.yml'}"])
        with pytest.raises(cache_lock.CacheInUse, match=f"in use by PID {reader.pid} on .* rebuild its source prose"):
            prepare_data(other.data, other.model.vocab_size, progress=False)
        assert {path: path.stat().st_mtime_ns for path in files} == files  # nothing rewritten
    finally:
        stop.set()
        reader.join(30)
    rebuilt = prepare_data(other.data, other.model.vocab_size, progress=False)  # that run ended: rebuilt in place
    assert rebuilt.sources["prose"].config_hash != built_for and rebuilt.sources["prose"].complete
