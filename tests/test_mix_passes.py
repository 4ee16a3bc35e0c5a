"""Epochs as passes: what a run draws from each source of a mix (the start summary, tools/inspect_data.py) and
the warning when one source is read more than 3 times while another is read less than once."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_lite import config as config_lib
from megatron_lite.config import MixConfig, parse_dataclass
from megatron_lite.data.mix import repeat_warning, source_passes
from megatron_lite.training.data import passes_summary, total_steps_for
from megatron_lite.training.deepspeed_config import resolve_batch_sizes
from test_loader import SEQ, SOURCES, write_cache


def _mix(text_weight: float, code_weight: float, explicit: bool = False) -> MixConfig:
    text = {"pile": {"type": "jsonl", "path": "p"}, "books": {"type": "jsonl", "path": "b"}}
    if explicit:
        text["pile"]["weight"], text["books"]["weight"] = 3.0, 1.0
    return parse_dataclass(MixConfig, {"groups": {
        "text": {"weight": text_weight, "sources": text},
        "code": {"weight": code_weight, "sources": {"github": {"type": "jsonl", "path": "g"}}}}})


def test_passes_follow_the_blend_rule():
    held = {"pile": 60e9, "books": 15e9, "github": 25e9}  # a mix sized to its 75/25 weights
    rows = {row.name: row for row in source_passes(_mix(0.75, 0.25), held, 200e9)}
    for name in held:  # 2 epochs of a balanced mix: every source read twice
        assert rows[name].tokens_held == held[name] and rows[name].passes == pytest.approx(2.0)
    assert sum(row.tokens_drawn for row in rows.values()) == pytest.approx(200e9)
    assert repeat_warning(list(rows.values())) is None
    explicit = {row.name: row for row in source_passes(_mix(0.75, 0.25, explicit=True), held, 200e9)}
    assert explicit["pile"].tokens_drawn == pytest.approx(200e9 * 0.75 * 0.75)  # weight 3 of 4 inside text
    assert explicit["books"].passes == pytest.approx(200e9 * 0.75 * 0.25 / 15e9)


def test_repeat_warning_names_the_sources():
    # the sizes docs/run_at_scale.md once estimated for paper_mix.yml: text 24.3B, code 31.4B, 2 epochs = 111.4B
    held = {"pile": 17.8e9, "books": 6.5e9, "github": 31.4e9}
    rows = source_passes(_mix(0.75, 0.25), held, 111.4e9)
    passes = {row.name: row.passes for row in rows}
    assert passes["pile"] == pytest.approx(3.44, abs=0.01) and passes["github"] == pytest.approx(0.89, abs=0.01)
    warning = repeat_warning(rows)
    assert warning is not None and "pile is read 3.4 times" in warning and "github is read 0.89 times" in warning
    assert repeat_warning(source_passes(_mix(0.75, 0.25), held, 90e9)) is None  # text 2.8 passes: under 3


def test_the_start_summary_prints_every_source_s_passes_and_warns(tmp_path: Path):
    mix_path, manifest = write_cache(tmp_path)
    config = config_lib.from_dict({
        "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": SEQ, "vocab_size": 8000},
        "data": {"mix": str(mix_path), "cache_dir": str(tmp_path), "validation_fraction": 0.1},
        "train": {"train_epochs": 3.0, "train_micro_batch_size_per_gpu": 4}})
    batch = resolve_batch_sizes(config, 1)
    steps, _ = total_steps_for(config, manifest, batch, None)
    drawn = steps * 4 * SEQ
    held = {name: record.tokens * 0.9 for name, record in manifest.sources.items()}
    for text_weight in (0.75, 0.9):
        mix = parse_dataclass(MixConfig, {"groups": {
            "text": {"weight": text_weight, "sources": {"prose": {"type": "jsonl", "path": "p"},
                                                        "books": {"type": "jsonl", "path": "b"}}},
            "code": {"weight": 1 - text_weight, "sources": {"code": {"type": "jsonl", "path": "c"}}}}})
        lines, warning = passes_summary(config, manifest, mix, steps, batch)
        assert lines.splitlines()[0] == f"data: {steps} steps draw {drawn:,} tokens"
        rows = {line.split()[0]: line for line in lines.splitlines()[1:]}
        assert list(rows) == list(SOURCES)
        code_passes = drawn * (1 - text_weight) / held["code"]
        assert rows["code"].endswith(f"= {code_passes:.2f} passes")
        text_passes = drawn * text_weight / (held["prose"] + held["books"])
        assert f"{held['books']:,.0f} tokens held" in rows["books"] and rows["books"].endswith(f"= {text_passes:.2f} passes")
        if text_weight == 0.75:
            assert text_passes > 3 and code_passes > 1 and warning is None  # every source read at least once: no warning
        else:
            assert text_passes > 3 and code_passes < 1  # 90/10 over the same sizes: text repeats, code is not read once
            assert warning is not None and warning.startswith(f"data: prose is read {text_passes:.1f} times while code")
