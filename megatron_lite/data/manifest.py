"""The contract between preprocessing and loading: what was tokenised, where, with which tokenizer.

    <data.cache_dir>/
      tokenizer/tokenizer.model          SentencePiece model (trained or copied), or
      tokenizer/tokenizer.json           a Hugging Face tokenizer (copied, + its tokenizer_config.json)
      shards/<source>/<source>_<k>_text_document.{bin,idx}   MMIDIDX shards, k = 00000, 00001, ...
      manifest.json                      this file (written last, atomically)
      index/                             cached sample orders (.npy), written by the loader
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_lite.files import write_json_atomic


@dataclass
class ShardRecord:
    prefix: str  # relative to the cache dir, without .bin/.idx
    documents: int
    tokens: int
    bin_sha256: str
    idx_sha256: str


@dataclass
class SourceRecord:
    group: str
    config_hash: str  # hash of the SourceConfig and cleaning settings that produced the shards
    shards: list[ShardRecord] = field(default_factory=list)
    documents: int = 0
    tokens: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # problem -> count (bad records, too short, duplicates)
    skipped_examples: dict[str, list[str]] = field(default_factory=dict)  # problem -> first few locations
    complete: bool = False
    warnings: dict[str, int] = field(default_factory=dict)  # problem -> documents kept despite it (gutenberg markers missing)
    warning_examples: dict[str, list[str]] = field(default_factory=dict)  # problem -> first few locations


@dataclass
class TokenizerRecord:
    path: str  # relative to the cache dir
    sha256: str  # identity: the file's sha256 (tokenizer.json: folded with its tokenizer_config.json's)
    vocab_size: int
    eod_id: int
    pad_id: int


@dataclass
class EvaluationRecord:
    """The evaluation texts the sources were checked against (data/eval_overlap.py)."""

    key: str  # folded into every text source's config_hash: other texts -> the sources are built (checked) again
    specs: list[str]  # data.eval_texts as given
    texts: list[str]  # the evaluation texts read (locations)
    missing: list[str] = field(default_factory=list)  # specs naming no existing path: nothing of them checked


@dataclass
class Manifest:
    tokenizer: TokenizerRecord
    sources: dict[str, SourceRecord] = field(default_factory=dict)
    evaluation: EvaluationRecord | None = None  # None: a cache built before evaluation texts were checked

    def shard_prefixes(self, cache_dir: str | Path, source: str) -> list[Path]:
        return [Path(cache_dir) / shard.prefix for shard in self.sources[source].shards]


def manifest_path(cache_dir: str | Path) -> Path:
    return Path(cache_dir) / "manifest.json"


def save_manifest(manifest: Manifest, cache_dir: str | Path) -> None:
    """Atomic: a reader sees the old manifest or the new one."""
    path = manifest_path(cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, asdict(manifest), indent=2, sort_keys=True)


def load_manifest(cache_dir: str | Path) -> Manifest:
    path = manifest_path(cache_dir)
    if not path.is_file():
        raise ValueError(f"{path} does not exist: run tools/preprocess_data.py --config CONFIG first")
    data = json.loads(path.read_text())
    sources = {
        name: SourceRecord(**{**record, "shards": [ShardRecord(**shard) for shard in record["shards"]]})
        for name, record in data["sources"].items()
    }
    evaluation = EvaluationRecord(**data["evaluation"]) if data.get("evaluation") else None
    return Manifest(tokenizer=TokenizerRecord(**data["tokenizer"]), sources=sources, evaluation=evaluation)
