"""What inductor generates for CUDA for the compiled regions, on a machine without a GPU: the launches that a GPU's
host would make per block and micro batch, predicted from the code itself.

Two passes. On CPU, one transformer block and the LM head (or the whole model) are compiled by inductor's own front
end (``compile_fx``: its decompositions, joint-graph passes and partitioner) with an inner compiler that records the
partitioned forward and backward graphs and runs them eagerly. Each recorded graph is then lowered by inductor for a
CUDA device on fake tensors (``compile_fx_inner``), with the few device queries it makes answered as an H200 would
(SM 9.0, 132 SMs), and its generated wrapper is kept instead of loaded: what it launches (Triton kernels), which
library calls it makes (cuBLAS GEMMs, attention), and which ATen operators it runs in Python between them
(inductor's mix-order reduction, on by default for CUDA in torch 2.11, finishes each column sum it fuses into a
LayerNorm backward with an ATen ``sum`` over a float32 workspace).

The CPU pass traces attention as CPU SDPA (one extern call either way; the GPU runs cuDNN's, whose backward is
three kernels), and the LM head's GEMMs as they run on CUDA: bf16 operands with float32 output
(``aten::mm.dtype``), which CPU lacks, given a CPU kernel for the pass (``heads_cuda_gemms_on_cpu``); without it
the head would trace its CPU path, float32 copies of its operands, which no GPU runs. It needs a CUDA build of
torch (pip's default wheel runs on a machine without a GPU; a CPU build fails in inductor's passes on the fake
CUDA tensors) and triton. The device answers are patches of torch and
Triton internals, written against torch 2.11.0+cu130 with Triton 3.6 (the GPU node's pair); other versions may
fail in the lowering, which ends the tool with one line.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import re
import types
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch

from megatron_lite import config as config_lib
from megatron_lite.model import GPT
from megatron_lite.model.compile import COMPILE_MODES, compile_model, inductor_settings
from megatron_lite.model.variants import variant_named

# The device the lowering is asked for: an H200's SM count decides inductor's split sizes (mix-order reduction's
# among them), its capability the kernels' features.
H200 = types.SimpleNamespace(
    name="NVIDIA H200", major=9, minor=0, multi_processor_count=132, total_memory=140 * 2**30,
    regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, warp_size=32, gcnArchName="",
    L2_cache_size=50 * 2**20, shared_memory_per_block_optin=232448, max_threads_per_block=1024,
    clock_rate=1980000, memory_clock_rate=2619000, memory_bus_width=5120, uuid="none")
TRITON_LAUNCH = re.compile(r"^\s+(\w+)\.run\(", re.M)
LIBRARY_CALL = re.compile(r"^\s+(?:\w+ = )?(extern_kernels\.\w+|torch\.ops\.\w+\.\w+(?:\.\w+)?)\(", re.M)
# an ATen operator on a tensor in the wrapper's own Python, e.g. "buf12 = workspace_0[...].view(512, 1024).sum(dim=0)"
WRAPPER_ATEN = re.compile(r"^\s+\w+ = \w+\[[^\n]*\]\.view\((\d+), (\d+)\)\.(sum|amax|amin)\(", re.M)


@dataclass
class LoweringSettings:
    config_path: str = "configs/coca_350m.yml"
    scheme: str = "rope"
    micro_batch: int = 16
    inductor: dict[str, Any] = field(default_factory=dict)  # train.compile_options' form
    compile_mode: str = "regional"  # train.compile_mode's values
    layers: int = 1  # the model's depth for "whole" (regional lowers one block, whatever the depth)
    blocks_per_region: int = 1  # regional: the blocks of one compiled region (train.compile_blocks_per_region)

    def validate(self) -> None:
        variant_named(self.scheme)
        if self.micro_batch < 1:
            raise ValueError(f"--micro-batch {self.micro_batch}: must be >= 1")
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"--compile-mode {self.compile_mode}: must be one of {', '.join(COMPILE_MODES)}")
        if self.layers < 1:
            raise ValueError(f"--layers {self.layers}: must be >= 1")
        if self.blocks_per_region < 1 or (self.blocks_per_region > 1 and self.compile_mode != "regional"):
            raise ValueError(f"--blocks-per-region {self.blocks_per_region}: must be >= 1, and 1 unless "
                             "--compile-mode regional")
        inductor_settings(self.inductor, where="--inductor")


@dataclass
class GraphCode:
    """One generated CUDA wrapper (a region's forward or backward) and what it launches."""

    name: str
    code: str
    triton_launches: int
    library_calls: list[str]
    wrapper_reductions: list[str]  # "sum [512, 1024]": ATen reductions the wrapper runs on a workspace
    bytes_per_token: float  # inductor's count over its scheduler nodes (each buffer once per kernel)


def count_launches(name: str, code: str, tokens: int, scheduler_bytes: int) -> GraphCode:
    """What a generated wrapper's ``call`` launches, read off its source."""
    reductions = [f"{op} [{rows}, {columns}]" for rows, columns, op in WRAPPER_ATEN.findall(code)]
    return GraphCode(name=name, code=code, triton_launches=len(TRITON_LAUNCH.findall(code)),
                     library_calls=LIBRARY_CALL.findall(code), wrapper_reductions=reductions,
                     bytes_per_token=scheduler_bytes / tokens)


Recorded = list[tuple[str, Any, list[Any], dict[str, Any]]]  # (region, graph, example inputs, inner kwargs)


def _record_graphs(settings: LoweringSettings) -> tuple[Recorded, int]:
    """The partitioned forward and backward graphs of each compiled region, bf16, as inductor's front end makes
    them on CPU in one training step: ``regional``, the first block's and the LM head's (with its fused loss);
    ``whole``, the model's ``decode`` at ``settings.layers`` layers. And the step's token count."""
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.compile_fx import compile_fx

    recorded: Recorded = []
    # compile_model gives every region one backend; dynamo calls it once per region, in the order the forward
    # reaches them (regional: the block, then the head), and the inner compiler once per forward and backward
    group = "block" if settings.blocks_per_region == 1 else f"{settings.blocks_per_region} blocks"
    regions = iter(["model"] if settings.compile_mode == "whole" else [group, "head"])

    def backend(gm: Any, example_inputs: list[Any]) -> Any:
        region = next(regions)

        def record(graph: Any, inputs: list[Any], **kwargs: Any) -> Any:
            kept = [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in inputs]
            recorded.append((region, copy.deepcopy(graph), kept, dict(kwargs)))
            return make_boxed_func(graph.forward)  # run eagerly: the CPU's own lowering is not wanted
        return compile_fx(gm, example_inputs, inner_compile=record)

    base = config_lib.load(settings.config_path)
    layers = settings.layers if settings.compile_mode == "whole" else settings.blocks_per_region
    config = config_lib.with_overrides(base, [f"model.num_layers={layers}", *variant_named(settings.scheme).overrides])
    torch.manual_seed(0)
    model = GPT(config.model).to(torch.bfloat16).train()
    model.use_loss_settings(config.train)  # as the engine does
    torch._dynamo.reset()
    compile_model(model, settings.compile_mode, backend=backend,  # type: ignore[arg-type]
                  blocks_per_region=settings.blocks_per_region)
    ids_BT1 = torch.randint(0, config.model.vocab_size, (settings.micro_batch, config.model.seq_length + 1))
    with heads_cuda_gemms_on_cpu():
        model(ids_BT1[:, :-1], labels=ids_BT1[:, 1:]).backward()
    torch._dynamo.reset()
    return recorded, settings.micro_batch * config.model.seq_length


def _mm_float32_output_on_cpu(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``aten::mm.dtype`` for the CPU pass: the CUDA kernel's numerics (exact upcast, float32 sums)."""
    return torch.mm(a.to(torch.float32), b.to(torch.float32)).to(out_dtype)


@contextlib.contextmanager
def heads_cuda_gemms_on_cpu() -> Iterator[None]:
    """Within it, the fused LM head on a CPU takes its CUDA path: ``loss.native_float32_output`` says yes, and
    ``aten::mm.dtype`` has a CPU kernel (registered for the with-block only, removed after it)."""
    from megatron_lite.model import loss

    library = None
    if not _cpu_has_mm_float32_output():  # a torch whose CPU has its own kernel keeps it
        library = torch.library.Library("aten", "IMPL")
        library.impl("mm.dtype", _mm_float32_output_on_cpu, "CPU")
    try:
        with mock.patch.object(loss, "native_float32_output", lambda device: hasattr(torch.ops.aten.mm, "dtype")):
            yield
    finally:
        if library is not None:
            library._destroy()


def _cpu_has_mm_float32_output() -> bool:
    one = torch.ones(1, 1, dtype=torch.bfloat16)
    try:
        torch.mm(one, one, out_dtype=torch.float32)
    except (NotImplementedError, RuntimeError, TypeError):
        return False
    return True


@contextlib.contextmanager
def _an_h200_without_a_gpu() -> Iterator[None]:
    """torch and Triton answer inductor's device queries as one H200 would, and no CUDA call is made."""
    import torch._dynamo.device_interface as device_interface
    import torch._inductor.scheduler as scheduler
    import torch._subclasses.fake_tensor as fake_tensor
    import torch.cuda.random
    import torch.utils._triton as torch_triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    class Driver:
        def get_current_target(self) -> Any:
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, *args: Any) -> int:
            return 0

        def is_active(self) -> bool:
            return True

    cuda_interface = device_interface.CudaInterface
    patches: list[tuple[Any, str, Any]] = [
        (torch.cuda, "get_device_properties", lambda *a, **k: H200),
        (torch.cuda, "_get_device_properties", lambda *a, **k: H200),
        (torch.cuda, "get_device_capability", lambda *a, **k: (9, 0)),
        (torch.cuda, "is_available", lambda: True),
        (torch.cuda, "device_count", lambda: 1),
        (torch.cuda, "current_device", lambda: 0),
        (torch.cuda, "_lazy_init", lambda: None),
        (torch.cuda, "_exchange_device", lambda index: 0),
        (torch.cuda, "_maybe_exchange_device", lambda index: 0),
        (fake_tensor, "init_gpu_context", lambda device: None),
        (cuda_interface, "get_device_properties", staticmethod(lambda *a, **k: H200)),
        (cuda_interface, "get_compute_capability", staticmethod(lambda *a, **k: 90)),
        (cuda_interface, "is_available", staticmethod(lambda: True)),
        (cuda_interface.Worker, "get_device_properties", staticmethod(lambda *a, **k: H200)),
        (torch_triton, "has_triton", lambda: True),
        (scheduler, "has_triton", lambda: True),
    ]
    for module in (torch.cuda, torch.cuda.random):
        patches += [(module, "get_rng_state", lambda *a, **k: torch.zeros(16, dtype=torch.uint8)),
                    (module, "set_rng_state", lambda *a, **k: None)]
    saved = [(owner, name, owner.__dict__.get(name, getattr(owner, name, None))) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    previous_driver = driver._active  # not .active: that would create the real driver, which needs libcuda
    driver.set_active(Driver())
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        driver._active = previous_driver


class _Captured(Exception):
    """Raised once the wrapper is generated: loading it would compile the kernels for a real GPU."""


def _lower_for_cuda(gm: Any, inputs: list[Any], kwargs: dict[str, Any], settings: dict[str, Any]
                    ) -> tuple[str, int]:
    """``gm`` lowered by inductor for CUDA on fake tensors: its generated wrapper and scheduler bytes."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.graph import GraphLowering
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    cuda = torch.device("cuda", 0)
    for node in gm.graph.nodes:  # constants the graph makes (zeros, full) on the device
        if "device" in node.kwargs:
            node.kwargs = {**node.kwargs, "device": cuda}
    gm.recompile()
    captured: dict[str, Any] = {}

    def capture(self: Any, *args: Any, **kw: Any) -> Any:
        code = self.codegen()
        code = code[0] if isinstance(code, tuple) else code
        captured["code"] = str(getattr(code, "value", code))
        captured["bytes"] = self.count_bytes()[0]
        raise _Captured

    mode = FakeTensorMode()
    with mode:
        fakes = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=cuda)
                 if isinstance(t, torch.Tensor) else t for t in inputs]
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
    passed = {key: value for key, value in kwargs.items() if key in ("is_backward", "static_input_idxs", "graph_id",
                                                                     "is_inference", "boxed_forward_device_index")}
    original = GraphLowering.compile_to_module
    GraphLowering.compile_to_module = capture  # type: ignore[method-assign]
    try:
        with inductor_config.patch({**settings, "fx_graph_cache": False}), mode:
            compile_fx_inner(gm, fakes, **passed)
    except Exception as error:  # inductor wraps what the capture raises
        if not captured:
            raise ValueError(f"inductor's CUDA lowering failed on torch {torch.__version__}: "
                             f"{str(error).splitlines()[0][:300]}") from None
    finally:
        GraphLowering.compile_to_module = original  # type: ignore[method-assign]
    return captured["code"], captured["bytes"]


def lower_for_cuda(settings: LoweringSettings) -> list[GraphCode]:
    """Each compiled region's forward and backward (``_record_graphs``), as inductor would generate them for an
    H200: the block's, then the head's."""
    settings.validate()
    if torch.version.cuda is None:  # a CPU build cannot hold even a fake CUDA tensor through inductor's passes
        raise ValueError(f"inductor's CUDA lowering needs a CUDA build of torch (pip's default wheel, which runs "
                         f"without a GPU); this one is {torch.__version__}")
    if importlib.util.find_spec("triton") is None:  # the lowering writes Triton kernels
        raise ValueError("inductor's CUDA lowering needs triton (pip install triton; the GPU node's torch 2.11 "
                         "pairs with triton 3.6)")
    flat = inductor_settings(settings.inductor, where="--inductor")
    recorded, tokens = _record_graphs(settings)
    graphs = []
    with _an_h200_without_a_gpu():
        for region, gm, inputs, kwargs in recorded:
            name = f"{region} {'backward' if kwargs.get('is_backward') else 'forward'}"
            code, scheduler_bytes = _lower_for_cuda(gm, inputs, kwargs, flat)
            graphs.append(count_launches(name, code, tokens, scheduler_bytes))
    return sorted(graphs, key=lambda graph: ("head" in graph.name, "backward" in graph.name))


def format_lowering(graphs: list[GraphCode], settings: LoweringSettings) -> str:
    shown = ", ".join(f"{name}={value}" for name, value in inductor_settings(settings.inductor, "--inductor").items())
    what = (f"The whole {settings.layers}-layer {settings.scheme} model" if settings.compile_mode == "whole" else
            f"One {settings.scheme} block and the LM head" if settings.blocks_per_region == 1 else
            f"One region of {settings.blocks_per_region} {settings.scheme} blocks and the LM head")
    lines = [f"{what} of {settings.config_path}, compiled {settings.compile_mode}, micro batch "
             f"{settings.micro_batch}, bf16, as inductor (torch {torch.__version__}) lowers it for an H200"
             f"{f' with {shown}' if shown else ''}:", "",
             "| graph | Triton launches | library calls | ATen reductions in the wrapper | scheduler bytes/token |",
             "|---|---:|---|---|---:|"]
    for graph in graphs:
        calls = ", ".join(f"{count} x {call}" for call, count in Counter(graph.library_calls).items()) or "-"
        reductions = ", ".join(graph.wrapper_reductions) or "-"
        lines.append(f"| {graph.name} | {graph.triton_launches} | {calls} | {reductions} | "
                     f"{graph.bytes_per_token:,.0f} |")
    return "\n".join(lines)


def parse_inductor_assignments(assignments: list[str]) -> dict[str, Any]:
    """``["triton.mix_order_reduction=false"]`` -> ``{"triton.mix_order_reduction": False}`` (values as YAML)."""
    settings: dict[str, Any] = {}
    for assignment in assignments:
        parts, value = config_lib.parse_override(assignment)
        settings[".".join(parts)] = value
    return settings


def lowering_settings(config_path: str, scheme: str, micro_batch: int, assignments: list[str],
                      compile_mode: str = "regional", layers: int = 1, blocks_per_region: int = 1) -> LoweringSettings:
    return LoweringSettings(config_path=config_path, scheme=scheme, micro_batch=micro_batch,
                            inductor=parse_inductor_assignments(assignments), compile_mode=compile_mode, layers=layers,
                            blocks_per_region=blocks_per_region)

