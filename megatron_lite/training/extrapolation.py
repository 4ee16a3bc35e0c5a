"""Long-context perplexity while training (``train.extrapolation_eval``): the curve that shows when a model's
extrapolation breaks, against tokens seen.

The same held-out tokens are scored at every window and every evaluation. Each book is cut to
``max_window + scored`` tokens (max_window = the largest window, scored = ``scored_tokens_per_book`` rounded down
to a multiple of the training length S). Its scored targets are the tokens at positions max_window .. end, in
blocks of S. For a window of L tokens, the model reads the L tokens before a block's last target and scores its
last S predictions (the block), with labels ``IGNORE_INDEX`` elsewhere: sliding-window perplexity with stride S,
each prediction seeing L - S + 1 .. L tokens, at positions L - S .. L - 1. At 1x (L = S) every position is one
the model trained on; at kx the scored predictions sit at positions (k-1)S .. kS - 1, all past the training
length. ppl(kx) / ppl(1x) > 1 means the far context, at positions never trained, hurts (RoPE's break); < 1
means it helps (ALiBi's pattern at small scale).

Every forward goes through the DeepSpeed engine with labels, so ZeRO 3 gathers the weights and sequence
parallelism shards the windows as in training (windows are multiples of S, hence of P). Every rank scores every
window (the evaluation is small by design; ZeRO 3 and sequence parallelism need all ranks in each forward) and
rank 0 logs. Nothing here draws random numbers, so training with the evaluation on takes the same steps.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_lite.config import Config, ExtrapolationEvalConfig, ModelConfig, RopeScalingConfig
from megatron_lite.console import notice
from megatron_lite.data.tokenizer import load_tokenizer
from megatron_lite.eval.documents import load_documents
from megatron_lite.eval.scaling import NO_SCALING, ScalingSpec, parse_scaling
from megatron_lite.model.loss import IGNORE_INDEX
from megatron_lite.model.variants import variant_of_position
from megatron_lite.training import metrics as metrics_lib

KEY = "train.extrapolation_eval"
PLOT_FILE = "extrapolation.png"


def ppl_key(window_multiple: int, scaling: ScalingSpec = NO_SCALING) -> str:
    """metrics.jsonl key of the perplexity at ``window_multiple`` x the training length: extrapolation_ppl_x4,
    extrapolation_ppl_x4_dynamic4 (with an inference-time scaling)."""
    return f"extrapolation_ppl_x{window_multiple}{_scaling_suffix(scaling)}"


def ratio_key(window_multiple: int, scaling: ScalingSpec = NO_SCALING) -> str:
    """Key of ppl(kx) / ppl(1x), both with the model's own scaling or both with ``scaling``."""
    return f"extrapolation_ratio_x{window_multiple}{_scaling_suffix(scaling)}"


def _scaling_suffix(scaling: ScalingSpec) -> str:
    return "" if scaling.type == "none" else f"_{scaling.type}{scaling.factor:g}"


@dataclass(frozen=True)
class ScoredBlock:
    """One forward: the model reads ``input_ids_T`` and scores its last seq_length predictions."""

    input_ids_T: torch.Tensor  # (L,)
    labels_T: torch.Tensor  # (L,), IGNORE_INDEX but for the last seq_length positions


def window_blocks(book_T: torch.Tensor, window: int, seq_length: int, max_window: int) -> list[ScoredBlock]:
    """The forwards that score ``book_T``'s targets (positions max_window .. end, in blocks of ``seq_length``)
    through windows of ``window`` tokens."""
    blocks = []
    # block_end: one past the block's last target
    for block_end in range(max_window + seq_length, book_T.shape[0] + 1, seq_length):
        start = block_end - 1 - window  # the window's first input token
        input_ids_T = book_T[start:block_end - 1]
        labels_T = book_T[start + 1:block_end].clone()
        labels_T[:window - seq_length] = IGNORE_INDEX
        blocks.append(ScoredBlock(input_ids_T, labels_T))
    return blocks


def scored_per_book(settings: ExtrapolationEvalConfig, seq_length: int) -> int:
    """Whole blocks of the training length: at least one."""
    return max(1, settings.scored_tokens_per_book // seq_length) * seq_length


class ExtrapolationEval:
    """The held-out books, tokenised once, and the evaluation of a model (or the engine around it) on them."""

    def __init__(self, settings: ExtrapolationEvalConfig, model: ModelConfig, books: list[torch.Tensor],
                 device: torch.device) -> None:
        """``books``: token ids, each (>= largest window + settings.scored_tokens_per_book,) (``from_run``)."""
        self.settings = settings
        self.seq_length = model.seq_length
        # the targets follow from the largest window asked for, so every scheme scores the same tokens; learned
        # absolute positions end at their table, so their longer windows are skipped (describe() says so)
        limit = model.max_positions if variant_of_position(model.position).position_table else None
        self.windows = sorted(w for w in settings.windows if limit is None or w * model.seq_length <= limit)
        self.skipped_windows = sorted(set(settings.windows) - set(self.windows))
        self.rotary = model.uses_rotary
        self.own_scaling: RopeScalingConfig = model.position.scaling
        self.scalings = [NO_SCALING] + [parse_scaling(text, f"{KEY}.scalings") for text in settings.scalings]
        if not self.rotary:
            self.scalings = [NO_SCALING]  # a scaling needs rotary embeddings; describe() says so
        self.device = device
        self.max_window = max(settings.windows) * self.seq_length
        scored = scored_per_book(settings, self.seq_length)
        self.books = [book[:self.max_window + scored] for book in books]
        self.scored_tokens = scored * len(self.books)  # per window and scaling
        # each window's forwards, built once: every evaluation scores the same blocks
        self.blocks = {multiple: [block for book in self.books for block in
                                  window_blocks(book, multiple * self.seq_length, self.seq_length, self.max_window)]
                       for multiple in self.windows}
        self.warned_over_budget = False

    @classmethod
    def from_run(cls, config: Config, tokenizer_path: Path, device: torch.device) -> ExtrapolationEval:
        """The run's books, read and tokenised with its tokenizer; one-line ValueError naming the key."""
        settings, seq_length = config.train.extrapolation_eval, config.model.seq_length
        needed = max(settings.windows) * seq_length + scored_per_book(settings, seq_length)
        documents = load_documents(settings.books, load_tokenizer(tokenizer_path), needed,
                                   max_documents=settings.max_books, strip_gutenberg=settings.strip_gutenberg,
                                   flags=(f"{KEY}.books", f"{KEY}.scored_tokens_per_book or windows"))
        return cls(settings, config.model, documents.token_ids, device)

    def describe(self) -> str:
        skipped = "" if self.rotary or not self.settings.scalings else "; scalings skipped (no rotary embedding)"
        if self.skipped_windows:
            skipped += (f"; windows {', '.join(f'{w}x' for w in self.skipped_windows)} skipped (learned positions "
                        "cannot extrapolate)")
        return (f"extrapolation eval every {self.settings.interval} steps: windows "
                f"{', '.join(f'{w}x' for w in self.windows)} of {self.seq_length}, {self.scored_tokens:,} tokens of "
                f"{len(self.books)} book(s) from {self.settings.books}"
                + (f", scalings {', '.join(s.name for s in self.scalings[1:])}" if len(self.scalings) > 1 else "")
                + skipped)

    def evaluate(self, engine: Any, check_interrupt: Callable[[], None] = lambda: None) -> dict[str, float]:
        """Perplexity at every window (and scaling) and each ratio to 1x, plus the seconds it took;
        ``check_interrupt`` runs before each batch (and may raise to stop: a run's stop signal)."""
        start = time.perf_counter()
        module = getattr(engine, "module", engine)  # a DeepSpeed engine, or the model itself
        row: dict[str, float] = {}
        engine.eval()
        try:
            with torch.no_grad(), _eager():
                for scaling in self.scalings:
                    if scaling is not NO_SCALING:
                        module.set_rope_scaling(scaling.config())
                    for multiple in self.windows:
                        row[ppl_key(multiple, scaling)] = self._perplexity(engine, self.blocks[multiple],
                                                                           check_interrupt)
        finally:
            if len(self.scalings) > 1:
                module.set_rope_scaling(self.own_scaling)
            engine.train()
        for scaling in self.scalings:
            for multiple in self.windows:
                if multiple != 1:
                    row[ratio_key(multiple, scaling)] = row[ppl_key(multiple, scaling)] / row[ppl_key(1, scaling)]
        row["extrapolation_scored_tokens"] = self.scored_tokens
        row["extrapolation_seconds"] = time.perf_counter() - start
        return row

    def _perplexity(self, engine: Any, blocks: list[ScoredBlock], check_interrupt: Callable[[], None]) -> float:
        nll_sum = 0.0
        for first in range(0, len(blocks), self.settings.batch_size):
            check_interrupt()
            batch = blocks[first:first + self.settings.batch_size]
            input_ids_BL = torch.stack([block.input_ids_T for block in batch]).to(self.device)
            labels_BL = torch.stack([block.labels_T for block in batch]).to(self.device)
            mean_nll = engine(input_ids_BL, labels=labels_BL)  # the mean over the B x S scored predictions
            nll_sum += float(mean_nll) * len(batch) * self.seq_length
        return math.exp(nll_sum / (len(blocks) * self.seq_length))

    def warn_if_over_budget(self, seconds: float) -> None:
        if seconds > self.settings.max_seconds and not self.warned_over_budget:
            self.warned_over_budget = True
            notice(f"{KEY}: one evaluation took {seconds:.1f} s, over max_seconds={self.settings.max_seconds:g}; "
                   f"lower {KEY}.scored_tokens_per_book, max_books, windows or scalings, or raise interval")


@contextlib.contextmanager
def _eager() -> Iterator[None]:
    """Compiled regions run eagerly: the evaluation's lengths would each cost the training graph a recompile."""
    set_stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    with set_stance("force_eager") if set_stance is not None else contextlib.nullcontext():
        yield


def format_row(row: dict[str, Any], windows: list[int], total_steps: int) -> str:
    """The console line of one evaluation: each window's perplexity, with its ratio to 1x."""
    parts = []
    for multiple in windows:
        ppl = row[ppl_key(multiple)]
        ratio = row.get(ratio_key(multiple))
        parts.append(f"x{multiple} {ppl:.2f}" + (f" ({ratio:.3f})" if ratio is not None else ""))
    return (f"step {row['step']}/{total_steps} | extrapolation ppl {' '.join(parts)} | "
            f"{row['extrapolation_seconds']:.1f} s")


def curve_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The evaluations among a run's metrics rows, one per step (a fresh restart's step-0 row once), in order."""
    by_step = {row["step"]: row for row in rows if ppl_key(1) in row}
    return [by_step[step] for step in sorted(by_step)]


def plot_curve(metrics_path: Path, out_path: Path, title: str) -> Path | None:
    """Perplexity at every window (left, log scale) and ppl(kx)/ppl(1x) (right) against tokens seen, from every
    evaluation in metrics.jsonl (a resumed run's too); None without evaluations or matplotlib."""
    rows = curve_rows(metrics_lib.read_metrics(metrics_path))
    from megatron_lite.eval.report import plots_available

    if not rows or not plots_available():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [row["tokens_seen"] for row in rows]
    figure, (ppl_axes, ratio_axes) = plt.subplots(1, 2, figsize=(11, 4))
    for key in sorted({key for row in rows for key in row if key.startswith("extrapolation_ppl_x")}, key=_key_order):
        label = key.removeprefix("extrapolation_ppl_")
        style = "--" if label.count("_") else "-"  # a scaling's rows dashed
        ppl_axes.plot(tokens, [row.get(key, math.nan) for row in rows], style, marker="o", markersize=3, label=label)
        ratio = key.replace("_ppl_", "_ratio_")
        if any(ratio in row for row in rows):
            ratio_axes.plot(tokens, [row.get(ratio, math.nan) for row in rows], style, marker="o", markersize=3,
                            label=label)
    ratio_axes.axhline(1.0, color="grey", linewidth=0.8)
    ppl_axes.set_yscale("log")
    ppl_axes.set_ylabel("perplexity on the held-out tokens")
    ratio_axes.set_ylabel("ppl(window) / ppl(1x)")
    for axes in (ppl_axes, ratio_axes):
        axes.set_xlabel("tokens seen")
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(out_path, dpi=120)
    plt.close(figure)
    return out_path


def _key_order(key: str) -> tuple[str, int]:
    """x2 before x16, each scaling's rows together."""
    multiple, _, scaling = key.removeprefix("extrapolation_ppl_x").partition("_")
    return scaling, int(multiple)
