"""The decoder: embedding, blocks of one family, final norm, LM head.

Two block families (``model.architecture``):
  gpt_neox  LayerNorm, fused per-head QKV with biases, GELU MLP, (optionally parallel) residual;
            names mirror HF GPTNeoX (layers.N.attention.query_key_value, layers.N.mlp.dense_h_to_4h, ...).
  llama     RMSNorm, q/k/v/o projections with grouped-query heads, SwiGLU MLP, sequential residual;
            names mirror HF Llama inside a block (layers.N.self_attn.q_proj, layers.N.mlp.gate_proj, ...).
Both share the top level (embed_in, final_layer_norm, lm_head), so conversion renames a prefix. The model
never branches on the position scheme: it asks the scheme for an embedding and hands it to every layer.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron_lite.config import Config, ModelConfig, RopeScalingConfig, TrainConfig
from megatron_lite.model.attention import LlamaAttention, SelfAttention
from megatron_lite.model.context import PositionContext, build_context
from megatron_lite.model.kv_cache import KVCache, LayerCache
from megatron_lite.model.loss import LMHead
from megatron_lite.model.position import PositionScheme, build_position_scheme, build_rotary
from megatron_lite.model.rope import RotaryEmbedding
from megatron_lite.model.sequence_parallel import SequenceParallel

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}

# The projections that write into the residual stream (GPT-NeoX's wang_init applies to them).
RESIDUAL_OUTPUT_WEIGHTS = ("attention.dense.weight", "mlp.dense_4h_to_h.weight", "self_attn.o_proj.weight",
                           "mlp.down_proj.weight")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.ffn_size)
        self.dense_4h_to_h = nn.Linear(config.ffn_size, config.hidden_size)
        self.activation = ACTIVATIONS[config.activation]

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.activation(self.dense_h_to_4h(x_BTC)))


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back before the weight (HF LlamaRMSNorm)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        x32 = x_BTC.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x_BTC.dtype)


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), no biases (HF LlamaMLP)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.ffn_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.ffn_size, bias=False)
        self.down_proj = nn.Linear(config.ffn_size, config.hidden_size, bias=False)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x_BTC)) * self.up_proj(x_BTC))


class LlamaBlock(nn.Module):
    """x + attn(norm1(x)), then + mlp(norm2(.)) (pre-norm, sequential residual)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.layernorm_epsilon)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.layernorm_epsilon)
        self.self_attn = LlamaAttention(config)
        self.mlp = GatedMLP(config)
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)

    def forward(
        self, x_BTC: torch.Tensor, scheme: PositionScheme, ctx: PositionContext, cache: LayerCache | None = None
    ) -> torch.Tensor:
        x_BTC = x_BTC + self.hidden_dropout(self.self_attn(self.input_layernorm(x_BTC), scheme, ctx, cache))
        return x_BTC + self.hidden_dropout(self.mlp(self.post_attention_layernorm(x_BTC)))


class GPTNeoXBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.parallel_residual = config.gpt_j_residual
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.attention = SelfAttention(config)
        self.mlp = MLP(config)
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)

    def forward(
        self, x_BTC: torch.Tensor, scheme: PositionScheme, ctx: PositionContext, cache: LayerCache | None = None
    ) -> torch.Tensor:
        attn_BTC = self.hidden_dropout(self.attention(self.input_layernorm(x_BTC), scheme, ctx, cache))
        if self.parallel_residual:
            # x + attn(ln1(x)) + mlp(ln2(x))
            return x_BTC + attn_BTC + self.hidden_dropout(self.mlp(self.post_attention_layernorm(x_BTC)))
        x_BTC = x_BTC + attn_BTC
        return x_BTC + self.hidden_dropout(self.mlp(self.post_attention_layernorm(x_BTC)))


class GPT(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_in = nn.Embedding(config.padded_vocab_size, config.hidden_size)
        self.position = build_position_scheme(config)
        block = LlamaBlock if config.is_llama else GPTNeoXBlock
        self.layers = nn.ModuleList(block(config) for _ in range(config.num_layers))
        self.final_layer_norm: nn.Module = (RMSNorm(config.hidden_size, config.layernorm_epsilon) if config.is_llama
                                            else nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon))
        self.lm_head = LMHead(config.hidden_size, config.padded_vocab_size)
        self.sequence_parallel: SequenceParallel | None = None  # enable_sequence_parallel
        # compile_model's regional mode with blocks_per_region > 1: consecutive blocks run as one compiled region
        self.block_group_runner: Callable[..., torch.Tensor] | None = None
        self.blocks_per_region = 1
        if not config.no_weight_tying:
            self.lm_head.weight = self.embed_in.weight
        self.reset_parameters()

    # ------------------------------------------------------------------------------------------
    def _init_std(self, method: str) -> float:
        hidden, layers = self.config.hidden_size, self.config.num_layers
        if method == "small_init":
            return math.sqrt(2.0 / (5.0 * hidden))
        if method == "wang_init":
            return 2.0 / (layers * math.sqrt(hidden))
        return self.config.init_method_std

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-NeoX init: small_init for input-side weights, wang_init for residual outputs (both families)."""
        input_std = self._init_std(self.config.init_method)
        output_std = self._init_std(self.config.output_layer_init_method)
        for name, parameter in self.named_parameters():
            if name.endswith("bias"):
                parameter.zero_()
            elif "layernorm" in name or "layer_norm" in name:
                parameter.fill_(1.0)
            elif name.endswith(RESIDUAL_OUTPUT_WEIGHTS):
                parameter.normal_(0.0, output_std)
            else:
                parameter.normal_(0.0, input_std)

    @property
    def rotary(self) -> RotaryEmbedding | None:
        """The position scheme's rotary embedding (rope, coca), None for other schemes."""
        return self.position.rotary

    def set_rope_scaling(self, scaling: RopeScalingConfig) -> None:
        """Switch the inference-time RoPE scaling (rope and coca); ValueError for other schemes. The model
        gets its own copy of the config: a config shared with other models or a caller stays unchanged."""
        if not self.config.uses_rotary:
            raise ValueError(f"RoPE scaling {scaling.type!r} needs a rotary scheme, model uses {self.config.position.scheme!r}")
        config = copy.deepcopy(self.config)
        config.position.scaling = scaling
        self.config = config
        self.position.rotary = build_rotary(config)

    def use_loss_settings(self, train: TrainConfig) -> None:
        """The LM head's loss as ``train`` sets it (``train.fused_loss``, ``train.loss_gemm``): the training engine
        and every benchmark that times a config's training step."""
        self.lm_head.fused, self.lm_head.gemm = train.fused_loss, train.loss_gemm

    def enable_sequence_parallel(self, group: torch.distributed.ProcessGroup) -> None:
        """Train with DeepSpeed-Ulysses sequence parallelism over ``group`` (model/sequence_parallel.py): each
        forward takes whole (B, T) sequences and returns their mean loss, computing this rank's T/P tokens."""
        self.sequence_parallel = SequenceParallel(group, self.config.num_attention_heads, self.config.kv_heads)

    def new_cache(self, max_length: int) -> KVCache:
        return KVCache(self.config.num_layers, max_length)

    # ------------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids_BT: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        rope_length: int | None = None,
        logits_from: int = 0,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (B, T - logits_from, padded_vocab): the positions from ``logits_from`` on; with ``labels``
        (B, T - logits_from), already shifted, the mean float32 cross entropy instead (``lm_head.fused``:
        chunked, the logits never whole).

        positions: (T,) ascending; default continues after what ``cache`` holds.
        rope_length: length that fixes the dynamic-NTK base; default the cache's max_length
        (the final length of a generation) or, without a cache, the last position + 1.
        logits_from: skip the LM head before this position; evaluation and decoding need only a
        suffix, and the (T, V) head output is the largest activation at long windows.
        With sequence parallelism (``enable_sequence_parallel``) the call takes whole sequences and labels
        and returns their mean loss; this rank computes its T/P tokens.
        """
        parallel = self.sequence_parallel
        if parallel is not None and (labels is None or logits_from):
            raise ValueError("sequence parallelism: the forward returns the loss of whole sequences only "
                             "(labels, logits_from=0); evaluate or generate with a model without it")
        ctx = build_context(self.position, self.config.attention, input_ids_BT, positions,
                            cache.cached_positions() if cache is not None else None, rope_length,
                            cache.max_length if cache is not None else None, self.embed_in.weight.dtype,
                            sequence_parallel=parallel)
        all_labels_BT = labels
        if ctx.shard is not None:  # (B, T) -> (B, T/P): this rank's tokens (model/sequence_parallel.py)
            input_ids_BT, labels = ctx.shard.local(input_ids_BT), ctx.shard.local(labels)

        output = self.decode(input_ids_BT, ctx, cache, logits_from, labels)
        if parallel is not None:
            assert labels is not None and all_labels_BT is not None
            return parallel.sequence_loss(output, labels, all_labels_BT)
        return output

    def decode(self, input_ids_BT: torch.Tensor, ctx: PositionContext, cache: KVCache | None, logits_from: int,
               labels: torch.Tensor | None) -> torch.Tensor:
        """Embedding, blocks, final norm and head over a built context: logits, or the loss with labels. The
        part ``compile_model``'s whole mode compiles as one graph, so the context's tables come in as inputs."""
        x_BTC = self.embed_in(input_ids_BT)
        position_embedding = self.position.embed(ctx.positions, ctx.last_position)
        if position_embedding is not None:
            x_BTC = x_BTC + position_embedding.to(x_BTC.dtype)
        recompute = self.config.checkpoint_activations and self.training and cache is None
        runner = self.block_group_runner
        if runner is not None and cache is None:  # a KV cache (generation) runs block by block, eagerly
            size, blocks = self.blocks_per_region, tuple(self.layers)  # a ModuleList's slice is a new ModuleList
            for start in range(0, len(blocks), size):
                group = blocks[start:start + size]  # any group of blocks: one graph for all
                if recompute:
                    x_BTC = checkpoint(runner, group, x_BTC, self.position, ctx, use_reentrant=False)
                else:
                    x_BTC = runner(group, x_BTC, self.position, ctx)
            return self.lm_head(self.final_layer_norm(x_BTC[:, logits_from:]), labels)
        for index, layer in enumerate(self.layers):
            layer_cache = cache.layers[index] if cache is not None else None
            if recompute:
                x_BTC = checkpoint(layer, x_BTC, self.position, ctx, None, use_reentrant=False)
            else:
                x_BTC = layer(x_BTC, self.position, ctx, layer_cache)
        return self.lm_head(self.final_layer_norm(x_BTC[:, logits_from:]), labels)


def run_block_group(blocks: tuple[nn.Module, ...], x_BTC: torch.Tensor, position: PositionScheme,
                    ctx: PositionContext) -> torch.Tensor:
    """Consecutive blocks, (B, T, C) -> (B, T, C): the region ``compile_model`` compiles when it groups blocks.
    Every group calls this one function with blocks of one class, so dynamo compiles it once for them all (the
    blocks' parameters are inputs of the graph, not constants)."""
    for block in blocks:
        x_BTC = block(x_BTC, position, ctx, None)
    return x_BTC


def language_model_loss(logits_BTV: torch.Tensor, labels_BT: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token cross entropy in float32 (labels already shifted to align with logits)."""
    return F.cross_entropy(
        logits_BTV.reshape(-1, logits_BTV.shape[-1]).float(), labels_BT.reshape(-1), ignore_index=ignore_index
    )


def build_model(config: Config, device: torch.device | str = "cpu") -> GPT:
    """Seeded construction in the configured precision."""
    torch.manual_seed(config.seed)
    with torch.device(device):
        model = GPT(config.model)
    return model.to(DTYPES[config.precision])
