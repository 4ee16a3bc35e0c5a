"""torch.compile for the decoder: the repeated block once (regional), or the whole model as one graph.

``regional`` compiles each transformer block in place (``block.compile()``): the blocks share one class and
so one code object, which dynamo traces and inductor compiles once and then reuses for every layer (PyTorch's
regional-compilation recipe, torchtitan's ``apply_compile``). The first step's compile time stops growing with
the depth. With ``blocks_per_region`` K > 1, K consecutive blocks are one region instead (one function over a
tuple of blocks, compiled once for every group). The LM head (with labels: the fused chunked loss) is compiled as
its own region too: its GEMMs are cuBLAS calls either way, but the elementwise passes over each (chunk, V) block
of float32 logits fuse (on CPU its forward + backward ran 1.6x faster compiled). The embedding and the
per-forward context (rotary tables, masks) run eagerly.

``whole`` compiles ``model.decode`` (embedding, every block, final norm, head) as one graph, which fuses across
block boundaries, at a compile time that grows with the number of layers. The per-forward context is built
eagerly around it, so the rotary tables enter the graph as inputs: traced inside it (``model.compile()``), the
float64 cos/sin were recomputed by every layer's fused kernels, per activation element (profile of 2026-11-26).

Both compile in place, so state-dict keys stay as they are (no ``_orig_mod.`` prefix) and checkpoints move
freely between compiled and eager runs. Either can launch each graph's kernels from Python (inductor's default
wrapper) or from generated C++ (``cpp_wrapper``), replay them as CUDA graphs (``cuda_graphs``), and take any
other inductor setting (``inductor``, train.compile_options).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from torch import nn

CompileMode = Literal["regional", "whole"]
COMPILE_MODES: tuple[str, ...] = ("regional", "whole")


def inductor_mode(cuda_graphs: bool, max_autotune: bool) -> str | None:
    """torch.compile's ``mode`` for inductor's CUDA graphs and its GEMM autotuning (None: the default)."""
    if max_autotune:
        return "max-autotune" if cuda_graphs else "max-autotune-no-cudagraphs"
    return "reduce-overhead" if cuda_graphs else None


# inductor settings that the loop's own keys own: set through those, which also keep the loop fit for them
OWNED_INDUCTOR_SETTINGS = {"triton.cudagraphs": "train.cuda_graphs", "cpp_wrapper": "train.compile_cpp_wrapper"}


def inductor_settings(settings: Mapping[str, Any], where: str = "train.compile_options") -> dict[str, Any]:
    """``settings`` (torch._inductor.config names, nested or dotted: ``{"triton": {"mix_order_reduction":
    False}}`` or ``{"triton.mix_order_reduction": False}``) as torch.compile's flat ``options``, each name
    checked against the installed torch's inductor (a ValueError naming it, with the nearest names)."""
    import difflib

    from torch._inductor import config as inductor_config

    flat: dict[str, Any] = {}
    pending = [("", dict(settings))]
    while pending:
        prefix, mapping = pending.pop()
        for key, value in mapping.items():
            name = f"{prefix}{key}"
            if isinstance(value, Mapping):
                pending.append((f"{name}.", dict(value)))
            else:
                flat[name] = value
    known = inductor_config.get_config_copy()
    for name, value in flat.items():
        if name in OWNED_INDUCTOR_SETTINGS:
            raise ValueError(f"{where}.{name}: set {OWNED_INDUCTOR_SETTINGS[name]} instead")
        if name not in known:
            near = difflib.get_close_matches(name, list(known), n=3)
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            raise ValueError(f"{where}.{name}: not an inductor setting of torch {torch.__version__}{hint}")
        if isinstance(known[name], bool) and not isinstance(value, bool):
            raise ValueError(f"{where}.{name}={value!r}: must be true or false")
    return flat


def compile_options(cuda_graphs: bool = False, max_autotune: bool = False, cpp_wrapper: bool = False,
                    inductor: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """torch.compile's keyword arguments: its ``mode`` alone, or, with ``cpp_wrapper`` or ``inductor``
    settings (``inductor_settings``), that mode's inductor options with them (torch.compile takes a mode or
    options, never both)."""
    mode = inductor_mode(cuda_graphs, max_autotune)
    settings = {**inductor_settings(inductor or {}), **({"cpp_wrapper": True} if cpp_wrapper else {})}
    if not settings:
        return {"mode": mode} if mode else {}
    from torch._inductor import list_mode_options

    return {"options": {**(list_mode_options(mode) if mode else {}), **settings}}  # None lists every mode


def compile_model(model: nn.Module, mode: CompileMode = "regional", backend: str | Callable[..., Any] = "inductor",
                  cuda_graphs: bool = False, max_autotune: bool = False, cpp_wrapper: bool = False,
                  inductor: Mapping[str, Any] | None = None, blocks_per_region: int = 1) -> None:
    """Compile ``model`` (a ``GPT``) in place: each of ``model.layers`` and its ``lm_head`` (``regional``), or
    ``model.decode`` (``whole``). ``backend``: torch.compile's (tests pass one that records the graphs).
    ``cuda_graphs``: inductor's CUDA graphs (torch.compile's ``mode="reduce-overhead"``) for each compiled graph,
    so that a region's kernels replay from one launch (train.cuda_graphs; the GPU check's ``regional-cudagraphs``
    rows). A loop that drives them starts each step with ``torch.compiler.cudagraph_mark_step_begin`` and keeps no
    compiled output past the next replay (training/step.py). ``max_autotune``: inductor benchmarks Triton GEMM
    templates against cuBLAS for each GEMM and fuses elementwise epilogues (bias, GELU) into the Triton ones it
    keeps, at minutes of compile time (the GPU check's ``-max-autotune`` rows; a measurement only).
    ``cpp_wrapper``: inductor's C++ wrapper (train.compile_cpp_wrapper): each graph's kernels and library calls
    launched from generated C++ instead of generated Python, less host time per kernel for steps whose GPU waits
    on the host, at the cost of a C++ build of each graph in the first step. ``inductor``: more of inductor's
    settings (train.compile_options; ``inductor_settings``). ``blocks_per_region`` (regional only, a divisor
    of the depth; train.compile_blocks_per_region): that many consecutive blocks compiled as one region
    (``gpt.run_block_group``), one graph for every group: fewer region calls per step (each costs the host its
    guards and wrappers, ~60 µs on a CPU) and fusion across the blocks inside a region, for a compile that grows
    with the group."""
    options = compile_options(cuda_graphs, max_autotune, cpp_wrapper, inductor)
    if blocks_per_region != 1 and mode != "regional":
        raise ValueError(f"blocks_per_region={blocks_per_region}: only for compile mode 'regional', not {mode!r}")
    if mode == "whole":
        decode = getattr(model, "decode", None)
        if decode is None:
            raise ValueError(f"compile mode 'whole': {type(model).__name__} has no .decode to compile")
        # an instance attribute shadowing the method: the state-dict keys stay as they are
        model.decode = torch.compile(decode, backend=backend, **options)  # type: ignore[method-assign]
        return
    if mode != "regional":
        raise ValueError(f"compile mode {mode!r}: must be one of {', '.join(COMPILE_MODES)}")
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"compile mode 'regional': {type(model).__name__} has no .layers to compile one by one")
    if blocks_per_region == 1:
        for layer in layers:
            layer.compile(backend=backend, **options)
    else:
        if not hasattr(model, "block_group_runner"):
            raise ValueError(f"blocks_per_region={blocks_per_region}: {type(model).__name__} runs no block groups")
        if blocks_per_region < 1 or len(layers) % blocks_per_region:
            raise ValueError(f"blocks_per_region={blocks_per_region}: must divide the {len(layers)} layers")
        from megatron_lite.model.gpt import run_block_group

        model.blocks_per_region = blocks_per_region
        model.block_group_runner = torch.compile(run_block_group, backend=backend, **options)
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Module):
        head.compile(backend=backend, **options)
