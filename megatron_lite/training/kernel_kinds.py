"""The kind of a profiled operator or kernel by its name (GEMM, attention, inductor's fused kernels, ...): the
grouping of ``train.profile``'s summary and of the GEMM table's kernels tied to no operator."""

from __future__ import annotations

# (kind, lower-case name fragments), first match wins: CUDA kernel names (nvjet/xmma/cutlass GEMMs, flash/cuDNN
# attention, inductor's triton_*) and the aten operators a CPU run shows.
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "_attn")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
              "aten::_addmm", "splitk")),
    ("compiled", ("triton_", "cpp_fused", "compiledfunction", "compiledfxgraph")),
    ("optimizer", ("adam", "multi_tensor", "foreach", "optimizer")),
    ("communication", ("nccl", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
                       "all_to_all", "broadcast", "gloo")),
    ("copy", ("memcpy", "memset", "copy", "aten::cat", "catarray", "aten::to", "contiguous", "fill")),
)
OTHER = "other"


def kind_of(name: str) -> str:
    """The kind of an operator or kernel, by its name (``KINDS``), else ``other``."""
    lowered = name.lower()
    for kind, fragments in KINDS:
        if any(fragment in lowered for fragment in fragments):
            return kind
    return OTHER
