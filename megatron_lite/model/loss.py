"""The LM head and its cross entropy, fused and chunked so the (N, V) float32 logits never exist at once.

At the 350M head (hidden 1024, vocabulary 50,048) a micro batch of 16 x 512 tokens has 1.6 GB of
float32 logits, and their gradient as much again. ``chunked_cross_entropy`` computes the loss over
``chunk_tokens`` tokens at a time and recomputes each chunk's logits in backward, keeping only the
hidden states, the weight and the labels: peak memory is one chunk's logits.

``LMHead`` is the model's output layer: its forward returns logits, or the loss when given labels.
The weight is read inside the head's own forward, so DeepSpeed ZeRO-3 (which gathers a module's
parameters around that module's forward) gathers it for the fused path too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_CHUNK_TOKENS = 4096


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross entropy of hidden @ weight^T over the non-ignored labels, chunk by chunk.

    Logits are computed in the inputs' dtype (the matmul a plain head runs) and upcast to float32 for
    the softmax, as ``F.cross_entropy(logits.float(), ...)`` does; the weight gradient is accumulated in
    float32 over the chunks and cast once at the end."""

    @staticmethod
    def forward(ctx, hidden_NC: torch.Tensor, weight_VC: torch.Tensor, labels_N: torch.Tensor,  # type: ignore[override]
                chunk_tokens: int, ignore_index: int) -> torch.Tensor:
        total = hidden_NC.new_zeros((), dtype=torch.float32)
        for start in range(0, hidden_NC.shape[0], chunk_tokens):
            logits = (hidden_NC[start:start + chunk_tokens] @ weight_VC.t()).float()  # (n, V)
            total = total + F.cross_entropy(logits, labels_N[start:start + chunk_tokens], ignore_index=ignore_index,
                                            reduction="sum")
        count = (labels_N != ignore_index).sum()  # a tensor: no host read
        ctx.save_for_backward(hidden_NC, weight_VC, labels_N, count)
        ctx.chunk_tokens, ctx.ignore_index = chunk_tokens, ignore_index
        return total / count

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):  # type: ignore[override]
        hidden_NC, weight_VC, labels_N, count = ctx.saved_tensors
        chunk, ignore = ctx.chunk_tokens, ctx.ignore_index
        scale = grad_loss.float() / count  # d(mean)/d(sum)
        grad_hidden = torch.empty_like(hidden_NC)
        grad_weight = torch.zeros(weight_VC.shape, dtype=torch.float32, device=weight_VC.device)
        for start in range(0, hidden_NC.shape[0], chunk):
            hidden = hidden_NC[start:start + chunk]
            labels = labels_N[start:start + chunk]
            valid = labels != ignore
            # d(sum of NLL)/d logits = softmax - one_hot, built in place on the recomputed (n, V) logits
            grad_logits = torch.softmax((hidden @ weight_VC.t()).float(), dim=-1)
            grad_logits.scatter_add_(1, torch.where(valid, labels, 0)[:, None],
                                     -valid[:, None].to(grad_logits.dtype))
            grad_logits.mul_(valid[:, None] * scale)
            grad_hidden[start:start + chunk] = (grad_logits.to(hidden.dtype) @ weight_VC).to(hidden.dtype)
            grad_weight += grad_logits.t() @ hidden.float()
        return grad_hidden, grad_weight.to(weight_VC.dtype), None, None, None


def chunked_cross_entropy(hidden_NC: torch.Tensor, weight_VC: torch.Tensor, labels_N: torch.Tensor,
                          chunk_tokens: int = DEFAULT_CHUNK_TOKENS, ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross entropy of ``hidden_NC @ weight_VC.T`` against ``labels_N`` (already aligned),
    ignoring ``ignore_index`` like ``F.cross_entropy``; float32; the logits are never whole."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens}: must be >= 1")
    return _ChunkedCrossEntropy.apply(hidden_NC, weight_VC, labels_N, chunk_tokens, ignore_index)


class LMHead(nn.Linear):
    """The output layer (no bias; the weight may be tied to the embedding): logits, or with labels the loss."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__(hidden_size, vocab_size, bias=False)
        self.fused = True  # the training loop sets it from train.fused_loss
        self.chunk_tokens = DEFAULT_CHUNK_TOKENS

    def forward(self, x_BTC: torch.Tensor, labels_BT: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        if labels_BT is None:
            return F.linear(x_BTC, self.weight)  # (B, T, V)
        hidden_NC, labels_N = x_BTC.reshape(-1, x_BTC.shape[-1]), labels_BT.reshape(-1)
        if self.fused:
            return chunked_cross_entropy(hidden_NC, self.weight, labels_N, self.chunk_tokens)
        return F.cross_entropy(F.linear(hidden_NC, self.weight).float(), labels_N)
