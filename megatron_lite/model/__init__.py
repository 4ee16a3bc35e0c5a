"""Model core: GPT-NeoX blocks, position schemes, rotary scalings, attention kernels, KV cache."""

from megatron_lite.model.gpt import GPT, build_model, language_model_loss
from megatron_lite.model.kv_cache import KVCache

__all__ = ["GPT", "KVCache", "build_model", "language_model_loss"]
