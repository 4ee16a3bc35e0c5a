"""The run's identity, checked when it continues from a checkpoint: the model's architecture and position
scheme (on resume) and the tokenizer (on resume and train.init_from).

A change of either would train on silently as another model, or on token ids that mean other text. The
model's identity never changes on resume (a deliberate RoPE-to-CoCA switch is a conversion,
tools/convert_checkpoint.py --coca, then a new run from it with train.init_from); a deliberate tokenizer
change is ``train.allow_tokenizer_change``, recorded in metrics.jsonl.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_lite import checkpoint_dirs
from megatron_lite.config import ModelConfig
from megatron_lite.data.hf_tokenizer import tokenizer_sha256

# model.* keys that make another function of the same tensors: a resume refuses a change of any of them.
IDENTITY_KEYS = ("architecture", "gpt_j_residual", "norm", "activation", "position.scheme", "position.constraint",
                 "position.rotary_pct", "position.rotary_emb_base")


def model_changes(saved: ModelConfig, config: ModelConfig) -> list[tuple[str, Any, Any]]:
    """(model.* key, checkpoint value, config value) of every setting that differs, nested keys dotted."""
    return [(f"model.{key}", before, after) for key, before, after in _leaf_changes(saved, config)]


def _leaf_changes(saved: Any, config: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    changes = []
    for field in dataclasses.fields(saved):
        before, after = getattr(saved, field.name), getattr(config, field.name)
        if dataclasses.is_dataclass(before):
            changes += _leaf_changes(before, after, f"{prefix}{field.name}.")
        elif before != after:
            changes.append((f"{prefix}{field.name}", before, after))
    return changes


def identity_changes(changes: list[tuple[str, Any, Any]]) -> list[str]:
    """One short clause per changed identity key, e.g. ``model.position.scheme: checkpoint 'coca', config
    'rope'``; the CoCA constraint only between two CoCA models (other schemes ignore it)."""
    changed = {key: (before, after) for key, before, after in changes}
    scheme_changed = "model.position.scheme" in changed
    return [f"{key}: checkpoint {before!r}, config {after!r}" for key, (before, after) in changed.items()
            if key.removeprefix("model.") in IDENTITY_KEYS
            and not (key == "model.position.constraint" and scheme_changed)]


@dataclass(frozen=True)
class TokenizerChange:
    """A checkpoint's tokenizer and the run's, which differ (train.allow_tokenizer_change)."""

    checkpoint: Path
    checkpoint_sha256: str
    run: Path
    run_sha256: str

    def metrics_row(self, step: int) -> dict[str, Any]:
        return {"step": step, "tokenizer_change": {"checkpoint": str(self.checkpoint),
                                                   "checkpoint_sha256": self.checkpoint_sha256,
                                                   "run": str(self.run), "run_sha256": self.run_sha256}}

    def describe(self) -> str:
        return (f"{self.checkpoint} (sha256 {self.checkpoint_sha256[:12]}) vs the run's {self.run} "
                f"(sha256 {self.run_sha256[:12]})")


def tokenizer_change(source: Path, run_tokenizer: Path, allowed: bool, what: str) -> TokenizerChange | None:
    """The change from the tokenizer ``source`` (a checkpoint dir) carries to ``run_tokenizer``; None when
    they are the same file or ``source`` carries none. ValueError (one line naming both files) when they
    differ and the change is not ``allowed``; ``what`` names the start, e.g. ``--resume <dir>``."""
    saved = checkpoint_dirs.find_tokenizer(source)
    if saved is None:
        return None
    change = TokenizerChange(saved, tokenizer_sha256(saved), run_tokenizer, tokenizer_sha256(run_tokenizer))
    if change.checkpoint_sha256 == change.run_sha256:
        return None
    if not allowed:
        raise ValueError(f"{what}: another tokenizer: the checkpoint's {change.describe()}; set "
                         "train.allow_tokenizer_change=true to train on with the run's")
    return change
