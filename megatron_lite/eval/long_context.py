"""Long-context evaluation of checkpoints: PG-19 sliding-window perplexity, passkey retrieval and the
RULER-style needle suite, for every model x RoPE scaling x context window (the paper's Tables 1-3 and
Figures 1 and 5).

``run_long_context_eval(settings)`` is what ``tools/eval_long_context.py`` calls. Results are cached
per (model, scaling, window), (model, scaling, passkey length) and (model, scaling, needle task,
length) under ``<out>/cache`` so an interrupted run resumes; at the end it
writes ``results.json``, ``tables.md``, the plots and ``run_info.json`` (timing and peak memory).
"""

from __future__ import annotations

import contextlib
import json
import re
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from tqdm import tqdm

from megatron_lite import config as config_lib
from megatron_lite.checkpoint_dirs import resolve_checkpoint
from megatron_lite.config import RopeScalingConfig
from megatron_lite.data.tokenizer import AnyTokenizer, model_tokenizer
from megatron_lite.eval.documents import EvalDocuments, load_documents
from megatron_lite.eval.needles import (DEFAULT_DEPTHS, NEW_TOKENS, TASKS, DocumentHaystack, Haystack,
                                        NeedlePromptBuilder, NoiseHaystack, draw_specs, effective_context,
                                        run_needles, summarize_needles)
from megatron_lite.eval.passkey import NUM_NEW_TOKENS, PasskeyPromptBuilder, run_passkey, summarize_cases
from megatron_lite.eval.perplexity import num_windows, sliding_window_perplexity
from megatron_lite.eval.report import write_reports
from megatron_lite.eval.results_cache import ResultCache, checkpoint_fingerprint, fingerprint
from megatron_lite.eval.scaling import NO_SCALING, ScalingSpec
from megatron_lite.model.gpt import DTYPES, GPT
from megatron_lite.model.variants import variant_of_position
from megatron_lite.weights import LoadedModel, load_model

DEFAULT_WINDOWS = [512 * 2**i for i in range(7)]  # 512 ... 32K


@dataclass
class LongContextSettings:
    checkpoints: list[str]  # "PATH" or "NAME=PATH"
    out_dir: Path
    ppl_docs: str | None = None
    windows: list[int] = field(default_factory=lambda: list(DEFAULT_WINDOWS))
    stride: int = 512
    max_doc_tokens: int = 32768
    max_doc_chars: int | None = None  # texts cut to this many characters before tokenising (bits per byte)
    max_docs: int | None = 100
    strip_gutenberg: bool = False
    split: str = "test"
    text_field: str = "text"
    passkey_lengths: list[int] = field(default_factory=list)
    passkey_cases: int = 100
    needles: list[str] = field(default_factory=list)  # needle tasks (megatron_lite.eval.needles.TASKS)
    needle_lengths: list[int] = field(default_factory=list)
    needle_cases: int = 20  # per task x length, cycling over needle_depths
    needle_depths: list[float] = field(default_factory=lambda: list(DEFAULT_DEPTHS))
    needle_haystack: str = "noise"  # noise (the filler sentence) | docs (the --ppl-docs documents)
    scalings: list[ScalingSpec] = field(default_factory=lambda: [NO_SCALING])
    seed: int = 1234
    batch_size: int = 1
    device: str = "cpu"
    dtype: str = "fp32"
    attention_backend: str = "auto"
    chunk_size: int = 1024
    tokenizer: str | None = None
    overrides: list[str] = field(default_factory=list)  # --set KEY=VALUE applied to every checkpoint's config
    progress: bool = True


def validate_settings(settings: LongContextSettings) -> None:
    if not settings.checkpoints:
        raise ValueError("--checkpoints: give at least one run, step or consolidated directory")
    if settings.ppl_docs is None and not settings.passkey_lengths and not settings.needles:
        raise ValueError("nothing to do: give --ppl-docs, --passkey-lengths and/or --needles")
    validate_needle_settings(settings)
    if settings.ppl_docs is not None:
        if not 1 <= settings.stride <= min(settings.windows):
            raise ValueError(f"--stride {settings.stride}: must be in [1, smallest window {min(settings.windows)}] "
                             "or tokens would go unscored")
        if max(settings.windows) > settings.max_doc_tokens:
            raise ValueError(f"--windows: {max(settings.windows)} is longer than --max-doc-tokens "
                             f"{settings.max_doc_tokens}; raise --max-doc-tokens or drop that window")
    if settings.passkey_cases < 1:
        raise ValueError(f"--passkey-cases {settings.passkey_cases}: must be >= 1")
    if settings.batch_size < 1:
        raise ValueError(f"--batch-size {settings.batch_size}: must be >= 1")
    validate_kernel_settings(settings.dtype, settings.attention_backend, settings.chunk_size)


def validate_kernel_settings(dtype: str, attention_backend: str, chunk_size: int) -> None:
    """--dtype, --attention-backend and --chunk-size, shared by the evaluation tools."""
    if chunk_size < 1:
        raise ValueError(f"--chunk-size {chunk_size}: must be >= 1")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: must be one of {', '.join(DTYPES)}")
    if attention_backend not in ("auto", "sdpa", "chunked", "flash", "reference"):
        raise ValueError(f"--attention-backend {attention_backend!r}: must be auto, sdpa, chunked, flash or reference")


def validate_needle_settings(settings: LongContextSettings) -> None:
    unknown = [task for task in settings.needles if task not in TASKS]
    if unknown:
        raise ValueError(f"--needles {unknown[0]!r}: unknown task; valid: all, {', '.join(TASKS)}")
    if settings.needles and not settings.needle_lengths:
        raise ValueError("--needles: give the prompt lengths with --needle-lengths")
    if settings.needle_lengths and not settings.needles:
        raise ValueError("--needle-lengths: give the tasks with --needles (all, or a comma list)")
    if settings.needle_cases < 1:
        raise ValueError(f"--needle-cases {settings.needle_cases}: must be >= 1")
    if not settings.needle_depths or any(not 0.0 <= depth <= 1.0 for depth in settings.needle_depths):
        raise ValueError(f"--needle-depths {','.join(map(str, settings.needle_depths))}: give depths in [0, 1]")
    if settings.needle_haystack not in ("noise", "docs"):
        raise ValueError(f"--needle-haystack {settings.needle_haystack!r}: must be noise or docs")
    if settings.needle_haystack == "docs" and settings.needles and settings.ppl_docs is None:
        raise ValueError("--needle-haystack docs: give the documents with --ppl-docs")


# ----------------------------------------------------------------------------------------------
# Models and attention backends


def parse_checkpoint_arg(text: str) -> tuple[str, Path]:
    """'NAME=PATH' or 'PATH'; the default name is the run directory's name (plus @step for a step dir)."""
    name, sep, path_text = text.partition("=")
    if not sep:
        name, path_text = "", text
    path = Path(path_text)
    if not name:
        resolved = path.resolve()
        step = re.fullmatch(r"step_0*(\d+)", resolved.name)
        name = f"{resolved.parent.parent.name}@{step.group(1)}" if step else resolved.name
    return name, path


@dataclass(frozen=True)
class AttentionChoice:
    """The kernel an evaluation runs with, and why (logged once per model)."""

    backend: str
    chunk_size: int
    reason: str

    @property
    def description(self) -> str:
        chunk = f", chunk size {self.chunk_size}" if self.backend == "chunked" else ""
        return f"attention backend {self.backend}{chunk} ({self.reason})"


def choose_attention(config: config_lib.Config, requested: str, chunk_size: int, device: str) -> AttentionChoice:
    """ALiBi: chunked (the fused kernels take its bias as a dense (H, T, T) tensor, 4 GiB per 16K
    window and head group); other schemes: sdpa's causal kernel, which never materialises T x T."""
    if requested != "auto":
        return AttentionChoice(requested, chunk_size, "--attention-backend")
    if variant_of_position(config.model.position).alibi_bias:
        return AttentionChoice("chunked", chunk_size, "ALiBi bias built per query block: O(chunk x T) memory")
    if config.model.attention.backend == "flash" and device.startswith("cuda"):
        return AttentionChoice("flash", chunk_size, "the checkpoint's backend")
    return AttentionChoice("sdpa", chunk_size, "fused causal kernel: O(T) memory")


def with_attention(loaded: LoadedModel, choice: AttentionChoice) -> GPT:
    """The loaded model rebuilt with the chosen kernel (same weights; the config carries the backend)."""
    attention = loaded.config.model.attention
    if attention.backend == choice.backend and attention.chunk_size == choice.chunk_size:
        return loaded.model
    overrides = [f"model.attention.backend={choice.backend}", f"model.attention.chunk_size={choice.chunk_size}"]
    config = config_lib.with_overrides(loaded.config, overrides)
    parameter = next(loaded.model.parameters())
    with torch.device(parameter.device):
        model = GPT(config.model)
    model.load_state_dict(loaded.model.state_dict(), strict=True)
    loaded.config = config
    return model.to(parameter.dtype).eval()


def max_supported_length(config: config_lib.Config) -> int | None:
    """Learned absolute positions cannot go past their table; every other scheme extrapolates."""
    return config.model.max_positions if variant_of_position(config.model.position).position_table else None


class EvalOutOfMemory(RuntimeError):
    pass


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    message = str(error).lower()
    return isinstance(error, RuntimeError) and ("out of memory" in message or "can't allocate memory" in message)


def out_of_memory_advice(what: str, choice: AttentionChoice, batch_size: int) -> str:
    remedies = [f"lower --batch-size (now {batch_size})"] if batch_size > 1 else []
    if choice.backend == "chunked":
        remedies.append(f"lower --chunk-size (now {choice.chunk_size})")
    else:
        remedies.append(f"pass --attention-backend chunked with a --chunk-size (now {choice.backend})")
    remedies.append("use --dtype bf16 on a GPU, or drop the longest --windows / --passkey-lengths / "
                    "--needle-lengths")
    return f"out of memory {what}: " + "; or ".join(remedies)


# ----------------------------------------------------------------------------------------------
# The evaluation loop


@dataclass
class ModelEntry:
    name: str
    path: Path
    loaded: LoadedModel | None = None
    model: GPT | None = None
    choice: AttentionChoice | None = None
    info: dict[str, Any] = field(default_factory=dict)


class LongContextEvaluation:
    def __init__(self, settings: LongContextSettings) -> None:
        validate_settings(settings)
        self.settings = settings
        self.cache = ResultCache(settings.out_dir / "cache")
        self.documents: dict[str, EvalDocuments] = {}  # by tokenizer sha256
        self.perplexity_rows: list[dict[str, Any]] = []
        self.passkey_rows: list[dict[str, Any]] = []
        self.passkey_cases: list[dict[str, Any]] = []
        self.needle_rows: list[dict[str, Any]] = []
        self.needle_cases: list[dict[str, Any]] = []
        self.own_scalings: dict[str, RopeScalingConfig] = {}  # each model's scaling as trained, by entry name

    def log(self, message: str) -> None:
        if self.settings.progress:
            print(message, file=sys.stderr, flush=True)

    # -- models --------------------------------------------------------------------------------
    def load(self, entry: ModelEntry) -> tuple[GPT, AnyTokenizer]:
        settings = self.settings
        if entry.loaded is None:
            entry.loaded = load_model(entry.path, settings.device, DTYPES[settings.dtype], settings.overrides or None)
            entry.choice = choose_attention(entry.loaded.config, settings.attention_backend, settings.chunk_size,
                                            settings.device)
            entry.model = with_attention(entry.loaded, entry.choice)
            entry.loaded.model = entry.model  # drop the first build, if rebuilt: one copy of the weights
            self.log(f"{entry.name}: {entry.loaded.config.model.position.label}, trained on "
                     f"{entry.loaded.config.model.seq_length} tokens, from {entry.loaded.source}; "
                     f"{entry.choice.description}")
        tokenizer = model_tokenizer(settings.tokenizer, entry.loaded.tokenizer_path, entry.loaded.config.model,
                                    f"--checkpoints {entry.path}")
        assert entry.model is not None
        return entry.model, tokenizer

    def model_info(self, entry: ModelEntry) -> dict[str, Any]:
        """Scheme, training length and source of a model (loads it on first use)."""
        if not entry.info:
            self.load(entry)
            assert entry.loaded is not None
            config = entry.loaded.config
            entry.info = {"scheme": config.model.position.label, "train_length": config.model.seq_length,
                          "rotary": config.model.uses_rotary, "max_length": max_supported_length(config),
                          "source": str(entry.loaded.source)}
        return entry.info

    def fingerprint(self, entry: ModelEntry, kind: str, task: str = "") -> str:
        settings = self.settings
        common = {"checkpoint": checkpoint_fingerprint(resolve_checkpoint(entry.path)),
                  "tokenizer": settings.tokenizer, "dtype": settings.dtype, "overrides": settings.overrides}
        if kind == "ppl":
            common.update(docs=settings.ppl_docs, split=settings.split, text_field=settings.text_field,
                          strip_gutenberg=settings.strip_gutenberg, max_doc_tokens=settings.max_doc_tokens,
                          max_doc_chars=settings.max_doc_chars, max_docs=settings.max_docs, stride=settings.stride,
                          row_format=3)  # 2: rows carry bits_per_byte; 3: a --max-doc-chars text is scored whole
        elif kind == "needles":
            common.update(task=task, cases=settings.needle_cases, seed=settings.seed, depths=settings.needle_depths,
                          haystack=settings.needle_haystack, row_format=1)
            if settings.needle_haystack == "docs":
                common.update(docs=settings.ppl_docs, split=settings.split, text_field=settings.text_field,
                              strip_gutenberg=settings.strip_gutenberg, max_doc_tokens=settings.max_doc_tokens,
                              max_doc_chars=settings.max_doc_chars, max_docs=settings.max_docs)
        else:
            common.update(cases=settings.passkey_cases, seed=settings.seed)
        return fingerprint(common)

    def documents_for(self, tokenizer: AnyTokenizer) -> EvalDocuments:
        settings = self.settings
        if tokenizer.sha256 not in self.documents:
            assert settings.ppl_docs is not None
            documents = load_documents(settings.ppl_docs, tokenizer, settings.max_doc_tokens, settings.max_docs,
                                       settings.strip_gutenberg, settings.split, settings.text_field,
                                       settings.max_doc_chars)
            self.log(f"documents: {documents.summary()}")
            self.documents[tokenizer.sha256] = documents
        return self.documents[tokenizer.sha256]

    def haystack_for(self, tokenizer: AnyTokenizer) -> Haystack:
        if self.settings.needle_haystack == "docs":
            documents = self.documents_for(tokenizer)
            return DocumentHaystack([doc.tolist() for doc in documents.token_ids], f"docs:{documents.source}",
                                    tokenizer.prefix_ids)
        return NoiseHaystack(tokenizer)

    def check_needle_lengths(self, entry: ModelEntry, tokenizer: AnyTokenizer) -> None:
        """Every case must fit its length (the longest fixed part over the cases actually drawn)."""
        settings = self.settings
        builder = NeedlePromptBuilder(tokenizer, NoiseHaystack(tokenizer))
        for task in settings.needles:
            for length in settings.needle_lengths:
                specs = draw_specs(task, length, settings.needle_cases, settings.seed, settings.needle_depths)
                shortest = builder.min_length(specs)
                if length < shortest:
                    raise ValueError(f"--needle-lengths {length}: the {task} prompt without haystack is up to "
                                     f"{shortest} tokens with {entry.name}'s tokenizer")

    # -- one model -----------------------------------------------------------------------------
    def evaluate_model(self, entry: ModelEntry) -> None:
        settings = self.settings
        info = self.model_info(entry)
        if settings.needles:
            self.check_needle_lengths(entry, self.load(entry)[1])
        if settings.passkey_lengths:
            shortest = PasskeyPromptBuilder(self.load(entry)[1]).min_length()
            if min(settings.passkey_lengths) < shortest:
                raise ValueError(f"--passkey-lengths {min(settings.passkey_lengths)}: the passkey prompt without "
                                 f"filler is {shortest} tokens with {entry.name}'s tokenizer")
        ppl_key = self.fingerprint(entry, "ppl") if settings.ppl_docs is not None else ""
        passkey_key = self.fingerprint(entry, "passkey") if settings.passkey_lengths else ""
        for spec in settings.scalings:
            if spec.type != "none" and not info["rotary"]:
                self.log(f"{entry.name}: scaling {spec.name} skipped ({info['scheme']} has no rotary embedding)")
                continue
            if settings.ppl_docs is not None:
                for window in settings.windows:
                    if info["max_length"] is not None and window > info["max_length"]:
                        self.log(f"{entry.name}: window {window} skipped (learned positions end at "
                                 f"{info['max_length']})")
                        continue
                    self.perplexity_rows.append(self.cache.get_or_compute(
                        "ppl", entry.name, spec.name, window, ppl_key, lambda: self.perplexity(entry, spec, window)))
            for length in settings.passkey_lengths:
                if info["max_length"] is not None and length + NUM_NEW_TOKENS > info["max_length"]:
                    self.log(f"{entry.name}: passkey length {length} skipped (learned positions end at "
                             f"{info['max_length']})")
                    continue
                result = self.cache.get_or_compute("passkey", entry.name, spec.name, length, passkey_key,
                                                   lambda: self.passkey(entry, spec, length))
                cases = result.pop("case_records")
                self.passkey_rows.append(result)
                self.passkey_cases.extend({"model": entry.name, "scaling": spec.name, **case} for case in cases)
            self.evaluate_needles(entry, spec, info)

    def evaluate_needles(self, entry: ModelEntry, spec: ScalingSpec, info: dict[str, Any]) -> None:
        settings = self.settings
        for task in settings.needles:
            key = self.fingerprint(entry, "needles", task)
            for length in settings.needle_lengths:
                if info["max_length"] is not None and length + NEW_TOKENS[task] > info["max_length"]:
                    self.log(f"{entry.name}: {task} length {length} skipped (learned positions end at "
                             f"{info['max_length']})")
                    continue
                result = self.cache.get_or_compute(f"needles/{task}", entry.name, spec.name, length, key,
                                                   lambda: self.needles(entry, spec, task, length))
                cases = result.pop("case_records")
                self.needle_rows.append(result)
                self.needle_cases.extend({"model": entry.name, "scaling": spec.name, **case} for case in cases)

    def scaled_model(self, entry: ModelEntry, spec: ScalingSpec) -> tuple[GPT, AnyTokenizer]:
        model, tokenizer = self.load(entry)
        if model.config.uses_rotary:
            own = self.own_scalings.setdefault(entry.name, model.config.position.scaling)
            # "none" adds no scaling: a model fine-tuned with position interpolation, or imported with
            # Llama-3.1's llama3 scaling, is evaluated as it was trained
            model.set_rope_scaling(own if spec.type == "none" else spec.config())
        torch.manual_seed(self.settings.seed)
        return model, tokenizer

    @contextlib.contextmanager
    def out_of_memory_advice(self, entry: ModelEntry, what: str) -> Iterator[None]:
        """Turn an out-of-memory error into one that names the flag to change."""
        try:
            yield
        except (RuntimeError, MemoryError) as error:
            if not is_out_of_memory(error):
                raise
            assert entry.choice is not None
            raise EvalOutOfMemory(out_of_memory_advice(what, entry.choice, self.settings.batch_size)) from error

    def perplexity(self, entry: ModelEntry, spec: ScalingSpec, window: int) -> dict[str, Any]:
        settings = self.settings
        model, tokenizer = self.scaled_model(entry, spec)
        documents = self.documents_for(tokenizer)
        total = sum(num_windows(len(doc), window, settings.stride) for doc in documents.token_ids)
        bar = tqdm(total=total, desc=f"{entry.name} {spec.name} ppl L={window}", unit="win",
                   disable=not settings.progress, leave=False)
        with bar, self.out_of_memory_advice(entry, f"evaluating {entry.name} at window {window}"):
            result = sliding_window_perplexity(model, documents.token_ids, window, settings.stride,
                                               settings.batch_size, bar.update, documents.scored_bytes)
        row = {"model": entry.name, "scaling": spec.name, "window": window, "ppl": result.perplexity,
               "bits_per_byte": result.bits_per_byte, "tokens": result.num_tokens, "bytes": result.num_bytes,
               "documents": len(documents.token_ids),
               "documents_skipped": documents.num_too_short}
        self.log(f"{entry.name} {spec.name} window {window}: ppl {result.perplexity:.3f}, "
                 f"{result.bits_per_byte:.4f} bits per byte over {result.num_tokens:,} tokens, {result.num_bytes:,} bytes")
        return row

    def passkey(self, entry: ModelEntry, spec: ScalingSpec, length: int) -> dict[str, Any]:
        settings = self.settings
        model, tokenizer = self.scaled_model(entry, spec)
        bar = tqdm(total=settings.passkey_cases, desc=f"{entry.name} {spec.name} passkey {length}", unit="case",
                   disable=not settings.progress, leave=False)
        with bar, self.out_of_memory_advice(entry, f"running passkey {entry.name} at length {length}"):
            cases = run_passkey(model, tokenizer, length, settings.passkey_cases, settings.seed, settings.batch_size,
                                PasskeyPromptBuilder(tokenizer), bar.update)
        summary = summarize_cases(cases, self.model_info(entry)["train_length"])
        self.log(f"{entry.name} {spec.name} passkey {length}: accuracy {summary['accuracy']:.2f} "
                 f"({summary['cases']} cases)")
        records = [case.to_dict() for case in cases]
        return {"model": entry.name, "scaling": spec.name, "length": length, **summary, "case_records": records}

    def needles(self, entry: ModelEntry, spec: ScalingSpec, task: str, length: int) -> dict[str, Any]:
        settings = self.settings
        model, tokenizer = self.scaled_model(entry, spec)
        builder = NeedlePromptBuilder(tokenizer, self.haystack_for(tokenizer))
        bar = tqdm(total=settings.needle_cases, desc=f"{entry.name} {spec.name} {task} {length}", unit="case",
                   disable=not settings.progress, leave=False)
        with bar, self.out_of_memory_advice(entry, f"running {task} {entry.name} at length {length}"):
            cases = run_needles(model, tokenizer, task, length, settings.needle_cases, settings.seed,
                                settings.needle_depths, settings.batch_size, builder, bar.update)
        summary = summarize_needles(cases)
        self.log(f"{entry.name} {spec.name} {task} {length}: score {summary['score']:.2f} ({summary['cases']} cases)")
        records = [case.to_dict() for case in cases]
        return {"model": entry.name, "scaling": spec.name, "task": task, "length": length, **summary,
                "case_records": records}

    def effective_context_rows(self, models: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
        """One row per model x scaling with needle results (megatron_lite.eval.needles.effective_context)."""
        keys = list(dict.fromkeys((row["model"], row["scaling"]) for row in self.needle_rows))
        return [{"model": model, "scaling": scaling,
                 **effective_context([r for r in self.needle_rows if (r["model"], r["scaling"]) == (model, scaling)],
                                     models[model]["train_length"])}
                for model, scaling in keys]

    # -- all -----------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        settings = self.settings
        start = time.perf_counter()
        entries = [ModelEntry(*parse_checkpoint_arg(text)) for text in settings.checkpoints]
        names = [entry.name for entry in entries]
        if len(set(names)) != len(names):
            raise ValueError(f"--checkpoints: model names repeat ({', '.join(names)}); name them NAME=PATH")
        for entry in entries:
            self.evaluate_model(entry)
            entry.model = None  # free the weights before the next model (info and choice stay)
            if entry.loaded is not None:
                entry.loaded.model = None
        models = {entry.name: self.model_info(entry) for entry in entries}
        results = {
            "perplexity": self.perplexity_rows,
            "passkey": self.passkey_rows,
            "needles": self.needle_rows,
            "effective_context": self.effective_context_rows(models),
            "models": models,
            "settings": {key: value for key, value in asdict(settings).items()
                         if key not in ("out_dir", "progress", "device", "batch_size", "attention_backend",
                                        "chunk_size")},
        }
        results["settings"]["scalings"] = [spec.name for spec in settings.scalings]
        settings.out_dir.mkdir(parents=True, exist_ok=True)
        (settings.out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        (settings.out_dir / "passkey_cases.json").write_text(json.dumps(self.passkey_cases, indent=1) + "\n")
        if self.needle_cases:
            (settings.out_dir / "needle_cases.json").write_text(json.dumps(self.needle_cases, indent=1) + "\n")
        written = write_reports(results, self.passkey_cases, settings.out_dir)
        run_info = {"seconds": round(time.perf_counter() - start, 1), "peak_rss_mib": peak_rss_mib(),
                    "attention": {e.name: asdict(e.choice) for e in entries if e.choice is not None}}
        if torch.cuda.is_available():
            run_info["cuda_peak_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
        (settings.out_dir / "run_info.json").write_text(json.dumps(run_info, indent=2) + "\n")
        self.log(f"wrote {', '.join(str(p) for p in [settings.out_dir / 'results.json', *written])}")
        self.log(f"peak memory: {run_info['peak_rss_mib']:,.0f} MiB resident (this process)")
        return results


def peak_rss_mib() -> float:
    """Peak resident set size of this process (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def run_long_context_eval(settings: LongContextSettings) -> dict[str, Any]:
    return LongContextEvaluation(settings).run()
