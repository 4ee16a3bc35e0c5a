"""torch.compile for the decoder: the repeated block once (regional), or the whole model as one graph.

``regional`` compiles each transformer block in place (``block.compile()``): the blocks share one class and
so one code object, which dynamo traces and inductor compiles once and then reuses for every layer (PyTorch's
regional-compilation recipe, torchtitan's ``apply_compile``). The first step's compile time stops growing with
the depth. The embedding, the per-forward context (rotary tables, masks) and the fused loss head run eagerly
between the compiled blocks; the loss head's GEMMs are the bulk of its time and are cuBLAS calls either way.

``whole`` is ``model.compile()``: one graph for the model's call, which fuses across block boundaries and
the loss head's elementwise work, at a compile time that grows with the number of layers.

Both compile in place, so state-dict keys stay as they are (no ``_orig_mod.`` prefix) and checkpoints move
freely between compiled and eager runs.
"""

from __future__ import annotations

from typing import Literal

from torch import nn

CompileMode = Literal["regional", "whole"]
COMPILE_MODES: tuple[str, ...] = ("regional", "whole")


def compile_model(model: nn.Module, mode: CompileMode = "regional") -> None:
    """Compile ``model`` (a ``GPT``) in place: each of ``model.layers`` (``regional``) or its whole call."""
    if mode == "whole":
        model.compile()
        return
    if mode != "regional":
        raise ValueError(f"compile mode {mode!r}: must be one of {', '.join(COMPILE_MODES)}")
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"compile mode 'regional': {type(model).__name__} has no .layers to compile one by one")
    for layer in layers:
        layer.compile()
