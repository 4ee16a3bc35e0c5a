"""Every section of a megatron_lite config as typed dataclasses: the run config and mix files.

Each field carries its documentation in ``metadata["help"]`` (``_doc``); ``docs/config.md`` is
generated from it. Parsing, validation and overrides live in ``megatron_lite.config.loading``.
Key names follow GPT-NeoX / DeepSpeed where one exists; train.* defaults are the paper's
(arXiv 2309.08646 section 4).
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

SchemeName = Literal["none", "learned", "sinusoidal", "alibi", "rope", "coca"]
CocaConstraint = Literal["slack", "strict"]
ScalingType = Literal["none", "linear", "ntk", "dynamic", "yarn", "llama3"]
Architecture = Literal["gpt_neox", "llama"]
AttentionBackend = Literal["sdpa", "flash", "flex", "chunked", "reference"]
SourceType = Literal["hf", "jsonl", "text", "parquet", "python_docs", "python_code", "megatron"]
TextEncoding = Literal["utf-8", "auto"]
CompileMode = Literal["regional", "whole"]  # megatron_lite.model.compile.COMPILE_MODES
LossGemm = Literal["mixed", "input_dtype", "fp32"]  # megatron_lite.model.loss.LOSS_GEMMS
Float8Choice = Literal["none", "lm_head", "mlp", "all"]  # megatron_lite.model.float8.FLOAT8_CHOICES
GradAccumDtype = Literal["fp32", "model"]  # megatron_lite.training.deepspeed_config

SCHEMES: tuple[str, ...] = typing.get_args(SchemeName)
ROTARY_SCHEMES: tuple[str, ...] = ("rope", "coca")
CONSTRAINTS: tuple[str, ...] = typing.get_args(CocaConstraint)
SCALING_TYPES: tuple[str, ...] = tuple(kind for kind in typing.get_args(ScalingType) if kind != "none")
BACKENDS: tuple[str, ...] = typing.get_args(AttentionBackend)
ARCHITECTURES: tuple[str, ...] = typing.get_args(Architecture)
SCHEME_DISPLAY_NAMES = {"alibi": "ALiBi", "rope": "RoPE", "coca": "CoCA"}  # the rest as written


# Where docs/config.md lists a key (``_doc(section=...)``; a section's keys inherit it): the keys a user sets, the
# experimental ones (measured not to help, or not measured; kept so that configs naming them still load) and the
# hooks the tests use to make failures happen.
USER_KEYS, EXPERIMENTAL, TEST_HOOKS = "user", "experimental", "test hooks"
# where help links to measured figures (relative to docs/config.md)
PERFORMANCE = "performance.md"
INPUT_DTYPE_FIGURES = "../benchmarks/runs/2026-11-26_quick-check_h200/gpu_check.md"


def _doc(help_text: str, section: str = USER_KEYS, experimental_values: dict[str, str] | None = None,
         **kwargs: Any) -> Any:
    """A dataclass field with its documentation attached, the part of docs/config.md it is listed in, and the
    values of it that docs/config.md lists as experimental (value -> why, one line)."""
    metadata = {"help": help_text, "section": section, "experimental_values": experimental_values or {}}
    return field(metadata=metadata, **kwargs)


# ----------------------------------------------------------------------------------------------
# Run config: model.*, data.*


@dataclass
class RopeScalingConfig:
    """Inference-time context extension for rotary schemes (rope and both CoCA variants)."""

    type: ScalingType = _doc(
        "RoPE scaling: none | linear (position interpolation) | ntk (static NTK-aware base) | dynamic (HF "
        "dynamic-NTK: base grows with the sequence length beyond the training length) | yarn (NTK-by-parts + "
        "attention temperature) | llama3 (Llama-3.1: low frequencies divided by factor, high ones kept, a smooth "
        "blend between).", default="none")
    factor: float = _doc("Scaling factor (>= 1). Ignored when type is none.", default=1.0)
    original_max_position_embeddings: int | None = _doc(
        "Training context length the scaling is relative to; null means model.seq_length.",
        default=None,
    )
    beta_fast: float = _doc("YaRN: rotations above which dims are extrapolated (HF default 32).", default=32.0)
    beta_slow: float = _doc("YaRN: rotations below which dims are interpolated (HF default 1).", default=1.0)
    attention_factor: float | None = _doc(
        "YaRN: the factor multiplying cos and sin (HF attention_factor); null means 0.1 ln(factor) + 1, HF's default.",
        default=None)
    truncate: bool = _doc(
        "YaRN: round the correction range to whole dims (floor/ceil) before the ramp, as HF does by default; false "
        "keeps the fractional range (HF truncate: false, e.g. gpt-oss).", default=True)
    low_freq_factor: float = _doc(
        "llama3: wavelengths above original_max_position_embeddings / this are divided by factor (Llama-3.1: 1).",
        default=1.0)
    high_freq_factor: float = _doc(
        "llama3: wavelengths below original_max_position_embeddings / this are kept (Llama-3.1: 4).", default=4.0)


@dataclass
class PositionConfig:
    """How positions enter the model; one interface for every scheme (docs/design.md)."""

    scheme: SchemeName = _doc(
        "Position scheme: none | learned (absolute table) | sinusoidal | alibi (Press et al.) | "
        "rope (rotary, GPT-NeoX layout) | coca (RoPE + collinear constrained attention).",
        default="rope",
    )
    rotary_pct: float = _doc(
        "Fraction of each head's dims that are rotated (GPT-NeoX rotary_pct); rope and coca only.",
        default=1.0,
    )
    rotary_emb_base: float = _doc("Rotary base theta (GPT-NeoX rotary_emb_base).", default=10000.0)
    constraint: CocaConstraint = _doc(
        "CoCA only: slack (paper Eq. 11, the paper's default) or strict (Eq. 10, exact collinearity).",
        default="slack",
    )
    scaling: RopeScalingConfig = _doc(
        "RoPE scaling applied at inference (rope and coca); see model.position.scaling.*.",
        default_factory=RopeScalingConfig,
    )

    @property
    def is_rotary(self) -> bool:
        """Whether the scheme rotates queries and keys (and so takes RoPE scalings)."""
        return self.scheme in ROTARY_SCHEMES

    @property
    def label(self) -> str:
        """How logs, result files and CLIs name the scheme: 'rope', 'coca slack', 'alibi', ..."""
        return f"{self.scheme} {self.constraint}" if self.scheme == "coca" else self.scheme

    @property
    def display_name(self) -> str:
        """The paper's spelling, for report tables: 'RoPE', 'CoCA (slack)', 'ALiBi', ..."""
        name = SCHEME_DISPLAY_NAMES.get(self.scheme, self.scheme)
        return f"{name} ({self.constraint})" if self.scheme == "coca" else name


@dataclass
class AttentionConfig:
    """Which attention kernel runs; independent of the position scheme."""

    backend: AttentionBackend = _doc(
        "Kernel: sdpa (torch scaled_dot_product_attention; FlashAttention on GPU) | flash "
        "(flash-attn package, CUDA) | flex (torch FlexAttention, torch >= 2.5: every scheme, ALiBi as a "
        "score_mod, block-sparse causal and document masks) | chunked (query blocks, O(chunk * N) memory, "
        "any scheme incl. ALiBi) | reference (materialised scores exactly as the paper computes them; slow, "
        "for tests).",
        default="sdpa",
    )
    chunk_size: int = _doc("Query block size of the chunked backend.", default=1024)
    document_mask: bool = _doc(
        "Within a packed window a token attends only to its own document (documents end at eod_token_id; "
        "positions still run on across them). Off as in the paper; backends flex and reference only.",
        default=False,
    )
    eod_token_id: int = _doc(
        "Token id that ends a document (document_mask); our SentencePiece tokenizer's EOD is 0. With another "
        "tokenizer set its EOD id (a Hugging Face tokenizer's EOS): training and generation refuse a mismatch "
        "when document_mask is on.", default=0)


@dataclass
class ModelConfig:
    """The network: GPT-NeoX (default) or LLaMA family; key names follow GPT-NeoX's where one exists."""

    architecture: Architecture = _doc(
        "Block family: gpt_neox (LayerNorm, fused per-head QKV with biases, GELU MLP, parallel residual as "
        "gpt_j_residual says; Pythia) | llama (RMSNorm, separate q/k/v/o projections without biases (q/k/v "
        "biases with qkv_bias, as Qwen2), grouped-query attention, SwiGLU MLP, sequential residual; LLaMA, "
        "Mistral, Qwen2). Every position scheme works with both.", default="gpt_neox")
    num_layers: int = _doc("Number of transformer blocks.", default=24)
    hidden_size: int = _doc("Model width.", default=1024)
    num_attention_heads: int = _doc("Attention (query) heads.", default=16)
    num_key_value_heads: int | None = _doc(
        "Key/value heads (grouped-query attention: each serves num_attention_heads / this query heads; CoCA's T "
        "comes per key/value head); null means num_attention_heads. llama only.", default=None)
    kv_channels: int | None = _doc(
        "Per-head dim (HF head_dim); null means hidden_size / num_attention_heads. Set explicitly for models "
        "whose heads * head_dim != hidden_size. llama only.", default=None)
    qkv_bias: bool = _doc("llama only: biases on the q/k/v projections (Qwen2); gpt_neox always has biases.",
                          default=False)
    intermediate_size: int | None = _doc("MLP width; null means 4 * hidden_size.", default=None)
    seq_length: int = _doc("Training context length in tokens.", default=512)
    max_position_embeddings: int | None = _doc(
        "Largest position a learned table covers and the value exported to HF; null means seq_length.",
        default=None,
    )
    vocab_size: int = _doc("Tokenizer vocabulary size (before padding).", default=50000)
    make_vocab_size_divisible_by: int = _doc(
        "Pad the embedding/LM-head rows to a multiple of this (GPT-NeoX default 128).", default=128
    )
    gpt_j_residual: bool = _doc(
        "gpt_neox only: parallel residual x + attn(ln1(x)) + mlp(ln2(x)) (GPT-NeoX/HF use_parallel_residual).",
        default=True,
    )
    norm: Literal["layernorm"] = _doc("gpt_neox normalisation layer (llama: always RMSNorm).", default="layernorm")
    layernorm_epsilon: float = _doc("LayerNorm / RMSNorm epsilon (HF layer_norm_eps / rms_norm_eps).", default=1e-5)
    activation: Literal["gelu", "gelu_tanh", "relu"] = _doc(
        "gpt_neox MLP activation (gelu is the exact erf form, as GPT-NeoX and HF 'gelu'); llama's MLP is always "
        "SwiGLU: down(silu(gate(x)) * up(x)).", default="gelu"
    )
    no_weight_tying: bool = _doc("Untied input embedding and LM head (paper: untied).", default=True)
    init_method: Literal["small_init", "normal"] = _doc(
        "Init of input-side weights: small_init = N(0, sqrt(2 / (5 * hidden))) (GPT-NeoX), "
        "normal = N(0, init_method_std).",
        default="small_init",
    )
    output_layer_init_method: Literal["wang_init", "small_init", "normal"] = _doc(
        "Init of the residual-output projections (attention.dense, mlp.dense_4h_to_h; llama: o_proj, down_proj): "
        "wang_init = N(0, 2 / (num_layers * sqrt(hidden))) (GPT-NeoX).",
        default="wang_init",
    )
    init_method_std: float = _doc("Std of the 'normal' init method.", default=0.02)
    attention_dropout: float = _doc("Dropout on attention probabilities (training only).", default=0.0)
    hidden_dropout: float = _doc("Dropout on attention and MLP outputs (training only).", default=0.0)
    checkpoint_activations: bool = _doc(
        "Recompute each block in the backward pass (activation checkpointing).", default=False
    )
    position: PositionConfig = _doc("Position scheme; see model.position.*.", default_factory=PositionConfig)
    attention: AttentionConfig = _doc("Attention kernel; see model.attention.*.", default_factory=AttentionConfig)

    @property
    def head_dim(self) -> int:
        return self.kv_channels if self.kv_channels is not None else self.hidden_size // self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads if self.num_key_value_heads is not None else self.num_attention_heads

    @property
    def is_llama(self) -> bool:
        return self.architecture == "llama"

    @property
    def ffn_size(self) -> int:
        return self.intermediate_size if self.intermediate_size is not None else 4 * self.hidden_size

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings if self.max_position_embeddings is not None else self.seq_length

    @property
    def padded_vocab_size(self) -> int:
        multiple = self.make_vocab_size_divisible_by
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    @property
    def rotary_dims(self) -> int:
        return int(self.head_dim * self.position.rotary_pct)

    @property
    def uses_rotary(self) -> bool:
        return self.position.is_rotary

    @property
    def rotary_train_length(self) -> int:
        """The length RoPE scalings are relative to: scaling.original_max_position_embeddings or seq_length."""
        return self.position.scaling.original_max_position_embeddings or self.seq_length


@dataclass
class TokenizerConfig:
    """The tokenizer: an existing one (SentencePiece or Hugging Face), or a SentencePiece BPE trained from the mix."""

    model: str | None = _doc(
        "Existing tokenizer: a SentencePiece .model, a Hugging Face tokenizer.json, or a directory holding one "
        "(its tokenizer_config.json names the EOS, which ends documents; each document gets the specials its "
        "post-processor adds, e.g. Llama's BOS; its vocabulary must be <= model.vocab_size). null trains a "
        "SentencePiece model from the mix into data.cache_dir.", default=None)
    bos_token_id: int | None = _doc(
        "BOS id of a model that has no tokenizer file (read from an imported HF config.json / "
        "generation_config.json, written back on export); a tokenizer's own ids win. All three null: "
        "megatron_lite's fixed ids (bos = eos = 0, pad = 1).", default=None)
    eos_token_id: int | list[int] | None = _doc(
        "EOS id (or ids) of a model that has no tokenizer file; see bos_token_id.", default=None)
    pad_token_id: int | None = _doc("PAD id of a model that has no tokenizer file; see bos_token_id.", default=None)
    sample_chars: int = _doc(
        "Characters drawn from the mix, in its group proportions, to train the tokenizer.", default=20_000_000
    )


@dataclass
class DataConfig:
    """Where training tokens come from: a mix file of sources, tokenised once into cached shards."""

    mix: str = _doc(
        "Mix file (configs/data/*.yml) declaring groups, group weights and sources; relative paths "
        "are taken from the working directory.",
        default="configs/data/sample_mix.yml",
    )
    cache_dir: str = _doc(
        "Directory for the tokenizer, MMIDIDX shards, manifest and cached sample order (reused across runs).",
        default="data/cache/sample",
    )
    tokenizer: TokenizerConfig = _doc("Tokenizer; see data.tokenizer.*.", default_factory=TokenizerConfig)
    validation_fraction: float = _doc(
        "Fraction of each source's documents held out for validation (split by document, no leakage).",
        default=0.01,
    )
    num_workers: int = _doc("Tokenisation worker processes.", default=2)
    seed: int = _doc("Seed of the validation split and the sample order.", default=1234)
    eval_texts: list[str] = _doc(
        "Evaluation texts kept out of training, as train.extrapolation_eval.books names books (a .txt directory, a "
        "file, a datasets id). Training documents that overlap one are dropped and counted when the data is built "
        "(docs/data.md); a path that does not exist is reported; [] checks nothing.",
        default_factory=lambda: ["data/eval"])


# ----------------------------------------------------------------------------------------------
# Run config: train.*


@dataclass
class WandbConfig:
    """Weights & Biases logging; never prompts, never blocks."""

    mode: Literal["online", "offline", "disabled"] = _doc(
        "online (needs WANDB_API_KEY or `wandb login`; falls back to offline with a warning when there "
        "is none) | offline (files under <run-dir>/wandb, `wandb sync` later) | disabled.",
        default="offline",
    )
    project: str = _doc("wandb project.", default="megatron_lite")
    entity: str | None = _doc("wandb entity (team or user); null means your default.", default=None)
    name: str | None = _doc("Run name; null means the run directory's name.", default=None)
    tags: list[str] = _doc("Run tags.", default_factory=list)


@dataclass
class FaultInjectionConfig:
    """Test hooks that make failures happen on purpose (used by the robustness tests)."""

    nonfinite_loss_steps: list[int] = _doc(
        "Steps (1-based) whose loss is replaced by NaN on every rank, to exercise the skip logic.",
        default_factory=list,
    )
    kill_during_save_step: int | None = _doc(
        "SIGKILL this process after the DeepSpeed files of this step's checkpoint are written and before "
        "it is marked complete (simulates a crash mid-save).", default=None)
    fail_save_step: int | None = _doc(
        "Raise OSError while saving this step's checkpoint (simulates a full disk).", default=None)
    sigterm_during_evaluation_step: int | None = _doc(
        "Send rank 0 SIGTERM as the first batch of this step's evaluation (validation, or else the "
        "extrapolation evaluation) starts, also where a resumed run redoes that evaluation: a scheduler's stop "
        "arriving mid-evaluation; the other ranks learn of it from the ranks' agreement.", default=None)
    kill_after_step: int | None = _doc(
        "SIGKILL this process right after this optimizer step (1-based) is taken and logged, before any "
        "checkpoint of it (simulates a crash mid-training).", default=None)
    disk_full_save_steps: list[int] = _doc(
        "Steps whose checkpoint is written under a file-size limit of disk_full_bytes (RLIMIT_FSIZE, SIGXFSZ "
        "ignored) on every rank (or disk_full_rank): the kernel fails the writes past it, as on a full disk; "
        "restored after the save.",
        default_factory=list,
    )
    disk_full_bytes: int = _doc("The file-size limit of disk_full_save_steps, in bytes.", default=0)
    disk_full_rank: int | None = _doc(
        "Apply the disk_full_save_steps limit on this rank only; null = every rank.", default=None)
    disk_full_after_agreement: bool = _doc(
        "Apply the disk_full_save_steps limit only to rank 0's writes after all ranks agreed their files are "
        "written (config.yml, tokenizer, MANIFEST.json, COMPLETE, latest) instead of to the checkpoint files.",
        default=False)


@dataclass
class ExtrapolationEvalConfig:
    """Long-context perplexity while training (``train.extrapolation_eval.*``): every ``interval`` steps the model
    reads the same held-out tokens through windows of 1x, 2x, 4x ... its training length, so the curve of
    ppl(kx) / ppl(1x) against tokens seen shows when (and whether) extrapolation breaks (docs/training.md)."""

    interval: int = _doc(
        "Steps between evaluations (and one at the last step); 0 turns the evaluation off.", default=0)
    at_start: bool = _doc("Also evaluate before the first step of a fresh run (the curve's point at 0 tokens).",
                          default=True)
    books: str = _doc(
        "Held-out books: a directory of .txt files, one .txt file, parquet, or a datasets id ID[:SPLIT[:COLUMN]] "
        "(the repository ships two PG-19 test books in data/eval). Keep them out of the training mix.",
        default="data/eval")
    max_books: int = _doc("Books used (the first ones long enough, in the source's order).", default=2)
    strip_gutenberg: bool = _doc("Strip Project Gutenberg headers and footers from the books.", default=True)
    windows: list[int] = _doc(
        "Window lengths as multiples of model.seq_length; 1 must be among them (every ratio is against it).",
        default_factory=lambda: [1, 2, 4, 8])
    scored_tokens_per_book: int = _doc(
        "Tokens scored per book at every window, rounded down to a multiple of model.seq_length (one at least): the "
        "same tokens at every window and every evaluation, each window scoring its last seq_length predictions.",
        default=4096)
    scalings: list[str] = _doc(
        "Inference-time RoPE scalings evaluated besides the model's own (e.g. dynamic:4, the paper's dynamic NTK; "
        "rotary schemes only, others skip them).", default_factory=list)
    batch_size: int = _doc("Windows per forward.", default=1)
    max_seconds: float = _doc(
        "The evaluation's budget: an evaluation that takes longer warns once, naming the keys that shrink it.",
        default=60.0)


@dataclass
class ProfileConfig:
    """``torch.profiler`` over a few training steps (``train.profile.*``), as GPT-NeoX's ``profile`` and
    torchtitan's ``[profiling]``: a trace for Perfetto / chrome://tracing and a table of where the time went."""

    start_step: int = _doc(
        "First profiled optimizer step (1-based); 0 turns the profiler off. Pick a step after the first (which "
        "holds the compile) and away from evaluations and saves.", default=0)
    steps: int = _doc("Optimizer steps profiled, from start_step on (each with all its micro batches).", default=2)
    ranks: list[int] = _doc("Global ranks that profile (each writes its own files).", default_factory=lambda: [0])
    record_shapes: bool = _doc(
        "Record operator input shapes (larger trace, more profiler overhead) and write two more tables: the "
        "operators split by input shapes, twice row_limit rows (steps_..._shapes.txt), and the GEMMs by shape with "
        "the TFLOP/s each ran at (steps_..._gemms.txt).", default=False)
    row_limit: int = _doc("Operators listed in the table.", default=40)


@dataclass
class StageConfig:
    """One stage of a staged fine-tune (``train.stages``): which parameters train, for how many steps."""

    steps: int = _doc("Optimizer steps of this stage (must be positive).", default=0)
    trainable: list[str] = _doc(
        "Parameters that train in this stage (the others are frozen: no update, weight decay or optimizer state): "
        "fnmatch globs over parameter names (`*` also crosses dots), e.g. `layers.*.mlp.*`, `*.k_proj.*`, `*`; or "
        "a fused-QKV slot `<module glob>.query_key_value[k]`, k = 0 (q), 1 (k, CoCA's t), 2 (v): those rows of "
        "every head (docs/finetuning.md). A pattern matching no parameter is an error.", default_factory=list)
    lr: float | None = _doc("Peak learning rate of this stage; null means train.lr.", default=None)


@dataclass
class TrainConfig:
    """Optimisation and run management (``train.*``)."""

    init_from: str | None = _doc(
        "Start from these weights (a run, step or consolidated dir, e.g. tools/convert_checkpoint.py --to "
        "megatron_lite output); optimizer, step and data position start fresh. Ignored when resuming.",
        default=None,
    )
    allow_tokenizer_change: bool = _doc(
        "Resume, or start from train.init_from, with a tokenizer (sha256) other than the checkpoint's: without "
        "this the run stops naming both files; with it the run trains on, and metrics.jsonl records the change.",
        default=False,
    )
    train_iters: int | None = _doc(
        "Optimizer steps; null means derived from train_epochs over the data mix.", default=None
    )
    train_epochs: float = _doc(
        "Passes over the mix's training tokens when train_iters is null (paper: 2): the run draws train_epochs x "
        "the tokens the mix holds for training. A source's own passes (train.py prints them at the start) equal it "
        "when every group holds its weight's share of the tokens (docs/data_loading.md, epochs and passes).",
        default=2.0
    )
    train_batch_size: int | None = _doc(
        "Global batch in samples (= micro batch x gradient accumulation x data-parallel ranks), the same on "
        "any number of GPUs; null means micro batch x ranks (accumulation 1) unless accumulation is set.",
        default=None,
    )
    train_micro_batch_size_per_gpu: int = _doc("Samples per rank per forward/backward.", default=16)
    gradient_accumulation_steps: int | None = _doc(
        "Micro batches per rank per optimizer step; null derives it at start-up as train_batch_size / (micro "
        "batch x data-parallel ranks) (an error naming the micro batch sizes that work if it does not divide). "
        "Set, it must multiply out to train_batch_size on the ranks launched.", default=None
    )
    zero_stage: int = _doc("DeepSpeed ZeRO stage 0-3.", default=0)
    grad_accum_dtype: GradAccumDtype = _doc(
        "bf16 runs: the dtype micro batches' gradients are summed and all-reduced in. fp32 (as Megatron-LM): "
        "DeepSpeed's grad_accum_dtype and communication_data_type float32 (ZeRO 1: one add_ per parameter group "
        "into a float32 buffer; ZeRO 2-3: float32 partitions; ZeRO 0: only the all-reduce) | model: DeepSpeed's "
        "default, bf16 sums, less exact (docs/training.md). Unused by fp32 and fp16 runs.", default="fp32")
    sequence_parallel_size: int = _doc(
        "DeepSpeed-Ulysses sequence parallelism: P ranks share each sample, each holding seq_length / P "
        "consecutive tokens, with an all-to-all around attention (docs/sequence_parallel.md). The launched ranks "
        "are data-parallel ranks x P; P must divide them, model.seq_length and the attention heads.", default=1)
    compile: bool | None = _doc(
        "torch.compile the model in place as train.compile_mode says (state-dict keys unchanged, so checkpoints "
        "move freely between compiled and eager runs); null: on with CUDA, off on CPU. Not with zero_stage 3.",
        default=None,
    )
    compile_mode: CompileMode = _doc(
        "What train.compile compiles: regional (each transformer block in place, and the LM head with its fused "
        "loss; the blocks share one code object, so the first step's compile time does not grow with the depth) | "
        "whole (embedding, blocks and head as one graph: fuses across blocks, at a compile time that grows with "
        "the number of layers).",
        default="regional")
    compile_blocks_per_region: int = _doc(
        "Regional compile: this many consecutive blocks as one compiled region (must divide model.num_layers): "
        "fewer region calls for the host, a longer first compile. Experimental: groups of 4 helped an H200 only "
        f"without CUDA graphs, and stayed below the default graphs ([figures]({PERFORMANCE})).",
        section=EXPERIMENTAL, default=1)
    cuda_graphs: bool | None = _doc(
        "CUDA graphs (torch.compile's reduce-overhead mode): compiled kernels replay from one launch, for a GPU "
        f"that waits on the host ([figures]({PERFORMANCE})). Needs train.compile on CUDA; several micro "
        "batches per step need bf16, zero_stage 1, grad_accum_dtype fp32. null: on in that setup at a regional "
        "compile, without sequence parallelism or activation checkpointing.",
        default=None)
    compile_cpp_wrapper: bool = _doc(
        "inductor's C++ wrapper (torch._inductor.config.cpp_wrapper): the compiled graphs' kernels launched from "
        "generated C++ instead of Python, at a longer first step. Needs train.compile; keeps train.cuda_graphs' "
        "null default off. Experimental: not measured on a GPU, where CUDA graphs remove the same launch cost "
        f"([figures]({PERFORMANCE})).",
        section=EXPERIMENTAL, default=False)
    compile_options: dict[str, Any] = _doc(
        "Passthrough: inductor settings for the compiled graphs (torch.compile's options), torch._inductor.config "
        "names nested or dotted (e.g. {triton: {mix_order_reduction: false}}); not triton.cudagraphs or "
        "cpp_wrapper. Needs train.compile. Experimental: the settings tried stayed below the default CUDA graphs "
        f"([figures]({PERFORMANCE})).",
        section=EXPERIMENTAL, default_factory=dict)
    tf32: bool | None = _doc(
        "TensorFloat-32 tensor cores for float32 matmuls and cuDNN convolutions "
        "(torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32), set before the model is "
        "built, as torchtitan and llm-foundry do. Touches float32 GEMMs only (the bf16/fp16 ones are on tensor "
        "cores anyway). null: on with CUDA, off on CPU; false keeps torch's default (full float32 matmuls).",
        default=None)
    fused_optimizer: bool | None = _doc(
        "torch's fused AdamW (fused=True: the whole update in one kernel per device and dtype, instead of "
        "several foreach kernels); needs every trainable parameter a floating-point tensor on a device torch "
        "fuses for. null: on when every parameter is a floating CUDA tensor, else off (CPU runs stay unfused); "
        "true: fused wherever torch allows it (CPU too), an error where it does not.", default=None)
    fused_loss: bool = _doc(
        "LM head + cross entropy in token chunks, its gradients computed in the same pass: the (B, T, V) float32 "
        "logits never exist at once. Same loss and gradients as the plain path.", default=True,
    )
    loss_gemm: LossGemm = _doc(
        "The fused loss head's GEMMs (logits, grad_hidden, grad_weight): mixed (operands in the model's dtype, "
        "float32 accumulation and float32 logits) | input_dtype (bf16 logits upcast per chunk, as Hugging Face) "
        "| fp32 (float32 operands). A float32 model runs float32 GEMMs in every mode. input_dtype and fp32 are "
        "experimental (below).", default="mixed", experimental_values={
            "input_dtype": f"bf16 logits: a slower step than mixed on an H200 ([figures]({INPUT_DTYPE_FIGURES})).",
            "fp32": f"float32 operands, off the bf16 tensor cores: a 5x slower head ([figures]({PERFORMANCE})).",
        })
    fp8: Float8Choice = _doc(
        "FP8 GEMMs through torchao, tensorwise scaling (docs/float8.md): none | lm_head (the fused loss head's "
        "GEMMs; needs train.fused_loss) | mlp (the blocks' MLP linears) | all (every block linear and the head). "
        "Attention stays in the model's dtype. Needs a CUDA GPU of compute capability 8.9+ and the fp8 extra; "
        "elsewhere the run stops in one line. Default none: not measured with CoCA on a GPU yet.", default="none")
    lr: float = _doc("Peak learning rate, reached at the end of warm-up (paper: 1e-4).", default=1.0e-4)
    min_lr: float = _doc("Learning rate at the last step (paper: 1e-5).", default=1.0e-5)
    warmup: float = _doc("Warm-up length as a fraction of train_iters (paper: 0.01).", default=0.01)
    warmup_start_lr: float = _doc("Learning rate at step 0 (paper: 1e-7).", default=1.0e-7)
    lr_decay_style: Literal["linear", "cosine", "constant"] = _doc(
        "Decay from lr to min_lr after warm-up (paper: linear).", default="linear"
    )
    adam_beta1: float = _doc("AdamW beta1 (paper: 0.9).", default=0.9)
    adam_beta2: float = _doc("AdamW beta2 (paper: 0.95).", default=0.95)
    adam_eps: float = _doc("AdamW epsilon.", default=1.0e-8)
    weight_decay: float = _doc(
        "Decoupled weight decay on >= 2-D weights (matmuls, embeddings); biases and LayerNorm get none.",
        default=0.1,
    )
    gradient_clipping: float = _doc("Clip the global gradient norm to this; 0 disables.", default=1.0)
    initial_loss_scale_power: int = _doc("fp16 only: dynamic loss scaling starts at 2**this.", default=16)
    log_interval: int = _doc(
        "Steps between console/metrics.jsonl/wandb rows; the loss reported everywhere (bar, log, summary) is "
        "the mean over the last this-many steps.",
        default=10,
    )
    eval_interval: int = _doc("Steps between validation runs (and one at the end); 0 disables.", default=1000)
    eval_iters: int = _doc(
        "Validation set size in micro batches: each validation run scores the same eval_iters x "
        "train_micro_batch_size_per_gpu samples, split over the data-parallel ranks, so val_loss is the same "
        "number on any GPU count.", default=10)
    record_sample_indices: bool = _doc(
        "Append each optimizer step's global sample indices (gathered over the data-parallel ranks, sorted) to "
        "<run dir>/sample_indices.jsonl: which samples a step trained on, comparable across GPU counts and "
        "resumes.", default=False)
    save_interval: int = _doc("Steps between checkpoints (and one at the end); 0 saves only at the end.", default=1000)
    save_final: bool = _doc(
        "Save a checkpoint after the final step. false: a benchmark or a throwaway run that nobody resumes writes "
        "nothing at its end (the 350M model's final save: several GB, ~11 s on an H200); train.save_interval's "
        "checkpoints, a stage's last step and a requested stop (a signal, train.exit_interval) still save.",
        default=True)
    keep_last_checkpoints: int = _doc("Complete checkpoints kept; older ones are deleted.", default=3)
    async_save: bool = _doc(
        "Write train.save_interval's checkpoints in the background: the step loop waits only while the states are "
        "copied to host memory (one more copy of them while the write runs); complete, and logged as saved, at a "
        "later step. The final, a stop's and a stage's last save are written at once (docs/checkpoints.md).",
        default=False)
    exit_interval: int | None = _doc(
        "Save a checkpoint and exit when the step is a multiple of this (Megatron's --exit-interval); "
        "for time-limited jobs that resubmit themselves with --resume auto.",
        default=None,
    )
    max_consecutive_nonfinite: int = _doc(
        "Stop after this many optimizer steps in a row whose loss was NaN/inf (each is skipped).", default=5
    )
    max_consecutive_failed_saves: int = _doc(
        "Stop (exit code 4) after this many checkpoint saves in a row failed on some rank (each is removed and "
        "training goes on with the previous checkpoint as the latest).", default=3
    )
    peak_tflops: float | None = _doc(
        "Peak TFLOP/s per device for the MFU column; null means known GPUs' bf16/fp16 peaks, else no MFU.",
        default=None,
    )
    num_workers: int = _doc("DataLoader worker processes per rank.", default=1)
    wandb: WandbConfig = _doc("Weights & Biases; see train.wandb.*.", default_factory=WandbConfig)
    deepspeed: dict[str, Any] = _doc(
        "Passthrough: merged last into the generated DeepSpeed config (any DeepSpeed key).", default_factory=dict
    )
    extrapolation_eval: ExtrapolationEvalConfig = _doc(
        "Long-context perplexity while training; see train.extrapolation_eval.* (off by default).",
        default_factory=ExtrapolationEvalConfig)
    profile: ProfileConfig = _doc(
        "torch.profiler over a few steps into <run dir>/profile/; see train.profile.* (off by default).",
        default_factory=ProfileConfig)
    fault_injection: FaultInjectionConfig = _doc(
        "Deliberate failures for tests; see train.fault_injection.*.", section=TEST_HOOKS,
        default_factory=FaultInjectionConfig
    )
    stages: list[StageConfig] = _doc(
        "Staged fine-tuning: a list of {steps, trainable, lr} run in order (see train.stages[].*); the run's "
        "steps are their sum (train.train_iters null or equal to it). Each stage starts from the previous "
        "stage's weights with a new DeepSpeed engine and fresh optimizer state over its trainable parameters "
        "only. Empty: one stage, everything trains.", default_factory=list)
    stage_schedule: Literal["per_stage", "across"] = _doc(
        "With train.stages: per_stage restarts warm-up and decay in each stage over its own steps (the CoCA "
        "paper's fine-tune); across runs one schedule over all stages (each stage's lr as its peak).",
        default="per_stage")


# ----------------------------------------------------------------------------------------------
# Run config: top level


@dataclass
class Config:
    """Top level of a megatron_lite YAML file."""

    model: ModelConfig = _doc("Model architecture; see model.*.", default_factory=ModelConfig)
    data: DataConfig = _doc("Training data; see data.*.", default_factory=DataConfig)
    train: TrainConfig = _doc("Optimisation, logging and checkpoints; see train.*.", default_factory=TrainConfig)
    precision: Literal["fp32", "bf16", "fp16"] = _doc(
        "Parameter/compute dtype (GPT-NeoX precision).", default="fp32"
    )
    seed: int = _doc("Random seed for initialisation and sampling.", default=1234)


# ----------------------------------------------------------------------------------------------
# Mix files (configs/data/*.yml)


@dataclass
class SourceConfig:
    """One source of documents in a mix file."""

    type: SourceType = _doc(
        "hf: a datasets hub id or local dataset dir; jsonl: JSON-lines files; text: .txt files or directories "
        "(one document per file); parquet: parquet files; python_docs / python_code: the built-in offline sample "
        "(English prose / Python's stdlib sources); megatron: existing MMIDIDX shards (.bin/.idx), read in place "
        "without re-tokenising (the text settings below do not apply; max_documents is refused)."
    )
    path: str | None = _doc(
        "Hub id, or a local file, directory or glob. megatron: a shard prefix (without .bin/.idx), a directory "
        "(every *.idx below it, with its .bin) or a glob of .bin/.idx files or prefixes.", default=None)
    name: str | None = _doc("HF dataset configuration name (e.g. 20231101.en).", default=None)
    split: str = _doc("HF split.", default="train")
    data_files: str | None = _doc("HF data_files pattern (a subset of a hub dataset's files).", default=None)
    streaming: bool = _doc("Stream from the hub instead of downloading the whole dataset first.", default=False)
    text_field: str = _doc("Record field holding the document text (hf, jsonl, parquet).", default="text")
    weight: float | None = _doc("Token weight inside the group; null = natural token proportion.", default=None)
    max_documents: int | None = _doc("Read at most this many documents (samples a huge source).", default=None)
    strip_gutenberg: bool = _doc("Strip Project Gutenberg headers/footers (*** START/END OF ... ***).", default=False)
    normalize_newlines: bool = _doc("Convert CRLF/CR line ends to LF.", default=True)
    min_chars: int = _doc("Drop (and count) documents shorter than this after cleaning.", default=1)
    deduplicate: bool = _doc("Drop (and count) exact duplicate documents within the source.", default=True)
    tokenizer: str | None = _doc(
        "megatron: the tokenizer the shards were tokenised with (SentencePiece .model, tokenizer.json or a "
        "directory holding one); must be the run's data.tokenizer.model (the same bytes).", default=None)
    encoding: TextEncoding = _doc(
        "text: how files are decoded. utf-8: invalid UTF-8 is a bad record (non_utf8, skipped and counted); "
        "auto: UTF-8 when valid, else the charset a Project Gutenberg header declares (\"Character set "
        "encoding: ISO-8859-1\"; ISO-8859-1 is read as its superset cp1252, as browsers do), else cp1252, "
        "else latin-1 (never fails). Other types read UTF-8 only.", default="utf-8")


@dataclass
class GroupConfig:
    """A group of sources sharing one token weight."""

    weight: float = _doc("Share of training tokens (group weights are normalised to sum to 1).")
    sources: dict[str, SourceConfig] = _doc("Named sources of this group.")


@dataclass
class MixConfig:
    """Top level of a mix file (configs/data/*.yml, named by data.mix)."""

    groups: dict[str, GroupConfig] = _doc("Named groups (e.g. text, code).")
    description: str = _doc("Free text shown by inspect tools.", default="")
