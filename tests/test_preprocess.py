"""prepare_data: shards + manifest, bad-record report, --strict, idempotence, resume, determinism."""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from megatron_lite import config as config_lib
from megatron_lite.data import preprocess
from megatron_lite.data.indexed import IndexedDataset
from megatron_lite.data.manifest import load_manifest
from megatron_lite.data.preprocess import BadRecordError, prepare_data
from megatron_lite.data.sample_corpus import stdlib_dir
from megatron_lite.data.tokenizer import Tokenizer, train_tokenizer
from megatron_lite.files import file_sha256
from script_loading import load_script

REPO = Path(__file__).resolve().parents[1]
CODE_FILES = ["textwrap.py", "string.py", "json/decoder.py", "json/encoder.py", "keyword.py"]
WORDS = "the of and to in is was for on that with as by at from his her it an were are which this be".split()


def _prose(n: int) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))).capitalize() + ".\r\n" for _ in range(n)]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    code = [(stdlib_dir() / name).read_text(encoding="utf-8") for name in CODE_FILES]
    return train_tokenizer(code + _prose(100), tmp_path_factory.mktemp("tok") / "t.model", vocab_size=400).path


def _write_data(root: Path) -> Path:
    """A text group (jsonl with one record of each problem) and a code group (a directory of .txt)."""
    docs = _prose(12)
    lines = [json.dumps({"text": d}).encode() for d in docs[:4]]
    lines += [b'{"text": ', json.dumps({"title": "x"}).encode(), b'{"text": "\xff"}', json.dumps({"text": ""}).encode()]
    lines += [json.dumps({"text": d}).encode() for d in docs[4:]]
    lines += [json.dumps({"text": docs[0]}).encode(), json.dumps({"text": "tiny"}).encode()]  # duplicate, too short
    (root / "prose.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (root / "code").mkdir()
    for name in CODE_FILES:
        (root / "code" / name.replace("/", "_").replace(".py", ".txt")).write_text((stdlib_dir() / name).read_text())
    (root / "code" / "zz_latin1.txt").write_bytes(b"caf\xe9")
    (root / "mix.yml").write_text(
        "groups:\n"
        f"  text: {{weight: 0.75, sources: {{prose: {{type: jsonl, path: {root / 'prose.jsonl'}, min_chars: 10}}}}}}\n"
        f"  code: {{weight: 0.25, sources: {{code: {{type: text, path: {root / 'code'}}}}}}}\n")
    return root / "mix.yml"


def _config(root: Path, model: Path | None, cache: str = "cache", **data: Any) -> config_lib.Config:
    mix = root / "mix.yml" if (root / "mix.yml").exists() else _write_data(root)
    return config_lib.from_dict({
        "model": {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "vocab_size": 400},
        "data": {"mix": str(mix), "cache_dir": str(root / cache), "num_workers": 1,
                 "tokenizer": {"model": str(model) if model else None, "sample_chars": 60_000}, **data},
    })


def _mtimes(cache: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in sorted(cache.rglob("*")) if p.is_file()}


def test_shards_manifest_and_bad_record_report(tmp_path: Path, model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = _config(tmp_path, model_path)
    manifest = prepare_data(config.data, config.model.vocab_size, progress=True)
    cache, jsonl = tmp_path / "cache", tmp_path / "prose.jsonl"
    assert manifest == load_manifest(cache)
    tok = Tokenizer(cache / "tokenizer/tokenizer.model")
    assert (manifest.tokenizer.path, manifest.tokenizer.sha256) == ("tokenizer/tokenizer.model", file_sha256(model_path))

    prose = manifest.sources["prose"]
    assert (prose.group, prose.complete, prose.documents) == ("text", True, 12)
    assert prose.skipped == {"duplicate": 1, "empty": 1, "invalid_json": 1, "missing_field": 1, "non_utf8": 1,
                             "too_short": 1}
    assert prose.skipped_examples["invalid_json"][0].startswith(f"{jsonl}:5 (")
    assert prose.skipped_examples["duplicate"] == [f"{jsonl}:17"]
    code = manifest.sources["code"]
    assert (code.documents, code.skipped) == (5, {"non_utf8": 1})

    [shard] = prose.shards
    assert shard.prefix == "shards/prose/prose_00000_text_document"
    ds = IndexedDataset(cache / shard.prefix)
    assert ds.dtype == np.dtype("<u2") and (ds.num_documents, ds.num_tokens) == (12, shard.tokens)
    assert (shard.bin_sha256, shard.idx_sha256) == (file_sha256(ds.bin_path), file_sha256(ds.idx_path))
    texts = [d.replace("\r\n", "\n") for d in _prose(12)]  # cleaned: newlines normalised
    for k, text in enumerate(texts):
        tokens = ds.document(k).tolist()
        assert tokens[-1] == tok.eod_id and tokens.count(tok.eod_id) == 1
        assert tok.decode(tokens[:-1]) == text
    out = capsys.readouterr().out
    assert "prose: invalid_json x1" in out and f"{jsonl}:5" in out and "code: non_utf8 x1" in out


def test_documents_per_shard(tmp_path: Path, model_path: Path) -> None:
    config = _config(tmp_path, model_path)
    manifest = prepare_data(config.data, config.model.vocab_size, progress=False, documents_per_shard=5)
    shards = manifest.sources["prose"].shards
    assert [s.prefix for s in shards] == [f"shards/prose/prose_{k:05d}_text_document" for k in range(3)]
    assert [s.documents for s in shards] == [5, 5, 2]
    assert manifest.sources["prose"].tokens == sum(s.tokens for s in shards)


def test_second_run_does_no_work(tmp_path: Path, model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config(tmp_path, model_path)
    first = prepare_data(config.data, config.model.vocab_size, progress=False)
    before = _mtimes(tmp_path / "cache")
    reads: list[str] = []
    real = preprocess.read_source
    monkeypatch.setattr(preprocess, "read_source", lambda source, name: reads.append(name) or real(source, name))
    assert prepare_data(config.data, config.model.vocab_size, progress=False) == first
    assert reads == [] and _mtimes(tmp_path / "cache") == before  # nothing read, nothing rewritten
    with open(tmp_path / "prose.jsonl", "a") as handle:  # an edited input: only its source is rebuilt
        handle.write(json.dumps({"text": "A brand new document."}) + "\n")
    assert prepare_data(config.data, config.model.vocab_size, progress=False).sources["prose"].documents == 13
    assert reads == ["prose"]


def test_rebuilt_shards_leave_a_complete_manifest(tmp_path: Path, model_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Shards deleted and rebuilt to the same records: the manifest on disk ends complete (not the build's
    incomplete checkpoint), so the next start reads nothing."""
    config = _config(tmp_path, model_path)
    first = prepare_data(config.data, config.model.vocab_size, progress=False)
    for path in (tmp_path / "cache" / "shards" / "prose").iterdir():
        path.unlink()
    assert prepare_data(config.data, config.model.vocab_size, progress=False) == first
    assert load_manifest(tmp_path / "cache") == first
    monkeypatch.setattr(preprocess, "read_source", lambda *args: pytest.fail("source re-read"))
    prepare_data(config.data, config.model.vocab_size, progress=False)


def test_moving_a_source_to_another_group_needs_no_rebuild(tmp_path: Path, model_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config(tmp_path, model_path)
    prepare_data(config.data, config.model.vocab_size, progress=False)
    mix = tmp_path / "mix.yml"
    mix.write_text(mix.read_text().replace("  text:", "  books:"))
    monkeypatch.setattr(preprocess, "read_source", lambda *args: pytest.fail("source re-read"))
    assert prepare_data(config.data, config.model.vocab_size, progress=False).sources["prose"].group == "books"
    assert load_manifest(tmp_path / "cache").sources["prose"].group == "books"


def test_resume_after_interruption_keeps_finished_shards(tmp_path: Path, model_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config(tmp_path, model_path)
    real_read, real_encode = preprocess.read_source, preprocess._encode_chunk

    def crashing_read(source: Any, name: str) -> Any:
        for i, record in enumerate(real_read(source, name)):
            if i == 14:  # 10 good documents of prose read: shards 0 and 1 finished, shard 2 open
                raise RuntimeError("simulated crash")
            yield record

    monkeypatch.setattr(preprocess, "read_source", crashing_read)
    with pytest.raises(RuntimeError, match="simulated crash"):
        prepare_data(config.data, config.model.vocab_size, progress=False, documents_per_shard=3)
    partial = load_manifest(tmp_path / "cache").sources["prose"]
    assert not partial.complete and [s.documents for s in partial.shards] == [3, 3]
    finished = _mtimes(tmp_path / "cache/shards/prose")
    assert len(finished) == 4  # two .bin/.idx pairs, no temp files left behind

    encoded: list[int] = []
    monkeypatch.setattr(preprocess, "read_source", real_read)
    monkeypatch.setattr(preprocess, "_encode_chunk", lambda texts: encoded.append(len(texts)) or real_encode(texts))
    resumed = prepare_data(config.data, config.model.vocab_size, progress=False, documents_per_shard=3)
    assert sum(encoded) == 12 - 6 + 5  # prose after the kept shards, then all of code
    assert {p: t for p, t in _mtimes(tmp_path / "cache/shards/prose").items() if p in finished} == finished
    fresh_config = _config(tmp_path, model_path, cache="fresh")
    fresh = prepare_data(fresh_config.data, fresh_config.model.vocab_size, progress=False, documents_per_shard=3)
    assert resumed.sources == fresh.sources  # same shards, bytes (sha256) and counts as an uninterrupted build


def test_output_does_not_depend_on_worker_count(tmp_path: Path, model_path: Path) -> None:
    one_config, two_config = _config(tmp_path, model_path, cache="one"), _config(tmp_path, model_path, cache="two")
    one = prepare_data(one_config.data, one_config.model.vocab_size, workers=1, progress=False, documents_per_shard=4)
    two = prepare_data(two_config.data, two_config.model.vocab_size, workers=2, progress=False, documents_per_shard=4)
    assert one == two
    for record in one.sources.values():
        for shard in record.shards:
            for suffix in (".bin", ".idx"):
                assert (tmp_path / "one" / (shard.prefix + suffix)).read_bytes() == \
                       (tmp_path / "two" / (shard.prefix + suffix)).read_bytes()


def test_strict_aborts_at_first_bad_record(tmp_path: Path, model_path: Path) -> None:
    config = _config(tmp_path, model_path)
    with pytest.raises(BadRecordError, match=rf"source prose: bad record at {tmp_path / 'prose.jsonl'}:5: invalid_json"):
        prepare_data(config.data, config.model.vocab_size, strict=True, progress=False)


def test_source_without_documents_is_an_error(tmp_path: Path, model_path: Path) -> None:
    config = _config(tmp_path, model_path)
    (tmp_path / "prose.jsonl").write_text('{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"source prose: no documents left after skipping 1 records"):
        prepare_data(config.data, config.model.vocab_size, progress=False)


def test_preprocess_cli(tmp_path: Path, model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config_path = tmp_path / "run.yml"
    config_lib.save(_config(tmp_path, model_path), config_path)
    cli = load_script("tools/preprocess_data.py")
    assert cli.main(["--config", str(config_path), "--strict", "--quiet"]) == 2
    assert f"{tmp_path / 'prose.jsonl'}:5: invalid_json" in capsys.readouterr().err
    assert cli.main(["--config", str(config_path), "--workers", "1", "--documents-per-shard", "4"]) == 0
    out = capsys.readouterr().out
    assert "prose" in out and "built" in out and "missing_field x1" in out
    assert cli.main(["--config", str(config_path), "--set", "data.num_workers=0"]) == 2  # every CLI: a user error is 2


def test_full_disk_is_one_line_naming_the_shard_and_leaves_no_temporary_file(tmp_path: Path, model_path: Path) -> None:
    """A real file-size limit in tools/preprocess_data.py (RLIMIT_FSIZE with SIGXFSZ ignored: write() fails with
    EFBIG, as on a full disk) while the code shard is written: one error line naming it, no temporary file left."""
    config_path = tmp_path / "run.yml"
    config_lib.save(_config(tmp_path, model_path), config_path)
    limit = 16 << 10  # the tokenizer copy, the prose shard and the manifest fit; the code shard does not

    def limit_file_size() -> None:  # in the child, before exec (an ignored signal stays ignored)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, str(REPO / "tools/preprocess_data.py"), "--config", str(config_path),
                             "--quiet"], capture_output=True, text=True, env=env, preexec_fn=limit_file_size,
                            timeout=120)
    shard = tmp_path / "cache" / "shards/code/code_00000_text_document.bin"
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [f"error: {shard}: no room to write (File too large): the file system is "
                                          "full or a quota or file-size limit applies; free space and re-run (no "
                                          "partial file is left)"], result.stderr
    assert [path.name for path in (tmp_path / "cache").rglob("*") if ".tmp-" in path.name] == []
    assert not shard.exists()
    assert (tmp_path / "cache/shards/prose/prose_00000_text_document.bin").is_file()  # finished before: kept


def test_sample_recipe_trains_tokenizer_and_shards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """data/sample/prepare.py on a small mix (the real sample corpus takes ~15 s; see docs/data.md)."""
    _config(tmp_path, None)  # writes the data files
    monkeypatch.chdir(tmp_path)  # the script chdirs to the repo root; monkeypatch restores the cwd
    recipe = load_script("data/sample/prepare.py")
    overrides = [f"data.mix={tmp_path / 'mix.yml'}", f"data.cache_dir={tmp_path / 'cache'}", "model.vocab_size=400",
                 "data.tokenizer.sample_chars=60000", "data.num_workers=1"]
    argv = ["--config", str(REPO / "configs/tiny/coca_slack.yml")] + [a for o in overrides for a in ("--set", o)]
    assert recipe.main(argv) == 0
    assert os.getcwd() == str(REPO)
    assert "text: 12 documents" in capsys.readouterr().out
    manifest = load_manifest(tmp_path / "cache")
    assert manifest.tokenizer.vocab_size == 400 and (tmp_path / "cache/tokenizer/train_spec.json").is_file()
