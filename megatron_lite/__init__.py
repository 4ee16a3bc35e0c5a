"""megatron_lite: compact GPT-NeoX-style pretraining with pluggable position schemes."""

__version__ = "0.1.0"
