"""Sliding-window perplexity (paper section 5.1 after Press et al.; HF "perplexity of fixed-length models").

A window of L tokens is what the model sees (positions 0..L-1); every position predicts the next
token. For a document of N tokens, window L and stride S (1 <= S <= L)::

    scored_until = 1                       # token 0 has no prediction
    for begin in 0, S, 2S, ...:            # while scored_until < N
        end = min(begin + L, N)            # the model reads tokens[begin:end]
        score tokens scored_until .. min(end + 1, N) - 1, each predicted at its previous position
        scored_until = min(end + 1, N)

The first window scores every prediction it makes (tokens 1..L); each later window scores only the
tokens not scored yet (its last S predictions, with L-S+1..L tokens of context); every token
1..N-1 is scored exactly once for any (L, S). This is REFERENCE.md's HF loop with the labels
aligned to the model's predictions rather than to its inputs: the HF loop scores tokens inside the
window it feeds, so a prediction sees at most L-1 tokens and, when S = L, the first token of every
window has no prediction at all and goes unscored (HF's current code subtracts one token per window
from its count for this reason). Here that token is predicted from the last token of the window
before it, which the model reads.
Perplexity is exp(total NLL / total scored tokens) over all documents (token-weighted). Bits per
byte is the total NLL in bits over the UTF-8 bytes of the text the scored tokens stand for (every
token but the first of each document; ``documents.scored_text_bytes``): the unit in which models with
different tokenizers compare on the same text (lm-evaluation-harness's ``bits_per_byte``).

Every window is an independent forward at positions 0..T-1 with rope_length T (T = end - begin:
L, except a document's last window when it is shorter): the dynamic-NTK base is the one the HF
formula gives for a sequence of T tokens, as when HF scores that window on its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class WindowSpan:
    begin: int  # first token the model reads
    end: int  # one past the last token it reads
    first_target: int  # first scored token (predicted at window position first_target - 1 - begin)
    num_scored: int  # tokens first_target .. first_target + num_scored - 1 are scored

    @property
    def length(self) -> int:
        return self.end - self.begin


def sliding_windows(num_tokens: int, window: int, stride: int) -> list[WindowSpan]:
    """The windows of one document; their scored tokens partition 1..num_tokens-1."""
    if window < 1:
        raise ValueError(f"window={window}: must be >= 1 (--windows)")
    if not 1 <= stride <= window:
        raise ValueError(f"stride={stride}: must be in [1, window={window}] or tokens would be skipped (--stride)")
    spans: list[WindowSpan] = []
    scored_until, begin = 1, 0
    while scored_until < num_tokens:
        end = min(begin + window, num_tokens)
        last_target = min(end + 1, num_tokens)  # exclusive; the prediction at end - 1 is of token end
        spans.append(WindowSpan(begin, end, scored_until, last_target - scored_until))
        scored_until = last_target
        begin += stride  # <= the previous end, so the next first target's predecessor is in the window
    return spans


def batches_of_equal_length(spans: Sequence[WindowSpan], batch_size: int) -> list[list[WindowSpan]]:
    """Consecutive spans grouped into batches of one length (only the last window can be shorter)."""
    batches: list[list[WindowSpan]] = []
    for span in spans:
        if batches and len(batches[-1]) < batch_size and batches[-1][0].length == span.length:
            batches[-1].append(span)
        else:
            batches.append([span])
    return batches


LogitsFn = Callable[..., torch.Tensor]  # model(input_ids_BT, positions=, rope_length=, logits_from=) -> (B, T-from, V)


@torch.no_grad()
def token_nlls(
    model: LogitsFn,
    token_ids: torch.Tensor,
    window: int,
    stride: int,
    batch_size: int = 1,
    on_window: Callable[[int], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token NLL (float64, (N,), NaN where unscored) and how often each token was scored ((N,) int).

    ``token_ids`` is one document (N,); ``on_window(k)`` is called after each batch of k windows.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: must be >= 1 (--batch-size)")
    num_tokens = token_ids.shape[0]
    nll_N = torch.full((num_tokens,), float("nan"), dtype=torch.float64)
    times_scored_N = torch.zeros(num_tokens, dtype=torch.long)
    device = next(iter(model.parameters())).device if isinstance(model, torch.nn.Module) else token_ids.device
    for batch in batches_of_equal_length(sliding_windows(num_tokens, window, stride), batch_size):
        length = batch[0].length
        ids_BT = torch.stack([token_ids[span.begin : span.end] for span in batch]).to(device)
        positions_T = torch.arange(length, device=device)
        logits_from = min(span.first_target - 1 - span.begin for span in batch)  # earlier positions score nothing
        logits_BTV = model(ids_BT, positions=positions_T, rope_length=length, logits_from=logits_from)
        for row, span in enumerate(batch):
            first_position = span.first_target - 1 - span.begin - logits_from
            logits_SV = logits_BTV[row, first_position : first_position + span.num_scored].float()  # (S, V)
            scored = slice(span.first_target, span.first_target + span.num_scored)
            targets_S = token_ids[scored].to(device)
            nll_S = F.cross_entropy(logits_SV, targets_S, reduction="none")  # (S,)
            nll_N[scored] = nll_S.double().cpu()
            times_scored_N[scored] += 1
        del logits_BTV
        if on_window is not None:
            on_window(len(batch))
    return nll_N, times_scored_N


@dataclass
class PerplexityResult:
    nll_sum: float  # nats
    num_tokens: int  # scored tokens
    num_bytes: int | None = None  # UTF-8 bytes of the scored text, when the caller gave them

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.num_tokens) if self.num_tokens else float("nan")

    @property
    def bits_per_byte(self) -> float | None:
        return self.nll_sum / math.log(2) / self.num_bytes if self.num_bytes else None


def num_windows(num_tokens: int, window: int, stride: int) -> int:
    return len(sliding_windows(num_tokens, window, stride))


def sliding_window_perplexity(
    model: LogitsFn,
    documents: Sequence[torch.Tensor],
    window: int,
    stride: int,
    batch_size: int = 1,
    on_window: Callable[[int], None] | None = None,
    scored_bytes: Sequence[int] | None = None,
) -> PerplexityResult:
    """Token-weighted perplexity over ``documents`` (each a (N,) tensor of token ids); with ``scored_bytes``
    (each document's scored-text bytes, ``documents.scored_text_bytes``) also bits per byte."""
    nll_sum, count = 0.0, 0
    for token_ids in documents:
        nll_N, times_scored_N = token_nlls(model, token_ids, window, stride, batch_size, on_window)
        assert bool((times_scored_N[1:] == 1).all()) and int(times_scored_N[0]) == 0, "every token exactly once"
        nll_sum += float(nll_N[1:].sum())
        count += token_ids.shape[0] - 1
    return PerplexityResult(nll_sum, count, sum(scored_bytes) if scored_bytes is not None else None)
