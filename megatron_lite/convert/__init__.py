"""Checkpoint conversion: DeepSpeed <-> consolidated safetensors <-> Hugging Face (docs/conversion.md)."""

from megatron_lite.convert.conversion import (
    TARGETS,
    ConversionResult,
    LoadedCheckpoint,
    convert_checkpoint,
    read_checkpoint,
    rope_to_coca,
)
from megatron_lite.convert.hf_export import export_hf
from megatron_lite.convert.hf_import import import_hf

__all__ = ["TARGETS", "ConversionResult", "LoadedCheckpoint", "convert_checkpoint", "export_hf", "import_hf", "read_checkpoint", "rope_to_coca"]
