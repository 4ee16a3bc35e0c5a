"""type: megatron sources: existing MMIDIDX shards (written here by an independent struct writer) are
recorded in place, range-checked against the declared tokenizer, loaded and trained on."""

from __future__ import annotations

import os
import random
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from megatron_lite import config as config_lib
from megatron_lite.console import Notice
from megatron_lite.data.indexed import IndexedDataset, IndexedDatasetError
from megatron_lite.data.loader import build_train_valid_datasets, document_lengths, resolve_sources
from megatron_lite.data.mix import load_mix
from megatron_lite.data.preprocess import prepare_data
from megatron_lite.data.sources import megatron_prefixes, read_source
from megatron_lite.data.tokenizer import train_tokenizer
from megatron_lite.data.verify import unverified_shards, verify_shards
from training_helpers import metrics, run_train, tiny_train_config, write_config

VOCAB = 300
WORDS = "the of and to in is was for on that with as by at from his her it an were are which this be".split()
# Independent of indexed.py: the byte layout as documented by Megatron's MMapIndexedDataset.
MAGIC = b"MMIDIDX\x00\x00"
CODE_FMT = {4: ("i", 4), 8: ("H", 2)}  # dtype code -> (struct format, itemsize)

Doc = list[list[int]]  # a document: its sequences


def write_shard(prefix: Path, docs: list[Doc], code: int, *, doc_idx: list[int] | None = None,
                extra: bytes = b"") -> None:
    """{prefix}.bin/.idx with struct only; ``doc_idx`` overrides the boundaries, ``extra`` is appended to .idx."""
    fmt, itemsize = CODE_FMT[code]
    seqs = [seq for doc in docs for seq in doc]
    sizes = [len(seq) for seq in seqs]
    pointers = [itemsize * sum(sizes[:i]) for i in range(len(sizes))]
    if doc_idx is None:
        doc_idx = [0]
        for doc in docs:
            doc_idx.append(doc_idx[-1] + len(doc))
    n, d = len(sizes), len(doc_idx)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{prefix}.idx").write_bytes(
        MAGIC + struct.pack("<QBQQ", 1, code, n, d) + struct.pack(f"<{n}i", *sizes) + struct.pack(f"<{n}q", *pointers)
        + struct.pack(f"<{d}q", *doc_idx) + extra)
    flat = [token for seq in seqs for token in seq]
    Path(f"{prefix}.bin").write_bytes(struct.pack(f"<{len(flat)}{fmt}", *flat))


def random_docs(count: int, seed: int, multi: bool = False) -> list[Doc]:
    """Documents of random ids in [3, VOCAB) ending with EOD 0; ``multi``: some of two sequences."""
    rng = random.Random(seed)
    docs = []
    for _ in range(count):
        tokens = [rng.randrange(3, VOCAB) for _ in range(rng.randint(10, 50))] + [0]
        cut = rng.randint(1, len(tokens) - 1) if multi and rng.random() < 0.5 else len(tokens)
        docs.append([tokens[:cut], tokens[cut:]] if cut < len(tokens) else [tokens])
    return docs


def flat(doc: Doc) -> list[int]:
    return [token for seq in doc for token in seq]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(60)) + ".\n" for _ in range(60)]
    return train_tokenizer(texts, tmp_path_factory.mktemp("tok") / "t.model", vocab_size=VOCAB).path


def write_mix(root: Path, sources: dict[str, dict[str, Any]]) -> Path:
    groups = {f"g_{name}": {"weight": 1.0, "sources": {name: spec}} for name, spec in sources.items()}
    path = root / "mix.yml"
    path.write_text(yaml.safe_dump({"groups": groups}))
    return path


def data_config(root: Path, mix: Path, model: Path | None) -> config_lib.DataConfig:
    tokenizer = {"model": str(model)} if model is not None else {}
    return config_lib.from_dict({"data": {"mix": str(mix), "cache_dir": str(root / "cache"), "num_workers": 1,
                                          "validation_fraction": 0.1, "tokenizer": tokenizer}}).data


def megatron(path: Path | str, model: Path) -> dict[str, Any]:
    return {"type": "megatron", "path": str(path), "tokenizer": str(model)}


def test_shards_are_recorded_in_place_and_samples_are_their_tokens(tmp_path: Path, model_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    u16 = [random_docs(20, 1, multi=True), random_docs(15, 2, multi=True)]  # a directory of two uint16 shards
    i32 = random_docs(25, 3)  # one int32 shard, named by a glob of its files
    for k, docs in enumerate(u16):
        write_shard(tmp_path / "u16" / "sub" / f"part_{k}_text_document", docs, code=8)
    write_shard(tmp_path / "i32" / "all_text_document", i32, code=4)
    mix = write_mix(tmp_path, {"u16": megatron(tmp_path / "u16", model_path),
                               "i32": megatron(tmp_path / "i32" / "*_document.*", model_path)})
    data = data_config(tmp_path, mix, model_path)
    manifest = prepare_data(data, VOCAB, progress=True)
    report = capsys.readouterr().out
    assert "linked" in report and "read in place" in report
    u16_record, i32_record = manifest.sources["u16"], manifest.sources["i32"]
    assert [s.prefix for s in u16_record.shards] == [str(tmp_path / f"u16/sub/part_{k}_text_document") for k in (0, 1)]
    assert (u16_record.documents, i32_record.documents) == (35, 25)
    assert i32_record.tokens == sum(len(flat(doc)) for doc in i32)
    assert not (tmp_path / "cache" / "shards").exists()  # nothing copied
    assert unverified_shards(data.cache_dir, manifest) == []  # stamped: training reads nothing twice

    written = {"u16": [flat(doc) for docs in u16 for doc in docs], "i32": [flat(doc) for doc in i32]}
    train, _ = build_train_valid_datasets(data, 32, manifest, num_train_samples=40, num_valid_samples=0)
    dataset = train.dataset
    for source, name in enumerate(dataset.source_names):
        stream_order = dataset.index.arrays[f"doc_order_{source}"]
        stream = np.concatenate([written[name][int(d)] for d in stream_order])  # (tokens,) documents in order
        starts = np.concatenate([[0], np.cumsum([len(written[name][int(d)]) for d in stream_order])])
        for k in np.flatnonzero(dataset.blend_source == source):
            position, offset = (int(v) for v in dataset.index.arrays[f"sample_idx_{source}"][dataset._blend_sample[k]])
            start = int(starts[position]) + offset
            assert dataset.tokens(int(k)).tolist() == stream[start : start + 33].tolist()

    again = prepare_data(data, VOCAB, progress=True)
    assert "linked" not in capsys.readouterr().out and again == manifest  # cached
    docs = random_docs(20, 9)
    write_shard(tmp_path / "i32" / "all_text_document", docs, code=4)  # changed files: read again
    assert prepare_data(data, VOCAB, progress=False).sources["i32"].tokens == sum(len(flat(d)) for d in docs)


def test_merged_set_without_document_boundaries_is_one_document_per_sequence(tmp_path: Path, model_path: Path) -> None:
    seqs = [flat(doc) for doc in random_docs(12, 4)]
    prefix = tmp_path / "merged" / "merged_text_document"
    write_shard(prefix, [[seq] for seq in seqs], code=8, doc_idx=[0])  # GPT-NeoX merge_datasets.py output
    with pytest.raises(IndexedDatasetError, match="merged set without document boundaries"):
        IndexedDataset(prefix)  # our own shards stay strictly validated
    data = data_config(tmp_path, write_mix(tmp_path, {"merged": megatron(prefix, model_path)}), model_path)
    message = rf"{prefix}\.idx: doc_idx=\[0\] \(a merged set without document boundaries, e\.g\. GPT-NeoX " \
              r"merge_datasets\.py\): reading each of its 12 sequences as one document"
    with pytest.warns(Notice, match=message):
        manifest = prepare_data(data, VOCAB, progress=False)
    assert manifest.sources["merged"].documents == 12
    verify_shards(data.cache_dir, manifest, manifest.sources["merged"].shards, progress=False)  # --verify-data
    sources, _ = resolve_sources(data, manifest, load_mix(data.mix))
    assert document_lengths(sources[0]).tolist() == [len(seq) for seq in seqs]
    train, _ = build_train_valid_datasets(data, 16, manifest, num_train_samples=8, num_valid_samples=0)
    assert [shard.document(local).tolist() for shard, local in (train.dataset._locate(0, k) for k in range(12))] == seqs


@pytest.mark.parametrize("bad,position", [(VOCAB, 7), (-1, 3)])
def test_token_id_outside_the_vocabulary_is_one_line_naming_the_file(tmp_path: Path, model_path: Path, bad: int,
                                                                      position: int) -> None:
    docs = random_docs(3, 5)
    docs[0][0][position] = bad
    write_shard(tmp_path / "s_text_document", docs, code=4)
    data = data_config(tmp_path, write_mix(tmp_path, {"s": megatron(tmp_path / "s_text_document", model_path)}),
                       model_path)
    with pytest.raises(ValueError) as error:
        prepare_data(data, VOCAB, progress=False)
    text = str(error.value)
    assert "\n" not in text and f"{tmp_path / 's_text_document.bin'}: " in text
    assert f"token id {bad} at position {position}" in text and str(model_path) in text


def test_tokenizer_must_be_declared_given_and_identical(tmp_path: Path, model_path: Path) -> None:
    write_shard(tmp_path / "s_text_document", random_docs(3, 6), code=8)
    prefix = tmp_path / "s_text_document"
    undeclared = write_mix(tmp_path, {"s": {"type": "megatron", "path": str(prefix)}})
    with pytest.raises(ValueError, match=r"groups\.g_s\.sources\.s\.tokenizer is required for type megatron"):
        load_mix(undeclared)
    mix = write_mix(tmp_path, {"s": megatron(prefix, model_path)})
    with pytest.raises(ValueError, match="data.tokenizer.model is required by the type megatron source"):
        prepare_data(data_config(tmp_path, mix, None), VOCAB, progress=False)
    other = tmp_path / "other.model"
    other.write_bytes(model_path.read_bytes() + b"\0")
    with pytest.raises(ValueError) as error:
        prepare_data(data_config(tmp_path, mix, other), VOCAB, progress=False)
    assert "\n" not in str(error.value)
    assert f"source s: tokenizer {model_path} differs from data.tokenizer.model {other}" in str(error.value)


def test_multimodal_index_is_refused_by_name(tmp_path: Path, model_path: Path) -> None:
    docs = random_docs(4, 7)
    write_shard(tmp_path / "mm_text_document", docs, code=8, extra=bytes(len(docs)))  # int8[N] sequence_modes
    data = data_config(tmp_path, write_mix(tmp_path, {"mm": megatron(tmp_path / "mm_text_document", model_path)}),
                       model_path)
    with pytest.raises(ValueError, match=r"a Megatron-core multimodal index \(4 extra bytes of sequence_modes after "
                                         r"doc_idx\); only text \(non-multimodal\) shards are supported"):
        prepare_data(data, VOCAB, progress=False)


def test_path_forms(tmp_path: Path) -> None:
    for name in ("a_text_document", "b_text_document", "nested/c_text_document"):
        write_shard(tmp_path / "d" / name, random_docs(1, 8), code=8)
    (tmp_path / "d" / "notes.txt").write_text("ignored")
    every = [str(tmp_path / "d" / name) for name in ("a_text_document", "b_text_document", "nested/c_text_document")]
    assert megatron_prefixes(str(tmp_path / "d"), "s") == every
    assert megatron_prefixes(every[0], "s") == megatron_prefixes(every[0] + ".bin", "s") == every[:1]
    assert megatron_prefixes(str(tmp_path / "d" / "*_document.*"), "s") == every[:2]  # .bin + .idx: one prefix
    assert megatron_prefixes(str(tmp_path / "d" / "[ab]_text_document"), "s") == every[:2]  # a glob of prefixes
    assert megatron_prefixes(str(tmp_path / "d" / "**" / "*.idx"), "s") == every
    os.unlink(every[1] + ".bin")
    with pytest.raises(ValueError, match=r"b_text_document\.bin is missing \(its \.idx is there\)"):
        megatron_prefixes(str(tmp_path / "d"), "s")
    with pytest.raises(ValueError, match="is neither a shard prefix"):
        megatron_prefixes(str(tmp_path / "nowhere"), "s")
    with pytest.raises(ValueError, match="matches no MMIDIDX shards"):
        megatron_prefixes(str(tmp_path / "d" / "*.txt"), "s")


def test_shards_have_no_text_to_read(tmp_path: Path) -> None:
    source = config_lib.SourceConfig(type="megatron", path=str(tmp_path), tokenizer="t.model")
    with pytest.raises(ValueError, match="type megatron holds token ids"):
        next(read_source(source, "s"))


@pytest.mark.slow
def test_train_py_runs_on_megatron_shards(tmp_path: Path, model_path: Path) -> None:
    root = tmp_path / "shards"
    write_shard(root / "a_text_document", random_docs(40, 10, multi=True), code=8)
    shutil.copy(model_path, tmp_path / "tok.model")  # the same bytes under another name is the same tokenizer
    mix = write_mix(tmp_path, {"shards": megatron(root, tmp_path / "tok.model")})
    config = tiny_train_config(mix, tmp_path / "cache", train_iters=3, eval_interval=3, eval_iters=1,
                               save_interval=3)
    config["data"]["tokenizer"] = {"model": str(model_path)}
    run_train(write_config(tmp_path / "config.yml", config), tmp_path / "run")
    losses = [row["loss"] for row in metrics(tmp_path / "run") if row.get("loss") is not None]
    assert len(losses) == 3 and all(np.isfinite(losses))
