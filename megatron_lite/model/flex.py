"""FlexAttention kernel for model.attention.backend='flex' (torch >= 2.5).

Every position scheme reaches the kernel as plain attention (q', k' already transformed); what is
left is the causal mask by positions, the optional document mask, and ALiBi. The masks become ONE
BlockMask per forward (shared by every layer and head: it depends on neither), ALiBi a score_mod.

What torch 2.13 does on CPU (measured; see tests/test_flex_kernel.py):
  * ``create_block_mask`` works eagerly on CPU for any lengths (not only multiples of the 128 block:
    the last partial block is padded and masked by the mask_mod itself) and inside
    ``torch.compile(fullgraph=True)``. The mask_mod closures index captured position / document
    tensors with the int32 index scalars: no host sync, no Python branch on tensor values, and dynamo
    lifts the captured tensors as graph inputs, so they are safe under compile.
  * ``flex_attention`` on CPU is INFERENCE ONLY: with any q/k/v ``requires_grad`` it raises
    NotImplementedError("FlexAttention does not support backward on CPU"), eagerly and compiled
    (aot_eager and inductor alike: the check runs while tracing). Without grad it runs eagerly through
    an unfused math implementation (materialises the (B, H, T, S) scores; correct, warns once about
    performance) and compiles with inductor (CPU C++ kernel; ~10 s compile) or aot_eager.
  * That eager math path keeps the scores in the inputs' dtype: in bf16 ALiBi's biases at distances 300
    and 301 (8,000 and 8,001) came out equal (tests/test_backends.py), and it took ~30x the time of the
    dense evaluation below at 4K tokens.
  * So on CPU/MPS, when any input requires grad or outside an enclosing compile, ``flex_attention_forward``
    evaluates the SAME mask_mod (``block_mask.mask_mod``) and score_mod densely on broadcast index grids, scores
    in float32: ordinary autograd ops, differentiable, and traceable by ``torch.compile(fullgraph=True)``.
    Memory is O(B H T S) there, exactly like the reference backend; use 'chunked' for long CPU runs.
  * On CUDA the raw ``flex_attention`` would also fall back to the unfused math path, so it is wrapped
    once in a module-level ``torch.compile`` (the fused Triton kernel, forward and backward). Inside an
    enclosing ``torch.compile`` the raw function is called and the outer graph compiles it.
  * ``create_block_mask`` run eagerly materialises the whole (B, H, T, S) boolean mask, and its per-block sum
    over a permuted view a copy of it in int64: about 10 bytes per query-key pair (2.6 GB at 16K tokens on CPU,
    measured; the 10.8 GiB of the flex row at 32K in the GPU check of 2026-11-26). ``build_block_mask`` makes the
    same BlockMask a band of query blocks at a time (``MASK_ELEMENTS_PER_BAND``), with boolean block reductions:
    one band's mask at most, whatever the length, and no compile.

dtype: q/k/v share one dtype (fp32, fp16, bf16). The ALiBi bias is computed in float32 (slopes and
distances as float32, like the reference's float mask) and added to the kernel's score, which the fused
kernels and the dense evaluation keep in float32: every distance below 2**24 gets its own bias.
Device: build the block mask on q's device (flex_attention requires them equal).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any, Callable

import torch
from torch import Tensor

from megatron_lite.model.gqa import is_grouped, repeat_kv

FLEX_MIN_TORCH = (2, 5)
BLOCK_SIZE = 128  # FlexAttention's default sparse block; lengths need not be multiples of it
MASK_ELEMENTS_PER_BAND = 1 << 27  # query-key pairs (x batch) of the mask evaluated at once: 128 MiB of bool

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def flex_available() -> bool:
    """torch >= 2.5 with torch.nn.attention.flex_attention importable."""
    if _torch_version() < FLEX_MIN_TORCH:
        return False
    try:
        return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None
    except ModuleNotFoundError:
        return False


def check_flex_available() -> None:
    if not flex_available():
        raise ValueError(
            f"model.attention.backend='flex' needs torch >= {FLEX_MIN_TORCH[0]}.{FLEX_MIN_TORCH[1]} (FlexAttention); "
            f"this is torch {torch.__version__}"
        )


def document_ids(input_ids_BT: Tensor, eod_token_id: int) -> Tensor:
    """(B, T) int64 document index per token, counted per row; the EOD token is the LAST token of the
    document it ends (so it still sees that document), the token after it starts the next one."""
    if input_ids_BT.dim() != 2:
        raise ValueError(f"document_ids: input_ids must be (B, T), got shape {tuple(input_ids_BT.shape)}")
    is_eod_BT = (input_ids_BT == eod_token_id).to(torch.int64)
    return torch.cumsum(is_eod_BT, dim=1) - is_eod_BT


def causal_mask_mod(q_positions_T: Tensor, k_positions_S: Tensor) -> MaskMod:
    """Key n visible to query m iff position n <= position m (arbitrary ascending positions)."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return k_positions_S[kv_idx] <= q_positions_T[q_idx]

    return mask_mod


def document_mask_mod(causal: MaskMod, document_ids_BT: Tensor, document_ids_BS: Tensor) -> MaskMod:
    """Causal AND same document (batch dependent)."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        same_document = document_ids_BT[b, q_idx] == document_ids_BS[b, kv_idx]
        return causal(b, h, q_idx, kv_idx) & same_document

    return mask_mod


def _check_mask_inputs(q_positions_T: Tensor, k_positions_S: Tensor, document_ids_BT: Tensor | None,
                       document_ids_BS: Tensor | None) -> None:
    if q_positions_T.dim() != 1 or k_positions_S.dim() != 1:
        raise ValueError(f"build_block_mask: positions must be 1-D, got q {tuple(q_positions_T.shape)} "
                         f"and k {tuple(k_positions_S.shape)}")
    if (document_ids_BT is None) != (document_ids_BS is None):
        raise ValueError("build_block_mask: document_ids_BT and document_ids_BS must be given together, got "
                         f"{'None' if document_ids_BT is None else 'a tensor'} and "
                         f"{'None' if document_ids_BS is None else 'a tensor'}")
    if document_ids_BT is None or document_ids_BS is None:
        return
    expected = (q_positions_T.shape[0], k_positions_S.shape[0])
    if (document_ids_BT.dim() != 2 or document_ids_BS.dim() != 2 or document_ids_BT.shape[0] != document_ids_BS.shape[0]
            or (document_ids_BT.shape[1], document_ids_BS.shape[1]) != expected):
        raise ValueError(f"build_block_mask: document ids of shapes {tuple(document_ids_BT.shape)} and "
                         f"{tuple(document_ids_BS.shape)} do not match (B, T={expected[0]}) and (B, S={expected[1]})")


def build_block_mask(q_positions_T: Tensor, k_positions_S: Tensor, document_ids_BT: Tensor | None = None,
                     document_ids_BS: Tensor | None = None) -> Any:
    """One BlockMask per forward, on the positions' device: (1, 1, T, S) broadcast over batch and heads,
    or (B, 1, T, S) with document ids. Independent of head and layer, so every layer shares it."""
    _check_mask_inputs(q_positions_T, k_positions_S, document_ids_BT, document_ids_BS)
    mask_mod = causal_mask_mod(q_positions_T, k_positions_S)
    batch = 1
    if document_ids_BT is not None and document_ids_BS is not None:
        mask_mod = document_mask_mod(mask_mod, document_ids_BT, document_ids_BS)
        batch = document_ids_BT.shape[0]
    return banded_block_mask(mask_mod, batch, q_positions_T.shape[0], k_positions_S.shape[0], q_positions_T.device)


def banded_block_mask(mask_mod: MaskMod, batch: int, q_len: int, kv_len: int, device: torch.device) -> Any:
    """``create_block_mask(mask_mod, batch, None, q_len, kv_len, device, BLOCK_SIZE)``'s BlockMask (one head,
    broadcast over heads) without its whole mask: ``mask_mod`` evaluated on broadcast index grids (it only
    indexes and compares, so broadcasting equals create_mask's vmap), a band of whole query blocks at a time;
    each block full where every pair in it is visible, partial where some are (padding past the lengths is
    never visible), the block lists ordered as torch's ``_dense_to_ordered`` orders them."""
    from torch.nn.attention.flex_attention import BlockMask

    kv_blocks = -(-kv_len // BLOCK_SIZE)
    padded_kv = kv_blocks * BLOCK_SIZE
    rows_per_band = max(1, MASK_ELEMENTS_PER_BAND // (batch * padded_kv * BLOCK_SIZE)) * BLOCK_SIZE
    b = torch.arange(batch, device=device)[:, None, None]
    h = torch.zeros((), dtype=torch.int64, device=device)
    kv_idx = torch.arange(kv_len, device=device)[None, None, :]
    partial, full = [], []
    for start in range(0, q_len, rows_per_band):
        rows = min(rows_per_band, q_len - start)
        q_idx = torch.arange(start, start + rows, device=device)[None, :, None]
        visible = mask_mod(b, h, q_idx, kv_idx).expand(batch, rows, kv_len)  # (B, rows, S) bool
        padded_rows = -(-rows // BLOCK_SIZE) * BLOCK_SIZE
        visible = torch.nn.functional.pad(visible, (0, padded_kv - kv_len, 0, padded_rows - rows))
        blocks = visible.view(batch, padded_rows // BLOCK_SIZE, BLOCK_SIZE, kv_blocks, BLOCK_SIZE)
        any_visible, all_visible = blocks.any(dim=4).any(dim=2), blocks.all(dim=4).all(dim=2)  # (B, nq, nk)
        partial.append(any_visible & ~all_visible)
        full.append(all_visible)
    partial_BHQK, full_BHQK = torch.cat(partial, dim=1)[:, None], torch.cat(full, dim=1)[:, None]
    return BlockMask.from_kv_blocks(*_ordered(partial_BHQK), *_ordered(full_BHQK), BLOCK_SIZE=BLOCK_SIZE,
                                    mask_mod=mask_mod, seq_lengths=(q_len, kv_len))


def _ordered(blocks_BHQK: Tensor) -> tuple[Tensor, Tensor]:
    """(number of marked key blocks per query block (B, H, nq), key block indices marked first (B, H, nq, nk)),
    int32, as torch's ``_dense_to_ordered``."""
    dense = blocks_BHQK.to(torch.int32)
    indices = torch.argsort(dense, dim=-1, descending=True, stable=True)
    return dense.sum(dim=-1).to(torch.int32), indices.to(torch.int32)


def alibi_score_mod(q_positions_T: Tensor, k_positions_S: Tensor, slopes_H: Tensor) -> ScoreMod:
    """score + slope_h (n - m): the bias -slope_h (m - n), in float32 like the reference's float mask."""
    slopes_f32_H = slopes_H.to(torch.float32)

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        distance = (k_positions_S[kv_idx] - q_positions_T[q_idx]).to(torch.float32)
        return (score.to(torch.float32) + slopes_f32_H[h] * distance).to(score.dtype)

    return score_mod


def dense_flex_attention(q_BHTD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor, mask_mod: MaskMod,
                         score_mod: ScoreMod | None, scale: float) -> Tensor:
    """flex_attention's semantics with materialised scores: the mods evaluated on broadcast index grids
    (they only index and compare, so broadcasting equals vmap). For CPU training, where flex has no backward."""
    batch, heads, length, _ = q_BHTD.shape
    device = q_BHTD.device
    b = torch.arange(batch, device=device)[:, None, None, None]
    h = torch.arange(heads, device=device)[None, :, None, None]
    q_idx = torch.arange(length, device=device)[None, None, :, None]
    kv_idx = torch.arange(k_BHSD.shape[-2], device=device)[None, None, None, :]
    compute_dtype = torch.promote_types(q_BHTD.dtype, torch.float32)
    scores_BHTS = (q_BHTD.to(compute_dtype) @ k_BHSD.to(compute_dtype).transpose(-2, -1)) * scale
    if score_mod is not None:
        scores_BHTS = score_mod(scores_BHTS, b, h, q_idx, kv_idx)
    allowed = mask_mod(b, h, q_idx, kv_idx)  # broadcastable to (B, H, T, S)
    scores_BHTS = scores_BHTS.masked_fill(~allowed, float("-inf"))
    probs_BHTS = torch.softmax(scores_BHTS, dim=-1)
    # A query with no visible key: flex returns 0 there, softmax NaN; match flex.
    probs_BHTS = torch.nan_to_num(probs_BHTS, nan=0.0)
    return (probs_BHTS @ v_BHSD.to(compute_dtype)).to(q_BHTD.dtype)


@functools.cache
def _compiled_flex_attention() -> Callable[..., Tensor]:
    """One module-level compiled flex (fused Triton kernel on CUDA); compiled lazily on first use."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex_kernel(device: torch.device, compiled: bool | None) -> Callable[..., Tensor]:
    """Raw flex inside an enclosing compile (the outer graph fuses it) and off CUDA (CPU math path);
    the compiled wrapper on CUDA, where raw flex would materialise scores too."""
    from torch.nn.attention.flex_attention import flex_attention

    if compiled is None:
        compiled = device.type == "cuda"
    if compiled and not torch.compiler.is_compiling():
        return _compiled_flex_attention()
    return flex_attention


def _runs_dense(*tensors: Tensor) -> bool:
    """CPU/MPS: torch's flex refuses inputs that require grad (even under no_grad, compiled or not); without grad
    and outside an enclosing compile it runs an unfused math path that keeps half-precision scores (ALiBi's biases
    at distances 300 and 301 came out equal in bf16) and took ~30x the dense path's time at 4K tokens."""
    return tensors[0].device.type in ("cpu", "mps") and (
        any(t.requires_grad for t in tensors) or not torch.compiler.is_compiling())


def flex_attention_forward(q_BHTD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor, block_mask: Any, q_positions_T: Tensor,
                           k_positions_S: Tensor, slopes_H: Tensor | None, scale: float, *,
                           compiled: bool | None = None) -> Tensor:
    """(B, H, T, D) attention under ``block_mask`` (build_block_mask) with ALiBi as a score_mod; k/v may have
fewer (grouped-query) heads (B, H_kv, S, D).

    compiled: wrap flex in torch.compile (default: on CUDA only; ignored inside an enclosing compile).
    On CPU/MPS with inputs requiring grad the dense equivalent runs (see the module docstring).
    """
    if q_BHTD.shape[-2] != block_mask.shape[-2] or k_BHSD.shape[-2] != block_mask.shape[-1]:
        raise ValueError(f"flex_attention_forward: block_mask of shape {tuple(block_mask.shape)} does not match "
                         f"T={q_BHTD.shape[-2]}, S={k_BHSD.shape[-2]}; build it for this forward")
    score_mod = None if slopes_H is None else alibi_score_mod(q_positions_T, k_positions_S, slopes_H)
    if _runs_dense(q_BHTD, k_BHSD, v_BHSD):
        heads = q_BHTD.shape[1]
        return dense_flex_attention(q_BHTD, repeat_kv(k_BHSD, heads), repeat_kv(v_BHSD, heads), block_mask.mask_mod,
                                    score_mod, scale)
    kernel = _flex_kernel(q_BHTD.device, compiled)
    return kernel(q_BHTD, k_BHSD, v_BHSD, score_mod=score_mod, block_mask=block_mask, scale=scale,
                  enable_gqa=is_grouped(q_BHTD, k_BHSD))
