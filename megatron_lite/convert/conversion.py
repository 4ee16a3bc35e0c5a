"""Any checkpoint in, any format out: the library behind ``tools/convert_checkpoint.py``.

Inputs (detected by ``megatron_lite.checkpoint_dirs.checkpoint_kind``): a run dir (its latest complete
checkpoint), a DeepSpeed step dir (any ZeRO stage and world size, consolidated with DeepSpeed's
own utilities), a consolidated dir (config.yml + model.safetensors) or a Hugging Face dir.

Targets: ``hf`` (hf_export), ``safetensors`` and ``megatron_lite`` (both a consolidated dir that
``megatron_lite.weights.load_model`` and training resume from), ``universal`` (DeepSpeed's universal
checkpoint of a step dir, optimizer state included: convert/universal.py). ``coca`` turns a RoPE model
into a CoCA model (see ``rope_to_coca``).

Weights stream shard by shard (convert/sharded.py: a 7B model is never in memory twice); outputs are
staged in a hidden sibling directory and moved into place when complete, so a failed conversion never
leaves a half-written OUTPUT, and ``force`` replaces an existing one only then.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_lite import checkpoint_dirs
from megatron_lite import config as config_lib
from megatron_lite.checkpoint_integrity import is_staging_dir
from megatron_lite.config import Config
from megatron_lite.console import notice
from megatron_lite.convert.hf_config import uses_stock_model
from megatron_lite.convert.hf_export import write_hf_metadata
from megatron_lite.convert.hf_import import import_hf
from megatron_lite.convert.sharded import open_shards, write_consolidated_shards, write_hf_shards
from megatron_lite.convert.universal import convert_step_to_universal
from megatron_lite.model.gpt import DTYPES
from megatron_lite.model.variants import variant_named, variant_of_position
from megatron_lite.processes import pid_alive
from megatron_lite.weights import check_tensors, expected_shapes, load_state_dict, save_consolidated_metadata

TARGETS = ("hf", "safetensors", "megatron_lite", "universal")


@dataclass
class LoadedCheckpoint:
    state: dict[str, torch.Tensor]  # megatron_lite names
    config: Config
    tokenizer_path: Path | None
    kind: str  # run | step | consolidated | hf
    step: int | None = None  # the training step of a step dir (a run dir: of its latest complete checkpoint)


@dataclass
class ConversionResult:
    output: Path
    source_kind: str  # run | step | consolidated | hf
    config: Config  # of the written model
    needs_remote_code: bool  # an hf output that loads only with trust_remote_code=True
    step: int | None = None  # the training step exported, when the input is a run or step dir


def read_checkpoint(path: str | os.PathLike[str]) -> LoadedCheckpoint:
    """Weights (megatron_lite names, checked against the config), config and tokenizer of any input."""
    resolved = checkpoint_dirs.resolve_checkpoint(path)
    kind = checkpoint_dirs.checkpoint_kind(resolved)
    if kind == "hf":
        state, config, tokenizer = import_hf(resolved)
    else:
        state, config, tokenizer = load_state_dict(resolved)
        check_tensors(state, expected_shapes(config.model), str(resolved))
    step = checkpoint_dirs.checkpoint_step(resolved) if kind == "step" else None
    return LoadedCheckpoint(state, config, tokenizer, kind, step)


def rope_to_coca(config: Config, constraint: str) -> Config:
    """The same weights read as CoCA: the K projection becomes T (paper's fine-tuning start): the K slot of the
    GPT-NeoX family's fused ``query_key_value``, the LLaMA family's ``k_proj`` (one T per key/value head).

    Preserved: every tensor bitwise, the rotary base/pct/scaling, all other settings. Not preserved:
    the function — CoCA scores (q * R q).(R t) (slack) or (R u).(R w) (strict) differ from RoPE's
    (R q).(R k), so logits change until the model is fine-tuned (the paper's stages 1-3).
    """
    if variant_of_position(config.model.position) != variant_named("rope"):
        raise ValueError(f"--coca converts a RoPE model; this one has model.position.scheme={config.model.position.scheme!r}")
    if constraint not in ("slack", "strict"):
        raise ValueError(f"--coca {constraint!r}: must be slack or strict")
    data = config_lib.to_dict(config)
    data["model"]["position"].update(scheme="coca", constraint=constraint)
    return config_lib.from_dict(data)


def _remove_dead_stagings(output: Path) -> None:
    """Staging folders beside ``output`` (``.<name>.partial-<pid>``) that conversions killed before their rename
    left (a kill skips their clean-up) and whose process on this host is gone: removed, with a notice each."""
    for stale in sorted(output.parent.glob(f".{output.name}.partial-*")):
        pid = stale.name.rsplit("-", 1)[1]
        if is_staging_dir(stale.name) and stale.is_dir() and not pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
            if not stale.exists():
                notice(f"{stale}: removed, the staging folder of a conversion to {output} that did not finish")


@contextlib.contextmanager
def staged_output(output: Path, force: bool, source: Path) -> Iterator[Path]:
    """Yield an empty staging dir that becomes ``output`` on success; refuse a non-empty output without force."""
    output, source = output.resolve(), source.resolve()
    if output.exists() and not output.is_dir():
        raise ValueError(f"OUTPUT {output} exists and is not a directory")
    if output.exists() and any(output.iterdir()) and not force:
        raise ValueError(f"OUTPUT {output} is not empty; pass --force to replace its contents")
    if source == output or output in source.parents:
        raise ValueError(f"OUTPUT {output} contains INPUT {source}; choose another OUTPUT")
    _remove_dead_stagings(output)
    staging = output.parent / f".{output.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if output.exists():
        shutil.rmtree(output)
    os.replace(staging, output)


def convert_checkpoint(
    input_path: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    to: str,
    dtype: str = "fp32",
    force: bool = False,
    coca: str | None = None,
) -> ConversionResult:
    """Convert ``input_path`` to ``to`` (hf | safetensors | megatron_lite) in ``output_path``."""
    if to not in TARGETS:
        raise ValueError(f"--to {to!r}: must be one of {', '.join(TARGETS)}")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: must be one of {', '.join(DTYPES)}")
    output = Path(output_path)
    source = Path(input_path)
    if to == "universal":  # DeepSpeed's own format, for any number of ranks: optimizer state included, no dtype change
        if coca is not None or dtype != "fp32":
            raise ValueError("--to universal keeps DeepSpeed's fp32 state as it is: no --coca or --dtype")
        step_dir = convert_step_to_universal(source, output, force)
        config = config_lib.load(checkpoint_dirs.step_config_file(step_dir))
        return ConversionResult(output.resolve(), "step", config, False, checkpoint_dirs.checkpoint_step(step_dir))
    if output.exists() and output.is_dir() and any(output.iterdir()) and not force:  # fail before the slow load
        raise ValueError(f"OUTPUT {output.resolve()} is not empty; pass --force to replace its contents")
    loaded = open_shards(source)
    config = rope_to_coca(loaded.config, coca) if coca is not None else loaded.config
    with staged_output(output, force, source) as staging:
        if to == "hf":
            write_hf_metadata(config, staging, loaded.tokenizer_path, DTYPES[dtype])
            write_hf_shards(loaded, config, staging, DTYPES[dtype])
        else:
            write_consolidated_shards(loaded, staging, DTYPES[dtype])
            save_consolidated_metadata(config, staging, loaded.tokenizer_path)
    remote = to == "hf" and not uses_stock_model(config.model)
    return ConversionResult(output.resolve(), loaded.kind, config, remote, loaded.step)
