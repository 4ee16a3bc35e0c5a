"""Memory traffic of the compiled training step as inductor counts it, ours against the Hugging Face twin: the
compiled counterpart of the step census's "other ops' traffic" (which counts eager operators).

Each model is compiled whole (ours ``compile_model(model, "whole")``, the twin's forward and loss in one
``torch.compile``) at two depths, and one training step (forward, loss, backward; no optimizer) runs on CPU.
Inductor's scheduler counts, for every kernel it generates and every extern call (the GEMMs), the bytes of the
buffers the kernel reads and writes, each buffer once per kernel: the fused kernel's ideal (a reduction that
re-reads its input is counted once). The difference between the two depths, per layer and token, is one
compiled block's traffic; what the shallower model has beyond its blocks is the rest (embedding, final norm, LM
head and loss). At equal GEMM FLOPs the compiled step's time beside its GEMMs follows these bytes. float32,
because inductor's C++ backend fails to compile the block in bf16 on CPU: a bf16 run moves about half the
bytes, in the same proportions.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from dev.census_bench import HF_TWIN
from megatron_lite import config as config_lib
from megatron_lite.bench.train_bench import hf_gpt_neox
from megatron_lite.config import Config
from megatron_lite.model import GPT
from megatron_lite.model.compile import compile_model
from megatron_lite.model.variants import variant_named

COMPILED_BYTES_SCHEMES = ("rope", "coca_slack")
# left out of a kernel's "made from" list (block_kernels): they move no data of their own
SHAPE_ONLY_OPERATORS = {"permute", "reshape", "view", "unsqueeze", "squeeze", "<built-in function getitem>"}


@dataclass
class CompiledBytesSettings:
    config_path: str = "configs/coca_350m.yml"
    schemes: list[str] = field(default_factory=lambda: list(COMPILED_BYTES_SCHEMES))
    hf_twin: bool = True
    batch_size: int = 2
    depths: tuple[int, int] = (1, 3)  # the per-layer figure is the difference between these
    seed: int = 1234

    def validate(self) -> None:
        for name in self.schemes:
            variant_named(name)  # unknown labels stop here, before anything compiles
        if self.batch_size < 1:
            raise ValueError(f"--compiled-bytes-batch-size {self.batch_size}: must be >= 1")
        low, high = self.depths
        if not 1 <= low < high:
            raise ValueError(f"compiled-bytes depths {self.depths}: need 1 <= shallow < deep")


@contextlib.contextmanager
def inductor_counting() -> Iterator[Any]:
    """While active, inductor counts the bytes of every graph it compiles (``metrics.num_bytes_accessed``, from
    zero) and compiles every graph afresh (no FX-graph or autograd cache hit, which would skip the count), in
    this process (``compile_threads=1``: the count is the same, and a small model compiles in half the time
    without starting the compile-worker pool). A concatenation lowers as on a GPU (``force_pointwise_cat``):
    inductor's CPU backend copies each input of a ``cat`` with a kernel of its own, where its GPU backend reads
    the inputs inside the consumer's kernel (the rotary's ``rotate_half``: one kernel, not five)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.compile_fx as compile_fx
    import torch._inductor.config as inductor_config
    import torch._inductor.metrics as metrics

    log = compile_fx.inductor_metrics_log  # the count is made only when this logger is enabled for INFO
    handler, level, propagate = logging.NullHandler(), log.level, log.propagate
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    log.propagate = False
    try:
        with inductor_config.patch(fx_graph_cache=False, compile_threads=1, force_pointwise_cat=True), \
                functorch_config.patch(enable_autograd_cache=False):
            torch._dynamo.reset()
            metrics.reset()
            yield metrics
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate
        torch._dynamo.reset()


def _compiled_step(label: str, config: Config, batch_size: int, seed: int) -> Callable[[], None]:
    """One training step of ``label`` (a scheme, or HF_TWIN) compiled whole, float32 on CPU."""
    torch.manual_seed(seed)
    ids_BT1 = torch.randint(0, config.model.vocab_size, (batch_size, config.model.seq_length + 1))
    inputs_BT, labels_BT = ids_BT1[:, :-1], ids_BT1[:, 1:]
    if label == HF_TWIN:
        twin = hf_gpt_neox(config).train()

        # the loss inside the compiled region, as ours: gpu_check times the twin's model.compile() with its cross
        # entropy run eagerly after it, which inductor would not count
        @torch.compile
        def twin_loss(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            logits_BTV = twin(inputs).logits
            return F.cross_entropy(logits_BTV.reshape(-1, logits_BTV.shape[-1]).float(), labels.reshape(-1))
        return lambda: twin_loss(inputs_BT, labels_BT).backward()
    model = GPT(config_lib.with_overrides(config, variant_named(label).overrides).model).train()
    compile_model(model, "whole")
    return lambda: model(inputs_BT, labels=labels_BT).backward()


def measure(label: str, settings: CompiledBytesSettings) -> dict[str, Any]:
    """One row: ``label``'s compiled block and rest, in bytes per token, and the block's kernels."""
    base = config_lib.load(settings.config_path)
    counts = {}
    for depth in settings.depths:
        config = config_lib.with_overrides(base, [f"model.num_layers={depth}"])
        with inductor_counting() as metrics:
            _compiled_step(label, config, settings.batch_size, settings.seed)()
            counts[depth] = (metrics.num_bytes_accessed, metrics.generated_kernel_count)
    (low, (low_bytes, low_kernels)), (high, (high_bytes, high_kernels)) = sorted(counts.items())
    tokens = settings.batch_size * base.model.seq_length
    layer_bytes = (high_bytes - low_bytes) / (high - low)
    return {"model": HF_TWIN if label == HF_TWIN else "ours", "scheme": "rope" if label == HF_TWIN else label,
            "layer_bytes_per_token": layer_bytes / tokens, "layer_kernels": (high_kernels - low_kernels) / (high - low),
            "rest_bytes_per_token": (low_bytes - low * layer_bytes) / tokens}


def run_compiled_bytes(settings: CompiledBytesSettings, progress: Callable[[str], None] = print
                       ) -> list[dict[str, Any]]:
    settings.validate()
    rows = []
    for label in [*settings.schemes, *([HF_TWIN] if settings.hf_twin else [])]:
        rows.append(measure(label, settings))
        row = rows[-1]
        progress(f"compiled bytes {row['model']} {row['scheme']}: per layer {row['layer_bytes_per_token']:,.0f} "
                 f"B/token ({row['layer_kernels']:.0f} kernels), rest {row['rest_bytes_per_token']:,.0f} B/token")
    return rows


def format_compiled_bytes(rows: list[dict[str, Any]], settings: CompiledBytesSettings) -> str:
    model = config_lib.load(settings.config_path).model
    lines = [
        f"Compiled step traffic (inductor's count: each kernel's buffers read and written, once per kernel; GEMM "
        f"operands included): {settings.config_path} (hidden {model.hidden_size}, {model.num_attention_heads} "
        f"heads, seq {model.seq_length}, vocab {model.padded_vocab_size}), batch {settings.batch_size}, float32, "
        f"compiled whole at {settings.depths[0]} and {settings.depths[1]} layers, forward + loss + backward; "
        f"torch {torch.__version__}. Per layer: the difference per added layer; rest: embedding, final norm, "
        "LM head and loss.",
        "",
        "| model | scheme | per layer B/token | kernels per layer | rest B/token |",
        "|---|---|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(f"| {row['model']} | {row['scheme']} | {row['layer_bytes_per_token']:,.0f} | "
                     f"{row['layer_kernels']:.0f} | {row['rest_bytes_per_token']:,.0f} |")
    twin = next((row for row in rows if row["model"] == HF_TWIN), None)
    if twin is not None:
        lines.append("")
        for row in rows:
            if row is not twin:
                lines.append(f"{row['scheme']} / {HF_TWIN}: per layer "
                             f"{row['layer_bytes_per_token'] / twin['layer_bytes_per_token']:.2f}x, rest "
                             f"{row['rest_bytes_per_token'] / twin['rest_bytes_per_token']:.2f}x")
    return "\n".join(lines) + "\n"


def block_kernels(scheme: str, settings: CompiledBytesSettings) -> list[dict[str, Any]]:
    """Each kernel inductor generates and each extern call (GEMM, attention) of one block compiled as training
    compiles it (one region, ``layer.compile()``; the rest of the one-layer model stays eager), forward then
    backward: inductor's bytes per token and the aten operators the kernel was made from. What a GEMM template's
    epilogue could absorb is read off this list (docs/performance.md, where a step's time goes)."""
    from torch._inductor.scheduler import ExternKernelSchedulerNode

    config = config_lib.with_overrides(config_lib.load(settings.config_path), ["model.num_layers=1"])
    model = GPT(config_lib.with_overrides(config, variant_named(scheme).overrides).model).train()
    model.layers[0].compile()
    torch.manual_seed(settings.seed)
    ids_BT1 = torch.randint(0, config.model.vocab_size, (settings.batch_size, config.model.seq_length + 1))
    tokens = settings.batch_size * config.model.seq_length
    with inductor_counting() as metrics:
        loss = model(ids_BT1[:, :-1], labels=ids_BT1[:, 1:])
        forward_nodes = len(metrics.nodes_num_elem)  # the backward graph compiles at the first backward
        loss.backward()
        nodes = list(metrics.nodes_num_elem)  # (scheduler node, its bytes // 4)
    return [{"pass": "forward" if index < forward_nodes else "backward",
             "kind": "extern" if isinstance(node, ExternKernelSchedulerNode) else "generated",
             "bytes_per_token": 4 * quarter_bytes / tokens, "operators": _fused_operators(node)}
            for index, (node, quarter_bytes) in enumerate(nodes) if quarter_bytes]


def _fused_operators(node: Any) -> str:
    """The aten operators a scheduler node was lowered from (shape-only ones left out), sorted."""
    names = {str(origin.target).removeprefix("aten.").split(".")[0]
             for part in node.get_nodes() for origin in getattr(part.node, "origins", None) or ()}
    return ",".join(sorted(names - SHAPE_ONLY_OPERATORS))


def format_block_kernels(scheme: str, rows: list[dict[str, Any]], settings: CompiledBytesSettings) -> str:
    lines = [f"One regionally compiled block of {scheme} ({settings.config_path}, batch {settings.batch_size}, "
             "float32; inductor's bytes per token, each buffer once per kernel; extern: GEMM and attention calls):", "",
             "| pass | kind | B/token | made from |", "|---|---|---:|---|"]
    lines += [f"| {row['pass']} | {row['kind']} | {row['bytes_per_token']:,.0f} | {row['operators']} |" for row in rows]
    lines.append("")
    for phase in ("forward", "backward"):
        totals = {kind: sum(row["bytes_per_token"] for row in rows if (row["pass"], row["kind"]) == (phase, kind))
                  for kind in ("generated", "extern")}
        lines.append(f"{phase}: generated {totals['generated']:,.0f} B/token, extern {totals['extern']:,.0f}")
    return "\n".join(lines) + "\n"
