"""What a killed or damaged earlier run leaves behind is cleaned up or rebuilt by the next one, and named: a
universal conversion's staging folder, a truncated data shard, a garbage cached tokenizer."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from megatron_lite import config as config_lib
from megatron_lite.console import Notice
from megatron_lite.convert.universal import conversion_lock
from megatron_lite.training.checkpointing import plan_resume
from megatron_lite.training.distributed import DistributedInfo

ONE_RANK = DistributedInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


def _notices(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(warning.message) for warning in caught if issubclass(warning.category, Notice)]


# ----------------------------------------------------------------------------------------------
# A universal conversion killed before its rename


def test_a_resume_removes_the_staging_folder_of_a_killed_conversion_but_not_a_running_ones(tmp_path: Path) -> None:
    """A resume on the saved number of ranks converts nothing, yet removes the staging folder a killed conversion
    left in the step dir (with one notice naming it); while a conversion of the step dir runs (it holds the step
    dir's lock) the folder is its own and stays."""
    step_dir = tmp_path / "checkpoints" / "step_00000004"
    staging = step_dir / ".universal.partial-4242"
    (staging / "universal" / "zero").mkdir(parents=True)
    (staging / "universal" / "zero" / "optimizer_state.pt").write_bytes(b"\0" * 300_000)
    (staging / "source").mkdir()
    (staging / "source" / "mp_rank_00_model_states.pt").symlink_to(tmp_path)  # links to the step's files
    config = config_lib.Config()
    marker = {"step": 4, "world_size": 1, "zero_stage": config.train.zero_stage}

    with conversion_lock(step_dir), warnings.catch_warnings(record=True) as caught:  # a conversion running now
        warnings.simplefilter("always")
        assert not plan_resume(step_dir, marker, config, ONE_RANK).universal
    assert staging.is_dir() and _notices(caught) == []

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not plan_resume(step_dir, marker, config, ONE_RANK).universal
    assert not staging.exists() and tmp_path.is_dir()  # the link removed, not what it points to
    assert _notices(caught) == [f"{staging}: removed (0.3 MB), the staging folder of a universal conversion that "
                                "did not finish"]


# ----------------------------------------------------------------------------------------------
# The data cache


@pytest.fixture
def cache_copy(training_corpus, tmp_path: Path) -> tuple[config_lib.Config, Path]:
    """(config, its data cache): a copy of the tokenised corpus the tests share."""
    from training_helpers import tiny_train_config

    mix, cache = training_corpus
    shutil.copytree(cache, tmp_path / "cache")
    return config_lib.from_dict(tiny_train_config(mix, tmp_path / "cache")), tmp_path / "cache"


def _prepare(config: config_lib.Config) -> list[str]:
    """The notices of one ``prepare_data`` (quiet otherwise)."""
    from megatron_lite.data.preprocess import prepare_data

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepare_data(config.data, config.model.vocab_size, progress=False)
    return _notices(caught)


def test_a_damaged_shard_is_named_once_when_it_is_rebuilt(cache_copy: tuple[config_lib.Config, Path]) -> None:
    """A half-truncated ``.idx``, then a shortened ``.bin``: each rebuilt with one notice naming it and why;
    the rebuilt cache is reused without a word."""
    config, cache = cache_copy
    idx = next((cache / "shards" / "prose").glob("*.idx"))
    bin_file = next((cache / "shards" / "code").glob("*.bin"))
    intact = {path: path.read_bytes() for path in (idx, bin_file)}
    idx.write_bytes(intact[idx][: len(intact[idx]) // 2])
    assert _prepare(config) == [f"data cache: {idx} is damaged ({len(intact[idx]) // 2:,} bytes, "
                                f"{len(intact[idx]):,} from the manifest's counts); rebuilding source prose from there"]
    assert idx.read_bytes() == intact[idx]
    bin_file.write_bytes(intact[bin_file][:-2])
    assert _prepare(config) == [f"data cache: {bin_file} is damaged ({len(intact[bin_file]) - 2:,} bytes, "
                                f"{len(intact[bin_file]):,} from the manifest's counts); rebuilding source code from "
                                "there"]
    assert bin_file.read_bytes() == intact[bin_file] and _prepare(config) == []


def test_a_garbage_cached_tokenizer_is_retrained_and_a_garbage_given_one_is_named(
        cache_copy: tuple[config_lib.Config, Path], tmp_path: Path) -> None:
    """The cache's own trained model: named and retrained (the same model, so the shards stay). A model the
    config gives: one line naming that file, which is left as it is, and no copy of it stays in the cache."""
    from megatron_lite.data.tokenizer import ensure_tokenizer

    config, cache = cache_copy
    model = cache / "tokenizer" / "tokenizer.model"
    trained = model.read_bytes()
    model.write_bytes(b"\x00garbage" * 64)
    said = _prepare(config)
    assert said == [f"data cache: {model} is damaged (not a SentencePiece model (INTERNAL: could not parse "
                    f"ModelProto from {model})); retraining it"]
    assert model.read_bytes() == trained and _prepare(config) == []
    spec = cache / "tokenizer" / "train_spec.json"
    spec.write_text("{not json")
    assert _prepare(config)[0].startswith(f"data cache: {spec} is damaged (not JSON: ")
    assert model.read_bytes() == trained and _prepare(config) == []

    given = tmp_path / "spm.model"
    given.write_bytes(b"\x00garbage" * 64)
    with pytest.raises(ValueError) as error:
        ensure_tokenizer(config_lib.with_overrides(config, [f"data.tokenizer.model={given}"]).data,
                         config.model.vocab_size, progress=False)
    assert str(error.value) == (f"data.tokenizer.model='{given}': tokenizer model {given}: not a SentencePiece model "
                                f"(INTERNAL: could not parse ModelProto from {given}); fix or replace that file")
    assert given.read_bytes() == b"\x00garbage" * 64 and not model.exists()


def test_a_conversion_removes_the_staging_folders_of_killed_conversions_to_the_same_output(tmp_path: Path) -> None:
    """``.OUT.partial-PID`` of a process gone: removed (one notice each); of a live one (a conversion running now,
    here this test's parent): kept; another output's: not looked at."""
    import subprocess

    from megatron_lite.convert.conversion import staged_output

    gone = subprocess.Popen(["true"])
    gone.wait()
    output, source = tmp_path / "hf", tmp_path / "step"
    source.mkdir()
    dead, live, other = (tmp_path / f".hf.partial-{gone.pid}", tmp_path / f".hf.partial-{os.getppid()}",
                         tmp_path / f".other.partial-{gone.pid}")
    for folder in (dead, live, other):
        (folder / "model").mkdir(parents=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with staged_output(output, False, source) as staging:
            (staging / "config.json").write_text("{}")
    assert (output / "config.json").is_file() and not dead.exists() and live.is_dir() and other.is_dir()
    assert _notices(caught) == [f"{dead}: removed, the staging folder of a conversion to {output} that did not finish"]
