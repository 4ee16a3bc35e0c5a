"""Attention diagnostics of a checkpoint on real text (docs/diagnostics.md).

Per layer x head x length, for sampled query rows m against every visible key n <= m:

* rotary schemes only: the initial angle Theta_j of every rotary pair j (paper section 2.2), the fraction
  of (m, n, j) in the anomalous range and the tau_j it implies;
* every scheme: attention mass by relative distance d = m - n in log2 bins, attention entropy (nats)
  and the mass on the first token (the attention sink).

The model's own path is used, never a copy: each layer's ``attend`` is wrapped to capture the raw
projections, the scheme and the per-forward context, and the scheme's ``transform_query`` /
``transform_key`` produce the vectors the kernel dots. Theta compares those vectors each rotated back
by its own position (R_m^-1 q'_m and R_n^-1 k'_n, with the model's ``rotate``): for every scheme

    score_j(m, n) = |q_j| |k_j| cos(Theta_j + (m - n) theta_j),  Theta_j = ccw angle from k_j to q_j.

RoPE: q = q_m, k = k_n. CoCA strict: q = [|q_m,j|^2, 0], k = [c_n,j, 0] (collinear: Theta = 0). CoCA
slack: k = t_n = [c, c] (the collinear coefficients) and q = R_m^-1 (q_m * R_m q_m), which depends
on m (slack is not shift-invariant).
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from tqdm import tqdm

from megatron_lite.data.tokenizer import model_tokenizer
from megatron_lite.eval.documents import EvalDocuments, load_documents
from megatron_lite.eval.diagnostics_plots import write_plots
from megatron_lite.eval.long_context import (choose_attention, max_supported_length, validate_kernel_settings,
                                             with_attention)
from megatron_lite.model.attention import AttentionKernel
from megatron_lite.model.masks import attention_mask
from megatron_lite.model.context import PositionContext
from megatron_lite.model.gpt import DTYPES, GPT
from megatron_lite.model.gqa import repeat_kv
from megatron_lite.model.position import PositionScheme
from megatron_lite.model.rope import RotaryTables, rotate
from megatron_lite.weights import load_model

TWO_PI = 2 * math.pi
LENGTH_FACTORS = (1, 2, 4, 8, 16, 32)  # default lengths: the training length times these
THETA_BINS = 36  # 10-degree bins over [0, 2 pi)
ANGLE_TOLERANCE = 1e-9  # rad: |Theta| below this (float64 noise of rotate-then-unrotate) counts as 0
TAU_LOG2_RANGE = (-10.0, 30.0)  # tau histogram over log2(tau / tokens), 1/8-octave bins
TAU_BINS_PER_OCTAVE = 8
TAU_BINS = int((TAU_LOG2_RANGE[1] - TAU_LOG2_RANGE[0]) * TAU_BINS_PER_OCTAVE)
MAX_BLOCK_ELEMENTS = 1 << 22  # (rows x keys x pairs x heads) per block of the angle computation


# ----------------------------------------------------------------------------------------------
# Sampling and bins


def sample_query_rows(length: int, num_queries: int) -> torch.Tensor:
    """(R,) sorted query rows: 3/4 evenly over the last quarter (they see long contexts), 1/4 spread over
    1..length-1. Row 0 (which sees only itself) is left out unless the sequence is one token."""
    if length == 1:
        return torch.zeros(1, dtype=torch.long)
    if num_queries >= length - 1:
        return torch.arange(1, length)
    num_spread = num_queries // 4
    tail = torch.linspace(length - max(length // 4, 1), length - 1, num_queries - num_spread).round().long()
    spread = torch.linspace(1, length - 1, num_spread).round().long() if num_spread else tail[:0]
    return torch.unique(torch.cat([tail, spread]).clamp(1, length - 1))


def num_distance_bins(length: int) -> int:
    """Bins 0 | 1 | 2-3 | 4-7 | ... up to the largest distance length - 1."""
    return (length - 1).bit_length() + 1


def distance_bin_edges(length: int) -> list[list[int]]:
    """[first, last] distance of each bin."""
    return [[0, 0]] + [[2 ** (b - 1), min(2**b - 1, length - 1)] for b in range(1, num_distance_bins(length))]


def distance_bins(distance: torch.Tensor, num_bins: int) -> torch.Tensor:
    """Bin index of integer distances >= 0: 0 for d = 0, else floor(log2 d) + 1."""
    boundaries = 2 ** torch.arange(num_bins - 1, device=distance.device)  # 1, 2, 4, ...
    return torch.bucketize(distance, boundaries, right=True)


# ----------------------------------------------------------------------------------------------
# Statistics of one layer


@dataclass
class HeadStats:
    """Sums over documents for one layer (every tensor has the heads first); averages come at the end."""

    num_rows: int
    mass_HB: torch.Tensor  # attention mass per distance bin, summed over rows
    entropy_H: torch.Tensor  # summed over rows, nats
    sink_H: torch.Tensor  # probability on key position 0, summed over rows
    angles: AngleStats | None = None  # rotary schemes only

    def add(self, other: HeadStats) -> None:
        self.num_rows += other.num_rows
        self.mass_HB += other.mass_HB
        self.entropy_H += other.entropy_H
        self.sink_H += other.sink_H
        if self.angles is not None and other.angles is not None:
            self.angles.add(other.angles)


@dataclass
class AngleStats:
    """Counts of (m, n, j) triples per head (m sampled, n <= m, j a rotary pair)."""

    counted_H: torch.Tensor  # both vectors non-zero
    zero_excluded_H: torch.Tensor  # q_j or k_j is the zero vector: no angle, left out
    above_pi_H: torch.Tensor  # Theta_j > pi
    anomalous_H: torch.Tensor  # Theta_j > pi and m - n < tau_j
    weight_H: torch.Tensor  # sum of |q_j| |k_j| over counted triples
    weight_anomalous_H: torch.Tensor
    theta_hist_HA: torch.Tensor  # |q_j| |k_j|-weighted Theta histogram, THETA_BINS over [0, 2 pi)
    tau_hist_HT: torch.Tensor  # counts of log2 tau for Theta_j > pi

    def add(self, other: AngleStats) -> None:
        for name in self.__dataclass_fields__:
            getattr(self, name).add_(getattr(other, name))


def attention_probabilities(q_BHTD: torch.Tensor, k_BKTD: torch.Tensor, scheme: PositionScheme, ctx: PositionContext,
                            rows_R: torch.Tensor, scale: float) -> torch.Tensor:
    """(B, H, R, T) float32 softmax of the sampled query rows over all keys, from the scheme's own transforms
    and the kernel's own mask (causal, ALiBi bias, document mask). Self-attention without a cache."""
    q_BHRD = scheme.transform_query(q_BHTD, ctx.tables)[:, :, rows_R]
    keys_BHTD = repeat_kv(scheme.transform_key(k_BKTD, ctx.tables), q_BHTD.shape[1])
    scores_BHRT = (q_BHRD.float() @ keys_BHTD.float().transpose(-1, -2)) * scale
    mask = attention_mask(ctx.positions[rows_R], ctx.positions, scheme.slopes(), torch.float32)
    scores_BHRT = scores_BHRT + mask if mask.dtype != torch.bool else scores_BHRT.masked_fill(~mask, float("-inf"))
    if ctx.document_ids is not None:
        same_BRT = ctx.document_ids[:, rows_R, None] == ctx.document_ids[:, None, :]
        scores_BHRT = scores_BHRT.masked_fill(~same_BRT[:, None], float("-inf"))
    return torch.softmax(scores_BHRT, dim=-1)


def distance_mass(probs_BHRT: torch.Tensor, rows_R: torch.Tensor, num_bins: int) -> torch.Tensor:
    """(B, H, R, num_bins): each row's probability mass per log2 distance bin (rows sum to 1)."""
    length, device = probs_BHRT.shape[-1], probs_BHRT.device
    keys_T = torch.arange(length, device=device)
    distance_RT = (rows_R.to(device)[:, None] - keys_T[None, :]).clamp(min=0)  # keys after m have p = 0
    index = distance_bins(distance_RT, num_bins).expand_as(probs_BHRT)
    return torch.zeros(*probs_BHRT.shape[:-1], num_bins, device=device).scatter_add_(-1, index, probs_BHRT)


def unrotated_pairs(scheme: PositionScheme, x_BHTD: torch.Tensor, tables: RotaryTables,
                    query: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The scheme's q' (or k') rotated back by its own position, as the two coordinates of every rotary pair
    (i, i + r/2): each (B, H, T, r/2). ``tables`` are those of x's positions."""
    transform = scheme.transform_query if query else scheme.transform_key
    unrotated = rotate(transform(x_BHTD, tables), tables.cos, tables.sin, transpose=True)
    half = tables.cos.shape[-1] // 2
    return unrotated[..., :half], unrotated[..., half : 2 * half]


def pair_polar(first: torch.Tensor, second: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Angle (atan2, counter-clockwise from the first axis) and length of every rotary pair's 2-D vector."""
    return torch.atan2(second, first), torch.hypot(first, second)


def initial_angles(q_angle: torch.Tensor, k_angle: torch.Tensor) -> torch.Tensor:
    """Theta = the signed counter-clockwise angle from k_j to q_j, in [0, 2 pi) (broadcasting); float64 noise
    within ANGLE_TOLERANCE of 0 or 2 pi (rotating and rotating back) is 0."""
    theta = torch.remainder(q_angle - k_angle, TWO_PI)
    return theta.masked_fill((theta < ANGLE_TOLERANCE) | (TWO_PI - theta < ANGLE_TOLERANCE), 0.0)


def per_head_histogram(index: torch.Tensor, weight: torch.Tensor, num_bins: int) -> torch.Tensor:
    """(H, num_bins) sums of ``weight`` per bin ``index``; both (B, H, ...)."""
    heads = index.shape[1]
    index_HN = index.transpose(0, 1).reshape(heads, -1)
    weight_HN = weight.transpose(0, 1).reshape(heads, -1).to(torch.float64)
    histogram = torch.zeros(heads, num_bins, dtype=torch.float64, device=index.device)
    return histogram.scatter_add_(1, index_HN, weight_HN).cpu()


def empty_angle_stats(heads: int) -> AngleStats:
    zeros = [torch.zeros(heads, dtype=torch.float64) for _ in range(6)]
    return AngleStats(*zeros, torch.zeros(heads, THETA_BINS, dtype=torch.float64),
                      torch.zeros(heads, TAU_BINS, dtype=torch.float64))


def angle_statistics(q_BHTD: torch.Tensor, k_BKTD: torch.Tensor, scheme: PositionScheme, ctx: PositionContext,
                     rows_R: torch.Tensor) -> AngleStats:
    """Theta / anomalous / tau counts over (m in rows, n <= m, j), in blocks of rows: per-vector angles in
    float64, per-triple comparisons in float32."""
    rotary = scheme.rotary
    assert rotary is not None and ctx.tables is not None
    tables = rotary.tables(ctx.positions, ctx.rope_length, torch.float64)  # the model's frequencies, in float64
    inv_freq_P = rotary.inv_freq(ctx.rope_length)[0].float().to(q_BHTD.device)  # theta_j, (r/2,)
    heads, pairs = q_BHTD.shape[1], inv_freq_P.numel()
    row_tables = RotaryTables(tables.cos[rows_R], tables.sin[rows_R])
    q_angle, q_norm = pair_polar(*unrotated_pairs(scheme, q_BHTD[:, :, rows_R].double(), row_tables, query=True))
    k_angle, k_norm = (repeat_kv(x, heads) for x in
                       pair_polar(*unrotated_pairs(scheme, k_BKTD.double(), tables, query=False)))
    q_norm, k_norm = q_norm.float(), k_norm.float()  # (B, H, R, P), (B, H, T, P)
    stats = empty_angle_stats(heads)
    positions = ctx.positions
    block = max(1, MAX_BLOCK_ELEMENTS // (q_BHTD.shape[0] * heads * positions.numel() * pairs))
    head_sum = lambda x: x.sum(dim=(0, 2, 3, 4), dtype=torch.float64).cpu()  # noqa: E731
    for start in range(0, rows_R.numel(), block):
        rows = slice(start, start + block)
        visible = int(rows_R[rows].max()) + 1  # keys after the block's last query are masked for all of it
        theta = initial_angles(q_angle[:, :, rows, None, :], k_angle[:, :, None, :visible]).float()  # (B, H, Rb, S, P)
        distance_RS = (positions[rows_R[rows]][:, None] - positions[None, :visible]).float()
        nonzero = (q_norm[:, :, rows, None, :] > 0) & (k_norm[:, :, None, :visible] > 0)
        causal = (distance_RS >= 0)[None, None, :, :, None]
        counted = causal & nonzero
        weight = (q_norm[:, :, rows, None, :] * k_norm[:, :, None, :visible]).masked_fill_(~counted, 0.0)
        above = counted & (theta > math.pi)
        anomalous = above & (theta + distance_RS[None, None, :, :, None] * inv_freq_P < TWO_PI)
        stats.counted_H += head_sum(counted)
        stats.zero_excluded_H += head_sum(causal & ~nonzero)
        stats.above_pi_H += head_sum(above)
        stats.anomalous_H += head_sum(anomalous)
        stats.weight_H += head_sum(weight)
        stats.weight_anomalous_H += head_sum(weight * anomalous)
        theta_bin = (theta * (THETA_BINS / TWO_PI)).long().clamp_(0, THETA_BINS - 1)
        stats.theta_hist_HA += per_head_histogram(theta_bin, weight, THETA_BINS)
        log2_tau = ((TWO_PI - theta) / inv_freq_P).log2_()  # tau in tokens; used where Theta > pi
        tau_bin = ((log2_tau - TAU_LOG2_RANGE[0]) * TAU_BINS_PER_OCTAVE).nan_to_num_(0.0).long().clamp_(0, TAU_BINS - 1)
        stats.tau_hist_HT += per_head_histogram(tau_bin, above, TAU_BINS)
    return stats


def layer_statistics(q_BHTD: torch.Tensor, k_BKTD: torch.Tensor, scheme: PositionScheme, ctx: PositionContext,
                     rows_R: torch.Tensor, scale: float, rows_per_block: int = 16) -> HeadStats:
    """Mass by distance, entropy, sink mass (every scheme) and angle statistics (rotary schemes) of one layer."""
    length, heads = q_BHTD.shape[2], q_BHTD.shape[1]
    num_bins = num_distance_bins(length)
    stats = HeadStats(0, torch.zeros(heads, num_bins, dtype=torch.float64), torch.zeros(heads, dtype=torch.float64),
                      torch.zeros(heads, dtype=torch.float64))
    for start in range(0, rows_R.numel(), rows_per_block):
        block_R = rows_R[start : start + rows_per_block]
        probs_BHRT = attention_probabilities(q_BHTD, k_BKTD, scheme, ctx, block_R, scale)
        stats.num_rows += probs_BHRT.shape[0] * block_R.numel()
        stats.mass_HB += distance_mass(probs_BHRT, block_R, num_bins).double().sum(dim=(0, 2)).cpu()
        stats.entropy_H += -torch.special.xlogy(probs_BHRT, probs_BHRT).sum(-1).double().sum(dim=(0, 2)).cpu()
        stats.sink_H += probs_BHRT[..., 0].double().sum(dim=(0, 2)).cpu()
    if scheme.rotary is not None:
        stats.angles = angle_statistics(q_BHTD, k_BKTD, scheme, ctx, rows_R)
    return stats


# ----------------------------------------------------------------------------------------------
# Capturing the model's own attention inputs

AttendHook = Callable[[int, AttentionKernel, torch.Tensor, torch.Tensor, torch.Tensor, PositionScheme,
                       PositionContext, torch.Tensor], None]


@contextlib.contextmanager
def capture_attention(model: GPT, hook: AttendHook) -> Iterator[None]:
    """Wrap every layer's ``attend`` (an instance attribute, removed afterwards): ``hook(layer, kernel, q_BHTD,
    k_BKTD, v_BKTD, scheme, ctx, out_BHTD)`` sees the raw projections and the output of each layer."""
    kernels = [module for module in model.modules() if isinstance(module, AttentionKernel)]

    def wrap(layer: int, kernel: AttentionKernel) -> Callable[..., torch.Tensor]:
        original = kernel.attend

        def attend(q_BHTD, k_BKTD, v_BKTD, scheme, ctx, cache):  # type: ignore[no-untyped-def]
            out_BHTD = original(q_BHTD, k_BKTD, v_BKTD, scheme, ctx, cache)
            hook(layer, kernel, q_BHTD, k_BKTD, v_BKTD, scheme, ctx, out_BHTD)
            return out_BHTD

        return attend

    try:
        for layer, kernel in enumerate(kernels):
            kernel.attend = wrap(layer, kernel)  # type: ignore[method-assign]
        yield
    finally:
        for kernel in kernels:
            kernel.__dict__.pop("attend", None)


def document_statistics(model: GPT, token_ids: torch.Tensor, num_queries: int) -> list[HeadStats]:
    """One forward over ``token_ids`` (T,); statistics of every layer for the sampled rows."""
    rows_R = sample_query_rows(token_ids.numel(), num_queries)
    per_layer: list[HeadStats] = []

    def hook(layer, kernel, q_BHTD, k_BKTD, v_BKTD, scheme, ctx, out_BHTD):  # type: ignore[no-untyped-def]
        per_layer.append(layer_statistics(q_BHTD, k_BKTD, scheme, ctx, rows_R, kernel.scale))

    device = next(model.parameters()).device
    with torch.no_grad(), capture_attention(model, hook):
        model(token_ids.to(device)[None], logits_from=token_ids.numel() - 1)  # the LM head on one position only
    return per_layer


# ----------------------------------------------------------------------------------------------
# Rows of diagnostics.json


def tau_median(tau_hist: torch.Tensor) -> float | None:
    """Median tau (tokens) from the 1/8-octave log2 histogram: the centre of the bin holding the median."""
    total = float(tau_hist.sum())
    if total == 0:
        return None
    index = int(torch.searchsorted(tau_hist.cumsum(0), torch.tensor(total / 2, dtype=torch.float64)))
    return 2 ** (TAU_LOG2_RANGE[0] + (index + 0.5) / TAU_BINS_PER_OCTAVE)


def ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def head_row(stats: HeadStats, layer: int, head: int, length: int) -> dict[str, Any]:
    mass = stats.mass_HB[head] / stats.num_rows
    row: dict[str, Any] = {"layer": layer, "head": head, "length": length, "queries": stats.num_rows,
                           "entropy": float(stats.entropy_H[head]) / stats.num_rows,
                           "sink_mass": float(stats.sink_H[head]) / stats.num_rows,
                           "mass_by_distance": [float(x) for x in mass]}
    angles = stats.angles
    if angles is None:
        row.update(anomalous_fraction=None, anomalous_fraction_weighted=None, theta_above_pi_fraction=None,
                   tau_median=None, pairs_counted=None, pairs_zero_excluded=None, theta_histogram=None)
        return row
    counted = float(angles.counted_H[head])
    theta = angles.theta_hist_HA[head]
    row.update(anomalous_fraction=ratio(float(angles.anomalous_H[head]), counted),
               anomalous_fraction_weighted=ratio(float(angles.weight_anomalous_H[head]), float(angles.weight_H[head])),
               theta_above_pi_fraction=ratio(float(angles.above_pi_H[head]), counted),
               tau_median=tau_median(angles.tau_hist_HT[head]), pairs_counted=int(counted),
               pairs_zero_excluded=int(angles.zero_excluded_H[head]),
               theta_histogram=[float(x) for x in theta / theta.sum()] if float(theta.sum()) > 0 else None)
    return row


def statistics_rows(stats: dict[tuple[int, int], HeadStats]) -> list[dict[str, Any]]:
    """Rows ordered by length, layer, head from {(length, layer): summed stats}."""
    rows = []
    for (length, layer), layer_stats in sorted(stats.items()):
        rows.extend(head_row(layer_stats, layer, head, length) for head in range(layer_stats.sink_H.numel()))
    return rows


# ----------------------------------------------------------------------------------------------
# The tool


@dataclass
class DiagnosticsSettings:
    checkpoint: str
    docs: str
    out_dir: Path
    lengths: list[int] | None = None  # default: the training length x LENGTH_FACTORS, up to max_length
    max_length: int = 16384
    queries: int = 64  # sampled query rows per length and document
    max_docs: int = 1
    strip_gutenberg: bool = False
    split: str = "test"
    text_field: str = "text"
    tokenizer: str | None = None
    device: str = "cpu"
    dtype: str = "fp32"
    attention_backend: str = "auto"
    chunk_size: int = 1024
    overrides: list[str] = field(default_factory=list)
    progress: bool = True


def validate_settings(settings: DiagnosticsSettings) -> None:
    if settings.queries < 1:
        raise ValueError(f"--queries {settings.queries}: must be >= 1")
    if settings.max_length < 2:
        raise ValueError(f"--max-length {settings.max_length}: must be >= 2")
    if settings.max_docs < 1:
        raise ValueError(f"--max-docs {settings.max_docs}: must be >= 1")
    if settings.lengths is not None:
        too_long = [length for length in settings.lengths if length > settings.max_length]
        if too_long:
            raise ValueError(f"--lengths {too_long[0]}: longer than --max-length {settings.max_length}")
        if min(settings.lengths) < 2:
            raise ValueError(f"--lengths {min(settings.lengths)}: must be >= 2")
    validate_kernel_settings(settings.dtype, settings.attention_backend, settings.chunk_size)


def diagnostic_lengths(settings: DiagnosticsSettings, train_length: int, position_limit: int | None) -> list[int]:
    """The explicit --lengths, or the training length x 1, 2, ... 32 up to --max-length; learned positions stop
    at their table."""
    lengths = settings.lengths or [train_length * f for f in LENGTH_FACTORS if train_length * f <= settings.max_length]
    if not lengths:
        raise ValueError(f"--max-length {settings.max_length}: below the training length {train_length}")
    if position_limit is not None:
        lengths = [length for length in lengths if length <= position_limit]
        if not lengths:
            raise ValueError(f"--lengths: learned positions end at {position_limit}")
    return sorted(set(lengths))


def load_diagnostic_documents(settings: DiagnosticsSettings, tokenizer: Any, max_length: int) -> EvalDocuments:
    """The shared document loader, its flag names translated to this tool's."""
    try:
        return load_documents(settings.docs, tokenizer, max_length, settings.max_docs, settings.strip_gutenberg,
                              settings.split, settings.text_field)
    except ValueError as error:
        raise ValueError(str(error).replace("--ppl-docs", "--docs").replace("lower --max-doc-tokens",
                                                                            "lower --lengths / --max-length")
                         .replace("--max-doc-tokens", "the longest length")) from None


def run_attention_diagnostics(settings: DiagnosticsSettings) -> dict[str, Any]:
    """Load, compute every (length, layer) over the documents, write OUT/diagnostics.json and the plots."""
    validate_settings(settings)
    start = time.perf_counter()
    log = (lambda message: print(message, file=sys.stderr, flush=True)) if settings.progress else (lambda _: None)
    loaded = load_model(settings.checkpoint, settings.device, DTYPES[settings.dtype], settings.overrides or None)
    choice = choose_attention(loaded.config, settings.attention_backend, settings.chunk_size, settings.device)
    model = with_attention(loaded, choice)
    config = loaded.config.model
    train_length = config.seq_length
    lengths = diagnostic_lengths(settings, train_length, max_supported_length(loaded.config))
    tokenizer = model_tokenizer(settings.tokenizer, loaded.tokenizer_path, config, f"checkpoint {settings.checkpoint}")
    documents = load_diagnostic_documents(settings, tokenizer, max(lengths))
    log(f"{config.position.label}, trained on {train_length} tokens, from {loaded.source}; {choice.description}; "
        f"documents: {documents.summary()}")
    stats: dict[tuple[int, int], HeadStats] = {}
    bar = tqdm(total=len(lengths) * len(documents.token_ids), desc="attention diagnostics", unit="forward",
               disable=not settings.progress)
    with bar:
        for length in lengths:
            for doc in documents.token_ids:
                bar.set_postfix(length=length)
                for layer, layer_stats in enumerate(document_statistics(model, doc[:length], settings.queries)):
                    if (length, layer) in stats:
                        stats[(length, layer)].add(layer_stats)
                    else:
                        stats[(length, layer)] = layer_stats
                bar.update()
    rows = statistics_rows(stats)
    result = {
        "model": {"checkpoint": str(settings.checkpoint), "source": str(loaded.source),
                  "scheme": config.position.label, "rotary": config.uses_rotary, "train_length": train_length,
                  "num_layers": config.num_layers, "num_heads": config.num_attention_heads,
                  "rotary_dims": config.rotary_dims if config.uses_rotary else None},
        "settings": {key: value for key, value in asdict(settings).items() if key not in ("out_dir", "progress")},
        "documents": {"names": documents.names, "used": len(documents.token_ids), "read": documents.num_read},
        "lengths": lengths,
        "distance_bins": {str(length): distance_bin_edges(length) for length in lengths},
        "theta_bin_edges": [TWO_PI * i / THETA_BINS for i in range(THETA_BINS + 1)],
        "rows": rows,
        "seconds": round(time.perf_counter() - start, 1),
    }
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    path = settings.out_dir / "diagnostics.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    written = write_plots(result, settings.out_dir)
    log(f"wrote {', '.join(str(p) for p in [path, *written])} in {result['seconds']} s")
    return result
