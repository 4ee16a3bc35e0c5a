"""Rotary position embedding (GPT-NeoX "rotate_half" layout) and its inference-time scalings.

Pairs are (i, i + r/2) over the first r = rotary dims of a head; dims >= r pass through.
Angles are computed in float64 and cos/sin returned in float32 (GPT-NeoX issue #1003: low-precision
caches give wrong values; float32 angles alone lose ~1e-3 rad at position 32K).

Everything is computed on the positions' device: no host tensor is copied to the GPU in a forward (such a
copy is a host sync). The tables of a run of consecutive positions (training, and every forward without
explicit positions) are kept per (frequencies, start, length, device, dtype) in a small cache, so a training
step builds them once; the key holds everything the values depend on (the dynamic-NTK base of the call's
length included), so a cached table is never one of another length's base (HF issue #25104's stale cache).

Scalings follow HF transformers ``modeling_rope_utils``:
  linear   inv_freq / factor
  ntk      base * factor^(r/(r-2))
  dynamic  base * ((factor * L / L_train) - (factor - 1))^(r/(r-2))  for L > L_train
  yarn     NTK-by-parts blend of interpolated/extrapolated frequencies (correction range truncated to
           whole dims unless scaling.truncate is false), attention factor multiplying cos and sin
           (scaling.attention_factor, by default 0.1 ln(factor) + 1).
  llama3   Llama-3.1: long wavelengths / factor, short ones kept, a smooth blend between.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from megatron_lite.config import RopeScalingConfig


Device = torch.device | str | None
TABLE_CACHE_SIZE = 8  # (frequencies, start, length, device, dtype) entries; a run uses one or two
FUSED_ROTATION_DTYPES = (torch.bfloat16, torch.float16)  # the eager autograd functions' dtypes (``eager_kernels``)


def base_inv_freq(rotary_dims: int, base: float, device: Device = None) -> torch.Tensor:
    """theta_i = base^(-2i/r), i < r/2, float64 (r/2,) on ``device``."""
    exponents = torch.arange(0, rotary_dims, 2, dtype=torch.float64, device=device) / rotary_dims
    return 1.0 / (base**exponents)


def dynamic_ntk_base(base: float, rotary_dims: int, factor: float, seq_len: int, train_len: int) -> float:
    """HF dynamic-NTK base for a sequence of seq_len tokens; the original base up to train_len."""
    if seq_len <= train_len:
        return base
    alpha = (factor * seq_len / train_len) - (factor - 1)
    return base * alpha ** (rotary_dims / (rotary_dims - 2))


def yarn_inv_freq(
    rotary_dims: int, base: float, factor: float, original_len: int, beta_fast: float, beta_slow: float,
    attention_factor: float | None = None, truncate: bool = True, device: Device = None,
) -> tuple[torch.Tensor, float]:
    """YaRN inverse frequencies (float64) and attention factor, as HF _compute_yarn_parameters: the
    correction range is floored/ceiled to whole dims unless ``truncate`` is false; ``attention_factor``
    None is HF's default 0.1 ln(factor) + 1."""

    def correction_dim(num_rotations: float) -> float:
        return rotary_dims * math.log(original_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dims - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rotary_dims // 2, dtype=torch.float64, device=device) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, rotary_dims, 2, dtype=torch.float64, device=device) / rotary_dims)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (factor * pos_freqs)
    inv_freq = interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
    if attention_factor is None:
        attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return inv_freq, attention_factor


def llama3_inv_freq(rotary_dims: int, base: float, factor: float, original_len: int, low_freq_factor: float,
                    high_freq_factor: float, device: Device = None) -> torch.Tensor:
    """Llama-3.1 frequencies (float64), as HF _compute_llama3_parameters: wavelengths longer than
    original_len / low_freq_factor are interpolated (divided by factor), shorter than original_len /
    high_freq_factor kept, and the band between blended smoothly."""
    inv_freq = base_inv_freq(rotary_dims, base, device)
    wavelength = 2 * math.pi / inv_freq
    low_freq_wavelength, high_freq_wavelength = original_len / low_freq_factor, original_len / high_freq_factor
    scaled = torch.where(wavelength > low_freq_wavelength, inv_freq / factor, inv_freq)
    smooth = (original_len / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
    return torch.where(medium, blended, scaled)


@dataclass(frozen=True)
class RotaryTables:
    """cos/sin for a run of positions (T, r) in the model's dtype (float32 for float32 models, computed in float64
    and rounded through float32), times the attention factor."""

    cos: torch.Tensor
    sin: torch.Tensor


class RotaryEmbedding:
    """Frequencies for one model: base, rotary dims, scaling, and the training length the scaling is
    relative to (``ModelConfig.rotary_train_length``)."""

    def __init__(self, rotary_dims: int, base: float, scaling: RopeScalingConfig, train_length: int) -> None:
        self.rotary_dims = rotary_dims
        self.base = base
        self.scaling = scaling
        self.train_length = train_length
        self._range_tables: OrderedDict[tuple, RotaryTables] = OrderedDict()

    def inv_freq(self, seq_len: int, device: Device = None) -> tuple[torch.Tensor, float]:
        """Inverse frequencies (float64, (r/2,), on ``device``) and attention factor for a sequence of seq_len
        tokens.

        Only ``dynamic`` depends on seq_len; with a KV cache pass the final length of the whole
        generation so every cached key and new query share one base (avoids HF issue #25104).
        """
        kind, factor, r = self.scaling.type, self.scaling.factor, self.rotary_dims
        if kind == "none":
            return base_inv_freq(r, self.base, device), 1.0
        if kind == "linear":
            return base_inv_freq(r, self.base, device) / factor, 1.0
        if kind == "ntk":
            return base_inv_freq(r, self.base * factor ** (r / (r - 2)), device), 1.0
        if kind == "dynamic":
            return base_inv_freq(r, dynamic_ntk_base(self.base, r, factor, seq_len, self.train_length), device), 1.0
        if kind == "yarn":
            return yarn_inv_freq(r, self.base, factor, self.train_length, self.scaling.beta_fast, self.scaling.beta_slow,
                                 self.scaling.attention_factor, self.scaling.truncate, device)
        if kind == "llama3":
            return llama3_inv_freq(r, self.base, factor, self.train_length, self.scaling.low_freq_factor,
                                   self.scaling.high_freq_factor, device), 1.0
        raise ValueError(f"model.position.scaling.type={kind!r}: unknown scaling")

    def tables(self, positions: torch.Tensor, seq_len: int, dtype: torch.dtype = torch.float32) -> RotaryTables:
        """cos/sin (T, r) at the given integer positions (T,): float32, float64 when asked for, and for a bf16 / fp16
        ``dtype`` the float32 values rounded to it once here, which every layer's rotation did per use before
        (the same numbers, without a cast kernel per layer and use in an eager step)."""
        inv_freq, attention_factor = self.inv_freq(seq_len, positions.device)
        angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # (T, r/2)
        angles = torch.cat((angles, angles), dim=-1)  # (T, r): [theta, theta] layout
        table_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        cos = (angles.cos() * attention_factor).to(table_dtype)
        sin = (angles.sin() * attention_factor).to(table_dtype)
        if dtype in (torch.bfloat16, torch.float16):
            cos, sin = cos.to(dtype), sin.to(dtype)
        return RotaryTables(cos=cos, sin=sin)

    def range_tables(self, start: int, length: int, seq_len: int, device: Device,
                     dtype: torch.dtype = torch.float32) -> RotaryTables:
        """``tables`` at positions start .. start + length - 1, built once per key and then reused (module
        docstring). Built afresh inside a graph torch.compile traces; inductor then recomputes the float64
        cos/sin inside every consumer's fused kernel, per activation element (about 40% of a whole-model
        compiled 350M step on an H200, 2026-11-26), which is why ``compile_model`` keeps them outside its graphs."""
        device = torch.device(device) if device is not None else torch.device("cpu")
        if torch.compiler.is_compiling():
            return self.tables(torch.arange(start, start + length, device=device), seq_len, dtype)
        # inference tensors cannot be saved for a later backward: kept apart from ordinary ones
        key = (self._frequency_key(seq_len), start, length, device, dtype, torch.is_inference_mode_enabled())
        tables = self._range_tables.get(key)
        if tables is None:
            tables = self.tables(torch.arange(start, start + length, device=device), seq_len, dtype)
            self._range_tables[key] = tables
            if len(self._range_tables) > TABLE_CACHE_SIZE:
                self._range_tables.popitem(last=False)
        else:
            self._range_tables.move_to_end(key)
        return tables

    def _frequency_key(self, seq_len: int) -> tuple:
        """What the frequencies depend on: the settings, and the call's length where dynamic NTK uses it."""
        dynamic_length = seq_len if self.scaling.type == "dynamic" and seq_len > self.train_length else None
        return (self.rotary_dims, self.base, self.train_length, dataclasses.astuple(self.scaling), dynamic_length)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """R x (or R^T x) on the first r = cos.shape[-1] dims; cos/sin (T, r), constants in the [theta, theta] layout
    of ``RotaryEmbedding.tables`` (both halves equal), broadcast over leading dims; differentiable in x.

    Eager in bf16/fp16 (GPU training), the rotation writes each half of its output with one multiply and one
    multiply-add (``_Rotation``): about half the memory traffic of the expression ``x * cos + rotate_half(x) * sin``
    (which reads and writes its temporaries, then autograd's slice and accumulation buffers in backward), and
    rounded once less. float32 and float64 (CPU runs, evaluation, the checks against exported and reference code)
    keep the expression, bit for bit what the Hugging Face file computes. Under torch.compile the expression is
    traced: inductor fuses it into one kernel either way."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if eager_kernels(x):
        return _Rotation.apply(x, cos, sin, transpose)
    return _rotation_expression(x, cos, sin, transpose)


def eager_kernels(x: torch.Tensor) -> bool:
    """Whether a position transform of x takes its eager autograd function (the rotation here, the CoCA transforms in
    ``position``): bf16/fp16, and not while torch.compile traces (inductor fuses the plain expressions itself)."""
    return x.dtype in FUSED_ROTATION_DTYPES and not torch.compiler.is_compiling()


def _rotation_expression(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transpose: bool) -> torch.Tensor:
    r = cos.shape[-1]
    if transpose:
        sin = -sin  # R^T pairs (a, b) -> (a cos + b sin, b cos - a sin)
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :r], x[..., r:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


def empty_like_layout(x: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of x's shape and dtype with x's order of strides (x may be a slice of a fused
    projection; an elementwise operator's output would follow its layout the same way)."""
    order = sorted(range(x.dim()), key=lambda dim: -x.stride(dim))  # outermost dimension first
    return torch.empty_permuted(x.shape, order, dtype=x.dtype, device=x.device)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, transpose: bool) -> torch.Tensor:
    """R x (R^T x): (x1 cos - x2 sin, x2 cos + x1 sin) over the rotary pairs (signs of sin flipped for R^T), each
    half written by a multiply into the output and an in-place multiply-add; pass-through dims copied."""
    r = cos.shape[-1]
    half = r // 2
    sign = 1.0 if transpose else -1.0
    out = empty_like_layout(x)
    x1, x2, out1, out2 = x[..., :half], x[..., half:r], out[..., :half], out[..., half:r]
    torch.mul(x1, cos[..., :half], out=out1).addcmul_(x2, sin[..., :half], value=sign)
    torch.mul(x2, cos[..., half:], out=out2).addcmul_(x1, sin[..., half:], value=-sign)
    if r < x.shape[-1]:
        out[..., r:] = x[..., r:]
    return out


class _Rotation(torch.autograd.Function):
    """y = R x (or R^T x); the gradient is the other rotation of the incoming one: R^T g (or R g). Saves only
    the tables."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,  # type: ignore[override]
                transpose: bool) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.transpose = transpose
        return _rotated(x, cos, sin, transpose)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        return _Rotation.apply(grad, cos, sin, not ctx.transpose), None, None, None


def apply_rotary(x_BHTD: torch.Tensor, tables: RotaryTables) -> torch.Tensor:
    """R_n x: rotate the first r dims of every head vector at its position; pass the rest through."""
    return rotate(x_BHTD, tables.cos, tables.sin)
