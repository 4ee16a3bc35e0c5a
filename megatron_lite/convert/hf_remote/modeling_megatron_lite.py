"""megatron_lite models for Hugging Face transformers (remote code, self-contained).

Copied next to the weights by ``tools/convert_checkpoint.py --to hf`` for the position schemes the
stock ``GPTNeoXForCausalLM`` / ``LlamaForCausalLM`` cannot express (CoCA, ALiBi, learned,
sinusoidal; for Llama also partial rotary and our scalings); load it with
``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)``. It needs only torch and
transformers >= 5: the receiver does not need megatron_lite. Two families:

* ``MegatronLiteForCausalLM`` (config ``MegatronLiteConfig``): GPT-NeoX (fused per-head
  ``[q | k-or-t | v]`` projection, parallel residual, LayerNorm, untied head by default) with the tensor
  names ``GPTNeoXForCausalLM.save_pretrained`` writes (``gpt_neox.embed_in``, ``gpt_neox.layers.N.*``,
  ``gpt_neox.final_layer_norm``, ``embed_out``).
* ``MegatronLiteLlamaForCausalLM`` (config ``MegatronLiteLlamaConfig``): Llama (RMSNorm, q/k/v/o
  projections with grouped-query heads and an explicit ``head_dim``, q/k/v biases with ``qkv_bias`` as
  Qwen2, SwiGLU MLP, sequential residual) with HF Llama's names (``model.embed_tokens``,
  ``model.layers.N.self_attn.q_proj``, ``model.norm``, ``lm_head``). CoCA's T comes from ``k_proj``, one
  per key/value head.

A position scheme turns per-head projections into what one ordinary attention kernel (SDPA) consumes:

| scheme        | q'          | k'        | bias                      |
|---------------|-------------|-----------|---------------------------|
| none          | q           | k         | -                         |
| learned/sin.  | q           | k         | - (added to embeddings)   |
| alibi         | q           | k         | -slope_h * (m - n)        |
| rope          | R_m q       | R_n k     | -                         |
| coca slack    | q * R_m q   | R_n t     | -                         |
| coca strict   | R_m u       | R_n w     | -                         |

R_n rotates pairs (i, i + r/2) of the first r = head_dim * partial_rotary_factor dims (GPT-NeoX
"rotate_half"). CoCA (arXiv 2309.08646): the K slot yields t_raw, c_i = relu((t_i + t_{i+r/2}) / 2)
per rotary pair (pass-through dims are paired among themselves). Slack's score (q * R_m q).(R_n t)
is the paper's Eq. 11; strict's (R_m u).(R_n w) with u_j = |q_pair_j|^2, w_j = c_j and zeros in
the second half of each pair is Eq. 10 via Eq. 18. The KV cache holds (k', v).

RoPE scalings (``rope_parameters.rope_type``): default, linear, dynamic (HF dynamic NTK: the base
grows with the sequence length beyond ``max_position_embeddings``), yarn and llama3 (Llama-3.1). With a
KV cache the dynamic base is fixed for the whole generation from its final length (``generate`` passes
it as ``rope_length``), so cached keys never carry a stale base (HF issue #25104).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_megatron_lite import MegatronLiteConfig, MegatronLiteLlamaConfig

AnyConfig = MegatronLiteConfig | MegatronLiteLlamaConfig

ROTARY_SCHEMES = ("rope", "coca")
ROPE_LENGTH_ATTRIBUTE = "megatron_lite_rope_length"  # set on a Cache: the length that fixes the dynamic base


# ----------------------------------------------------------------------------------------------
# Rotary frequencies and scalings (float64 angles, float32 tables)


def head_dim_of(config: AnyConfig) -> int:
    """Llama configs name it (possibly != hidden / heads); GPT-NeoX configs have no such field."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rotary_dims(config: AnyConfig) -> int:
    return int(head_dim_of(config) * config.rope_parameters.get("partial_rotary_factor", 1.0))


def base_inverse_frequencies(dims: int, base: float) -> torch.Tensor:
    """theta_i = base^(-2i/r), i < r/2, float64 (r/2,)."""
    return 1.0 / (base ** (torch.arange(0, dims, 2, dtype=torch.float64) / dims))


def yarn_inverse_frequencies(config: AnyConfig, dims: int, base: float, factor: float) -> tuple[torch.Tensor, float]:
    """NTK-by-parts blend of interpolated and extrapolated frequencies (HF _compute_yarn_parameters)."""
    params = config.rope_parameters
    original = params.get("original_max_position_embeddings") or config.max_position_embeddings
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return dims * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):  # HF's default: the range in whole dims
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dims // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    position_frequencies = base ** (torch.arange(0, dims, 2, dtype=torch.float64) / dims)
    inverse = (1.0 / (factor * position_frequencies)) * ramp + (1.0 / position_frequencies) * (1 - ramp)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return inverse, float(attention_factor)


def llama3_inverse_frequencies(config: AnyConfig, dims: int, base: float, factor: float) -> torch.Tensor:
    """Llama-3.1 (HF _compute_llama3_parameters, in float64): wavelengths longer than original /
    low_freq_factor are divided by factor, shorter than original / high_freq_factor kept, blended between."""
    params = config.rope_parameters
    original = params.get("original_max_position_embeddings") or config.max_position_embeddings
    low_freq_factor = float(params.get("low_freq_factor", 1.0))
    high_freq_factor = float(params.get("high_freq_factor", 4.0))
    inverse = base_inverse_frequencies(dims, base)
    wavelength = 2 * math.pi / inverse
    scaled = torch.where(wavelength > original / low_freq_factor, inverse / factor, inverse)
    smooth = (original / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= original / high_freq_factor) & (wavelength <= original / low_freq_factor)
    return torch.where(medium, blended, scaled)


def inverse_frequencies(config: AnyConfig, seq_len: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float64, (r/2,)) and attention factor for a sequence of seq_len tokens."""
    params = config.rope_parameters
    kind, base, dims = params.get("rope_type", "default"), float(params["rope_theta"]), rotary_dims(config)
    factor = float(params.get("factor") or 1.0)
    if kind == "default":
        return base_inverse_frequencies(dims, base), 1.0
    if kind == "linear":
        return base_inverse_frequencies(dims, base) / factor, 1.0
    if kind == "dynamic":
        train_length = config.max_position_embeddings
        if seq_len > train_length:
            base = base * ((factor * seq_len / train_length) - (factor - 1)) ** (dims / (dims - 2))
        return base_inverse_frequencies(dims, base), 1.0
    if kind == "yarn":
        return yarn_inverse_frequencies(config, dims, base, factor)
    if kind == "llama3":
        return llama3_inverse_frequencies(config, dims, base, factor), 1.0
    raise ValueError(f"rope_parameters.rope_type={kind!r}: supported are default, linear, dynamic, yarn, llama3")


def rotary_tables(config: AnyConfig, positions_BT: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (B, 1, T, r) float32 at integer positions (B, T), times the attention factor."""
    inverse, attention_factor = inverse_frequencies(config, seq_len)
    angles = positions_BT.to(torch.float64)[..., None] * inverse.to(positions_BT.device)  # (B, T, r/2)
    angles = torch.cat((angles, angles), dim=-1)  # [theta, theta] layout
    cos = (angles.cos() * attention_factor).to(torch.float32)[:, None]
    sin = (angles.sin() * attention_factor).to(torch.float32)[:, None]
    return cos, sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(x_BHTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """R_n x on the first r = cos.shape[-1] dims; the rest pass through."""
    r = cos.shape[-1]
    cos, sin = cos.to(x_BHTD.dtype), sin.to(x_BHTD.dtype)
    if r == x_BHTD.shape[-1]:
        return x_BHTD * cos + rotate_half(x_BHTD) * sin
    x_rot, x_pass = x_BHTD[..., :r], x_BHTD[..., r:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


# ----------------------------------------------------------------------------------------------
# Position schemes


def pair_coefficients(t_raw: torch.Tensor, dims: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """CoCA: c_i = relu((t_i + t_{i+r/2}) / 2) per rotary pair, and the same over the pass-through dims."""
    half = dims // 2
    c_rot = torch.relu((t_raw[..., :half] + t_raw[..., half:dims]) * 0.5)
    if t_raw.shape[-1] == dims:
        return c_rot, None
    rest = t_raw[..., dims:]
    rest_half = rest.shape[-1] // 2
    return c_rot, torch.relu((rest[..., :rest_half] + rest[..., rest_half:]) * 0.5)


def transform_query(config: AnyConfig, q_BHTD: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
    scheme = config.position_scheme
    if scheme not in ROTARY_SCHEMES:
        return q_BHTD
    assert cos is not None and sin is not None
    if scheme == "rope":
        return rotate(q_BHTD, cos, sin)
    if config.coca_constraint == "slack":
        return q_BHTD * rotate(q_BHTD, cos, sin)  # q * R_m q
    dims = cos.shape[-1]
    half = dims // 2
    q_first, q_second = q_BHTD[..., :half], q_BHTD[..., half:dims]
    pair_norm2 = q_first * q_first + q_second * q_second  # (B, H, T, r/2): u_j = |q_pair_j|^2
    parts = [pair_norm2 * cos[..., :half].to(q_BHTD.dtype), pair_norm2 * sin[..., :half].to(q_BHTD.dtype)]  # R_m [u, 0]
    if q_BHTD.shape[-1] > dims:
        q_pass = q_BHTD[..., dims:]
        parts.append(q_pass * q_pass)
    return torch.cat(parts, dim=-1)


def transform_key(config: AnyConfig, k_BHTD: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
    scheme = config.position_scheme
    if scheme not in ROTARY_SCHEMES:
        return k_BHTD
    assert cos is not None and sin is not None
    if scheme == "rope":
        return rotate(k_BHTD, cos, sin)
    dims = cos.shape[-1]
    half = dims // 2
    c_rot, c_pass = pair_coefficients(k_BHTD, dims)  # (B, H, T, r/2)
    cos_half, sin_half = cos[..., :half].to(c_rot.dtype), sin[..., :half].to(c_rot.dtype)
    if config.coca_constraint == "slack":
        parts = [c_rot * (cos_half - sin_half), c_rot * (cos_half + sin_half)]  # R_n [c, c]
    else:
        parts = [c_rot * cos_half, c_rot * sin_half]  # R_n [c, 0]
    if c_pass is not None:
        parts += [c_pass, c_pass]
    return torch.cat(parts, dim=-1)


def alibi_slopes(num_heads: int) -> list[float]:
    """Press et al. head slopes, including non-power-of-2 head counts."""

    def power_of_two_slopes(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (h + 1) for h in range(n)]

    if math.log2(num_heads).is_integer():
        return power_of_two_slopes(num_heads)
    closest = 2 ** math.floor(math.log2(num_heads))
    return power_of_two_slopes(closest) + alibi_slopes(2 * closest)[0::2][: num_heads - closest]


def sinusoidal_embedding(positions_BT: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """Vaswani et al.: sin on even, cos on odd dims; (B, T, hidden) float32."""
    dims = torch.arange(0, hidden_size, 2, dtype=torch.float64, device=positions_BT.device)
    angles = positions_BT.to(torch.float64)[..., None] / (10000.0 ** (dims / hidden_size))
    table = torch.zeros(*positions_BT.shape, hidden_size, dtype=torch.float64, device=positions_BT.device)
    table[..., 0::2] = angles.sin()
    table[..., 1::2] = angles.cos()[..., : hidden_size // 2]
    return table.to(torch.float32)


def attention_mask_for(
    config: AnyConfig,
    query_length: int,
    past_length: int,
    padding_mask_BS: torch.Tensor | None,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor | None:
    """None (plain causal: the kernel's own path), a bool (B|1, 1, T, S) mask, or with ALiBi a float
    (B|1, H, T, S) bias -slope_h * (m - n) with -inf where a key is hidden. Indices are cache slots,
    so left padding only adds a per-row constant to the ALiBi bias, which softmax ignores."""
    key_length = past_length + query_length
    alibi = config.position_scheme == "alibi"
    if padding_mask_BS is not None and bool(padding_mask_BS.all()):
        padding_mask_BS = None
    if not alibi and padding_mask_BS is None and (past_length == 0 or query_length == 1):
        return None
    q_index = torch.arange(past_length, key_length, device=device)
    k_index = torch.arange(key_length, device=device)
    allowed = (k_index[None, :] <= q_index[:, None])[None, None]  # (1, 1, T, S)
    if padding_mask_BS is not None:
        # Padded keys are hidden; a padded query still sees itself so its row stays finite.
        allowed = allowed & padding_mask_BS[:, None, None, :key_length].bool()
        allowed = allowed | (k_index[None, :] == q_index[:, None])[None, None]
    if not alibi:
        return allowed
    slopes_H = torch.tensor(alibi_slopes(config.num_attention_heads), dtype=torch.float32, device=device)
    # float32 at least: bf16 holds integers exactly only up to 256, so distances 300 and 301 would share a bias
    bias_dtype = torch.promote_types(dtype, torch.float32)
    distance = (k_index[None, :] - q_index[:, None]).to(bias_dtype)  # n - m <= 0 where visible
    bias = slopes_H.to(bias_dtype)[:, None, None] * distance[None]  # (H, T, S)
    return bias[None].masked_fill(~allowed, float("-inf"))


# ----------------------------------------------------------------------------------------------
# What both families' forward and generate share


def prepare_positions(
    config: AnyConfig,
    x_BTC: torch.Tensor,
    position_ids: torch.LongTensor | None,
    past_key_values: Cache | None,
    use_cache: bool | None,
    rope_length: int | None,
) -> tuple[Cache | None, int, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """(cache, cached length, positions (B, T), rotary cos/sin or None) of one forward.

    rope_length: the length that fixes the dynamic-NTK base. Default: a cache's stored value (set by its
    first forward), else the last position + 1 (the full-sequence forward)."""
    batch, length = x_BTC.shape[:2]
    use_cache = config.use_cache if use_cache is None else use_cache
    if use_cache and past_key_values is None:
        past_key_values = DynamicCache(config=config)
    past_length = past_key_values.get_seq_length() if past_key_values is not None else 0
    if position_ids is None:
        position_ids = torch.arange(past_length, past_length + length, device=x_BTC.device)[None].expand(batch, -1)

    rotary = None
    if config.position_scheme in ROTARY_SCHEMES:
        if rope_length is None and past_key_values is not None:
            rope_length = getattr(past_key_values, ROPE_LENGTH_ATTRIBUTE, None)
        if rope_length is None:
            rope_length = int(position_ids.max()) + 1
        if past_key_values is not None and getattr(past_key_values, ROPE_LENGTH_ATTRIBUTE, None) is None:
            setattr(past_key_values, ROPE_LENGTH_ATTRIBUTE, rope_length)
        rotary = rotary_tables(config, position_ids, rope_length)
    return past_key_values, past_length, position_ids, rotary


def absolute_position_embedding(
    config: AnyConfig, positions_BT: torch.Tensor, table: nn.Embedding | None
) -> torch.Tensor | None:
    """The (B, T, hidden) embedding added to the tokens' (learned, sinusoidal); None for other schemes."""
    scheme = config.position_scheme
    if scheme == "learned":
        assert table is not None
        limit = table.num_embeddings
        if positions_BT.numel() and int(positions_BT.max()) >= limit:
            raise ValueError(f"position {int(positions_BT.max())} is beyond max_position_embeddings={limit} "
                             "of the learned scheme; learned positions cannot extrapolate")
        return table(positions_BT)
    if scheme == "sinusoidal":
        return sinusoidal_embedding(positions_BT, config.hidden_size)
    return None


def causal_lm_loss(logits_BTV: torch.Tensor, labels_BT: torch.LongTensor) -> torch.Tensor:
    """Labels are the inputs; predict token t+1 from position t (float32 cross entropy)."""
    return F.cross_entropy(
        logits_BTV[:, :-1].reshape(-1, logits_BTV.shape[-1]).float(), labels_BT[:, 1:].reshape(-1), ignore_index=-100
    )


def with_rope_length(
    config: AnyConfig, default_settings: GenerationConfig, inputs: torch.Tensor | None,
    generation_config: GenerationConfig | None, kwargs: dict,
) -> dict:
    """generate's kwargs with ``rope_length``: the dynamic-NTK base fixed for the whole generation from
    its final length (prompt + new tokens), so cached keys never carry a stale base (HF #25104)."""
    if config.position_scheme in ROTARY_SCHEMES and config.rope_parameters.get("rope_type") == "dynamic" \
            and kwargs.get("rope_length") is None:
        prompt = inputs if inputs is not None else kwargs.get("input_ids")
        settings = generation_config if generation_config is not None else default_settings
        max_new_tokens = kwargs.get("max_new_tokens", settings.max_new_tokens)
        if prompt is not None and max_new_tokens is not None:
            kwargs["rope_length"] = prompt.shape[-1] + max_new_tokens
        else:
            kwargs["rope_length"] = kwargs.get("max_length", settings.max_length)
    return kwargs


def attend(
    config: AnyConfig,
    q_BHTD: torch.Tensor,
    k_BKTD: torch.Tensor,
    v_BKTD: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor] | None,
    mask: torch.Tensor | None,
    cache: Cache | None,
    layer_idx: int,
    scale: float,
    dropout_p: float,
) -> torch.Tensor:
    """(B, H, T, D) attention output from raw projections; k/v may have H_kv < H (grouped-query) heads,
    k_BKTD is the K slot or CoCA's T. The cache holds the transformed keys k' and v."""
    cos, sin = rotary if rotary is not None else (None, None)
    q_BHTD = transform_query(config, q_BHTD, cos, sin)
    k_BKTD = transform_key(config, k_BKTD, cos, sin)
    if cache is not None:
        k_BKTD, v_BKTD = cache.update(k_BKTD, v_BKTD, layer_idx)
    causal = mask is None and q_BHTD.shape[-2] == k_BKTD.shape[-2] and q_BHTD.shape[-2] > 1
    grouped = k_BKTD.shape[1] != q_BHTD.shape[1]  # SDPA pairs query head h with key/value head h // (H / H_kv)
    dtype = q_BHTD.dtype
    if mask is not None and mask.is_floating_point():  # ALiBi's float32 bias: never rounded to bf16/fp16
        mask = mask.to(torch.promote_types(mask.dtype, dtype))
        if q_BHTD.device.type == "cuda" and dtype != mask.dtype:  # CUDA's kernels take a bias in q's dtype only
            q_BHTD, k_BKTD, v_BKTD = (t.to(mask.dtype) for t in (q_BHTD, k_BKTD, v_BKTD))
    out_BHTD = F.scaled_dot_product_attention(
        q_BHTD, k_BKTD, v_BKTD, attn_mask=mask, is_causal=causal, scale=scale, dropout_p=dropout_p, enable_gqa=grouped
    )
    return out_BHTD.to(dtype)


# ----------------------------------------------------------------------------------------------
# GPT-NeoX family


class MegatronLiteAttention(nn.Module):
    def __init__(self, config: MegatronLiteConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=config.attention_bias)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=config.attention_bias)

    def forward(
        self,
        x_BTC: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | None,
        cache: Cache | None,
    ) -> torch.Tensor:
        batch, length, _ = x_BTC.shape
        # Per-head fused layout: head h owns rows [h*3D, (h+1)*3D) = [q | k-or-t | v].
        qkv = self.query_key_value(x_BTC).view(batch, length, self.num_heads, 3 * self.head_dim)
        q_BHTD, k_BHTD, v_BHTD = qkv.transpose(1, 2).split(self.head_dim, dim=-1)
        dropout_p = self.config.attention_dropout if self.training else 0.0
        out_BHTD = attend(self.config, q_BHTD, k_BHTD, v_BHTD, rotary, mask, cache, self.layer_idx, self.scale,
                          dropout_p)
        return self.dense(out_BHTD.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim))


class MegatronLiteMLP(nn.Module):
    def __init__(self, config: MegatronLiteConfig) -> None:
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.intermediate_size)
        self.dense_4h_to_h = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x_BTC)))


class MegatronLiteLayer(nn.Module):
    def __init__(self, config: MegatronLiteConfig, layer_idx: int) -> None:
        super().__init__()
        self.use_parallel_residual = config.use_parallel_residual
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = MegatronLiteAttention(config, layer_idx)
        self.mlp = MegatronLiteMLP(config)
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)

    def forward(
        self,
        x_BTC: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | None,
        cache: Cache | None,
    ) -> torch.Tensor:
        attn_BTC = self.hidden_dropout(self.attention(self.input_layernorm(x_BTC), rotary, mask, cache))
        if self.use_parallel_residual:  # x + attn(ln1(x)) + mlp(ln2(x))
            return x_BTC + attn_BTC + self.hidden_dropout(self.mlp(self.post_attention_layernorm(x_BTC)))
        x_BTC = x_BTC + attn_BTC
        return x_BTC + self.hidden_dropout(self.mlp(self.post_attention_layernorm(x_BTC)))


class DecoderForward:
    """The decoder forward both families share: embedding (+ absolute positions), blocks, final norm.
    Subclasses name their embedding and final-norm attributes (GPT-NeoX and Llama names differ)."""

    embedding_attribute: str
    final_norm_attribute: str

    def get_input_embeddings(self) -> nn.Embedding:
        return getattr(self, self.embedding_attribute)

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        setattr(self, self.embedding_attribute, value)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        rope_length: int | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """rope_length: the length that fixes the dynamic-NTK base (see ``prepare_positions``)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        x_BTC = self.get_input_embeddings()(input_ids) if inputs_embeds is None else inputs_embeds
        past_key_values, past_length, position_ids, rotary = prepare_positions(
            self.config, x_BTC, position_ids, past_key_values, use_cache, rope_length)
        table = getattr(self, "embed_positions", None)  # learned scheme only
        position_embedding = absolute_position_embedding(self.config, position_ids, table)
        if position_embedding is not None:
            x_BTC = x_BTC + position_embedding.to(x_BTC.dtype)
        mask = attention_mask_for(self.config, x_BTC.shape[1], past_length, attention_mask, x_BTC.dtype, x_BTC.device)
        for layer in self.layers:
            x_BTC = layer(x_BTC, rotary, mask, past_key_values)
        final_norm = getattr(self, self.final_norm_attribute)
        return BaseModelOutputWithPast(last_hidden_state=final_norm(x_BTC), past_key_values=past_key_values)


class CausalLMForward:
    """The LM head, loss and ``generate`` both families share; subclasses name the backbone and head."""

    backbone_attribute: str
    head_attribute: str

    def get_output_embeddings(self) -> nn.Linear:
        return getattr(self, self.head_attribute)

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        setattr(self, self.head_attribute, new_embeddings)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        rope_length: int | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        outputs = getattr(self, self.backbone_attribute)(
            input_ids, attention_mask=attention_mask, position_ids=position_ids, past_key_values=past_key_values,
            inputs_embeds=inputs_embeds, use_cache=use_cache, rope_length=rope_length,
        )
        hidden_BTC = outputs.last_hidden_state
        if logits_to_keep:
            hidden_BTC = hidden_BTC[:, -logits_to_keep:]
        logits_BTV = self.get_output_embeddings()(hidden_BTC)
        loss = causal_lm_loss(logits_BTV, labels) if labels is not None else None
        return CausalLMOutputWithPast(loss=loss, logits=logits_BTV, past_key_values=outputs.past_key_values)

    def generate(self, inputs: torch.Tensor | None = None, generation_config: GenerationConfig | None = None, **kwargs):
        """Fix the dynamic-NTK base for the whole generation from its final length (prompt + new tokens)."""
        kwargs = with_rope_length(self.config, self.generation_config, inputs, generation_config, kwargs)
        return super().generate(inputs, generation_config=generation_config, **kwargs)


class MegatronLitePreTrainedModel(PreTrainedModel):
    config_class = MegatronLiteConfig
    config: MegatronLiteConfig
    base_model_prefix = "gpt_neox"
    _no_split_modules = ["MegatronLiteLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True


class MegatronLiteModel(DecoderForward, MegatronLitePreTrainedModel):
    embedding_attribute, final_norm_attribute = "embed_in", "final_layer_norm"

    def __init__(self, config: MegatronLiteConfig) -> None:
        super().__init__(config)
        self.embed_in = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.position_scheme == "learned":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(MegatronLiteLayer(config, index) for index in range(config.num_hidden_layers))
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_init()


class MegatronLiteForCausalLM(CausalLMForward, MegatronLitePreTrainedModel, GenerationMixin):
    backbone_attribute, head_attribute = "gpt_neox", "embed_out"
    # The head is ``embed_out``: the on-disk name GPTNeoXForCausalLM.save_pretrained writes (v4 and v5).
    _tied_weights_keys = {"embed_out.weight": "gpt_neox.embed_in.weight"}

    def __init__(self, config: MegatronLiteConfig) -> None:
        super().__init__(config)
        self.gpt_neox = MegatronLiteModel(config)
        self.embed_out = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


# ----------------------------------------------------------------------------------------------
# Llama family (LLaMA, Mistral without sliding window, Qwen2 with qkv_bias)


class MegatronLiteLlamaRMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back before the weight (HF LlamaRMSNorm)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        x32_BTC = x_BTC.to(torch.float32)
        x32_BTC = x32_BTC * torch.rsqrt(x32_BTC.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x32_BTC.to(x_BTC.dtype)


class MegatronLiteLlamaAttention(nn.Module):
    """q_proj (H heads), k_proj (the K slot or CoCA's T) and v_proj (H_kv heads each), o_proj; biases on
    q/k/v only with ``qkv_bias`` (Qwen2), never on o_proj."""

    def __init__(self, config: MegatronLiteLlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.scale = 1.0 / math.sqrt(self.head_dim)
        query_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, query_width, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_width, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_width, bias=config.qkv_bias)
        self.o_proj = nn.Linear(query_width, config.hidden_size, bias=False)

    def forward(
        self,
        x_BTC: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | None,
        cache: Cache | None,
    ) -> torch.Tensor:
        batch, length, _ = x_BTC.shape
        q_BHTD = self.q_proj(x_BTC).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        k_BKTD = self.k_proj(x_BTC).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v_BKTD = self.v_proj(x_BTC).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        dropout_p = self.config.attention_dropout if self.training else 0.0
        out_BHTD = attend(self.config, q_BHTD, k_BKTD, v_BKTD, rotary, mask, cache, self.layer_idx, self.scale,
                          dropout_p)
        return self.o_proj(out_BHTD.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim))


class MegatronLiteLlamaMLP(nn.Module):
    """SwiGLU: down(act(gate(x)) * up(x)), act = silu for Llama; no biases (mlp_bias is False)."""

    def __init__(self, config: MegatronLiteLlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x_BTC)) * self.up_proj(x_BTC))


class MegatronLiteLlamaLayer(nn.Module):
    """x + attn(norm1(x)), then + mlp(norm2(.)) (pre-norm, sequential residual)."""

    def __init__(self, config: MegatronLiteLlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = MegatronLiteLlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = MegatronLiteLlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MegatronLiteLlamaAttention(config, layer_idx)
        self.mlp = MegatronLiteLlamaMLP(config)

    def forward(
        self,
        x_BTC: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | None,
        cache: Cache | None,
    ) -> torch.Tensor:
        x_BTC = x_BTC + self.self_attn(self.input_layernorm(x_BTC), rotary, mask, cache)
        return x_BTC + self.mlp(self.post_attention_layernorm(x_BTC))


class MegatronLiteLlamaPreTrainedModel(PreTrainedModel):
    config_class = MegatronLiteLlamaConfig
    config: MegatronLiteLlamaConfig
    base_model_prefix = "model"
    _no_split_modules = ["MegatronLiteLlamaLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True


class MegatronLiteLlamaModel(DecoderForward, MegatronLiteLlamaPreTrainedModel):
    embedding_attribute, final_norm_attribute = "embed_tokens", "norm"

    def __init__(self, config: MegatronLiteLlamaConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.position_scheme == "learned":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(MegatronLiteLlamaLayer(config, index) for index in range(config.num_hidden_layers))
        self.norm = MegatronLiteLlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()


class MegatronLiteLlamaForCausalLM(CausalLMForward, MegatronLiteLlamaPreTrainedModel, GenerationMixin):
    backbone_attribute, head_attribute = "model", "lm_head"
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}  # used when tie_word_embeddings

    def __init__(self, config: MegatronLiteLlamaConfig) -> None:
        super().__init__(config)
        self.model = MegatronLiteLlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


__all__ = [
    "MegatronLiteForCausalLM",
    "MegatronLiteLlamaForCausalLM",
    "MegatronLiteLlamaModel",
    "MegatronLiteLlamaPreTrainedModel",
    "MegatronLiteModel",
    "MegatronLitePreTrainedModel",
]
