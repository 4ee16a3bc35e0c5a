"""Training data for a run: build the cached tokenizer/shards if needed (rank 0), size the run, and
hand each rank its slice of the deterministic sample order (megatron_lite/data/loader.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from torch.utils.data import DataLoader

from megatron_lite.config import Config, MixConfig
from megatron_lite.data.loader import build_train_valid_datasets, sample_loader
from megatron_lite.data.manifest import Manifest, load_manifest
from megatron_lite.data.rank_zero_wait import RankZeroBuild
from megatron_lite.console import console, notice
from megatron_lite.data.mix import SourcePasses, format_passes, load_mix, repeat_warning, source_passes
from megatron_lite.data.tokenizer import check_document_mask
from megatron_lite.data.verify import ShardVerificationError, ensure_verified
from megatron_lite.training.deepspeed_config import BatchSizes
from megatron_lite.training.distributed import DistributedInfo, barrier


# DataLoader workers start as fresh interpreters, not forked: by the time the training iterator starts them the
# process has threads (the run lock's heartbeat, torch's and NCCL's, OpenBLAS's from importing numpy), and a fork
# copies their locks in whatever state they are (Python 3.12 warns "os.fork() was called ... multi-threaded").
# forkserver would fork its workers from a server that imports numpy, so threaded too. The cost is each worker's
# imports (a few seconds, once per run: the training iterator is made once, the validation loader has no workers);
# the datasets pickle as paths and re-map their files (data/loader.py).
WORKER_START_METHOD = "spawn"

# The data cache's summary (a table of sources and skipped records, ~13 lines) prints in full when this run built
# something and as one line when it reused the cache as it was; train.py --verbose sets this for the full summary
# at every start.
VERBOSE_SUMMARY = {"on": False}


def set_verbose_summary(on: bool) -> None:
    VERBOSE_SUMMARY["on"] = on


@dataclass
class TrainingData:
    manifest: Manifest
    total_steps: int
    steps_source: str  # how total_steps was chosen, for the log
    tokenizer_path: Path  # the cache's tokenizer.model or tokenizer.json, carried into every checkpoint
    mix: MixConfig  # data.mix, parsed once per process

    def loaders(self, config: Config, batch: BatchSizes, dist_info: DistributedInfo, consumed_samples: int
                ) -> tuple[DataLoader, DataLoader | None]:
        """This rank's training stream from ``consumed_samples`` and its validation stream."""
        train = config.train
        num_valid = validation_samples(config) if train.eval_interval else 0  # None below unless validates(config)
        train_set, valid_set = build_train_valid_datasets(
            config.data, config.model.seq_length, self.manifest, self.total_steps * batch.global_batch_size, num_valid,
            rank=dist_info.data_parallel_rank, world_size=dist_info.data_parallel_size,
            consumed_samples=consumed_samples, mix=self.mix)  # a sequence-parallel group shares its samples
        common = {"batch_size": batch.micro_batch_size, "seed": config.seed, "rank": dist_info.data_parallel_rank,
                  "pin_memory": dist_info.device.type == "cuda"}  # train_step's non_blocking copies stay async
        # a step's micro batches ready when it starts: the loop takes them at once, while the GPU is between steps
        train_loader = sample_loader(train_set, **common, purpose="train", num_workers=train.num_workers,
                                     batches_ahead=batch.gradient_accumulation_steps)
        if train.num_workers:
            train_loader.multiprocessing_context = WORKER_START_METHOD
        # every rank's share has the same length (padded), so the same number of batches, the last maybe short
        valid_loader = (None if valid_set is None else
                        sample_loader(valid_set, **common, purpose="valid", drop_last=False))
        return train_loader, valid_loader


def validates(config: Config) -> bool:
    """Whether the run has a validation set (``loaders`` gives a validation loader): train.eval_interval set, and
    samples to hold out (data.validation_fraction, train.eval_iters)."""
    return bool(config.train.eval_interval) and config.data.validation_fraction > 0 and validation_samples(config) > 0


def validation_samples(config: Config) -> int:
    """The validation set's size: train.eval_iters x train.train_micro_batch_size_per_gpu samples, whatever
    the world size (one rank scores them in eval_iters micro batches; N ranks split them)."""
    return config.train.eval_iters * config.train.train_micro_batch_size_per_gpu


def _prepare_on_rank0(config: Config, dist_info: DistributedInfo, verify_data: bool = False) -> MixConfig:
    """Rank 0 parses the mix, tokenises (cached after the first run) and verifies the shards not yet
    verified (all of them when ``verify_data``; data/verify.py) before any rank opens them; every rank
    learns whether it worked, waiting as long as that takes (data/rank_zero_wait.py: no collective timeout);
    returns the mix (the other ranks parse it once preparation succeeded). Rank 0 counts as a reader of the
    cache until it exits, so no run with other settings rebuilds it meanwhile (data/cache_lock.py)."""
    from megatron_lite.data.preprocess import prepare_data

    error: Exception | None = None
    mix: MixConfig | None = None
    waiting = RankZeroBuild(str(config.data.cache_dir))
    if dist_info.is_main:
        try:
            mix = load_mix(config.data.mix)
            manifest = prepare_data(config.data, config.model.vocab_size, mix=mix,
                                    brief_when_cached=not VERBOSE_SUMMARY["on"], keep_reading=True)
            ensure_verified(config.data.cache_dir, manifest, force=verify_data)
        except (ValueError, OSError) as caught:
            error = caught
    failed = waiting.failed_anywhere(error is not None)
    if isinstance(error, ShardVerificationError):
        raise error  # already one line naming the shard
    if error is not None:
        raise ValueError(f"data: {error}") from error
    if failed:
        raise ValueError("data preparation failed on rank 0 (see its message)")
    barrier()
    return mix if mix is not None else load_mix(config.data.mix)


def total_steps_for(config: Config, manifest: Manifest, batch: BatchSizes, train_iters: int | None) -> tuple[int, str]:
    """--train-iters, else train.train_iters, else train.train_epochs over the mix's training tokens."""
    if train_iters is not None:
        if train_iters <= 0:
            raise ValueError(f"--train-iters {train_iters}: must be positive")
        return train_iters, "--train-iters"
    if config.train.train_iters is not None:
        return config.train.train_iters, "train.train_iters"
    tokens = sum(training_tokens(config, manifest).values())
    steps = max(1, math.ceil(config.train.train_epochs * tokens / batch.tokens_per_step(config.model.seq_length)))
    return steps, f"train.train_epochs={config.train.train_epochs} over {tokens:,.0f} training tokens"


def training_tokens(config: Config, manifest: Manifest) -> dict[str, float]:
    """Per source: its tokens less the validation split's share (the split holds out documents, so this is
    the expected count, not the exact one)."""
    return {name: record.tokens * (1.0 - config.data.validation_fraction) for name, record in manifest.sources.items()}


def run_passes(config: Config, manifest: Manifest, mix: MixConfig, total_steps: int, batch: BatchSizes
               ) -> list[SourcePasses]:
    """Per source: the training tokens it holds, the tokens ``total_steps`` steps draw from it, the passes."""
    drawn = total_steps * batch.tokens_per_step(config.model.seq_length)
    return source_passes(mix, training_tokens(config, manifest), drawn)


def passes_summary(config: Config, manifest: Manifest, mix: MixConfig, total_steps: int, batch: BatchSizes
                   ) -> tuple[str, str | None]:
    """The start's lines on what the run reads (per source: tokens held, drawn, passes) and the repeat warning."""
    rows = run_passes(config, manifest, mix, total_steps, batch)
    drawn = total_steps * batch.tokens_per_step(config.model.seq_length)
    return f"data: {total_steps} steps draw {drawn:,} tokens\n{format_passes(rows)}", repeat_warning(rows)


def prepare_training_data(config: Config, batch: BatchSizes, dist_info: DistributedInfo, train_iters: int | None,
                          verify_data: bool = False) -> TrainingData:
    mix = _prepare_on_rank0(config, dist_info, verify_data)
    manifest = load_manifest(config.data.cache_dir)
    tokenizer_path = Path(config.data.cache_dir) / manifest.tokenizer.path  # tokenizer.model or tokenizer.json
    vocab = manifest.tokenizer.vocab_size
    if vocab > config.model.vocab_size:  # prepare_data checked it; a manifest from elsewhere may not be
        raise ValueError(f"data.tokenizer.model: the tokenizer ({tokenizer_path}) has {vocab} tokens, more than "
                         f"model.vocab_size={config.model.vocab_size}")
    check_document_mask(manifest.tokenizer.eod_id, config.model, str(tokenizer_path))
    steps, source = total_steps_for(config, manifest, batch, train_iters)
    if dist_info.is_main:
        lines, warning = passes_summary(config, manifest, mix, steps, batch)
        console(lines)
        if warning:
            notice(warning)
    return TrainingData(manifest, steps, source, tokenizer_path, mix)
