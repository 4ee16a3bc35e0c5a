"""The step census (step_census.py) for our schemes and the Hugging Face twin, as a table.

For every model: one bf16 training step (ours: ``model(ids, labels=labels)``, the trainer's fused chunked
loss; Hugging Face ``GPTNeoXForCausalLM``: its bf16 logits to a float32 cross entropy), counted on each
device asked for: ``cpu`` runs the CPU kernels; ``meta`` runs no kernel and shows the operators the CUDA
path chooses (fused SDPA, ``mm(..., out_dtype=float32)``, host-to-device copies), at any size, in
a second or so even at 350M.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dev.step_census import HOST_TO_DEVICE, census_step
from megatron_lite import config as config_lib
from megatron_lite.bench.train_bench import hf_gpt_neox
from megatron_lite.config import Config
from megatron_lite.model import GPT
from megatron_lite.model.gpt import DTYPES
from megatron_lite.model.variants import variant_named

HF_TWIN = "hf_gpt_neox"
CENSUS_SCHEMES = ("rope", "coca_slack", "coca_strict", "alibi")
CENSUS_DEVICES = ("cpu", "meta")


@dataclass
class CensusSettings:
    config_path: str = "configs/tiny/rope.yml"
    batch_size: int = 2
    precision: str = "bf16"
    devices: list[str] = field(default_factory=lambda: list(CENSUS_DEVICES))
    schemes: list[str] = field(default_factory=lambda: list(CENSUS_SCHEMES))
    hf_twin: bool = True
    # loss-head GEMM modes to count (model.lm_head.gemm); None: the model's default only
    gemms: list[str] | None = None
    optimizer: bool = False  # also count the AdamW step (reported apart)
    seed: int = 1234


def build_census_model(label: str, config: Config, device: str, precision: str) -> tuple[torch.nn.Module, bool]:
    """(model, is_hf) for ``label`` (a scheme label, or HF_TWIN), built on ``device`` in ``precision``."""
    torch.manual_seed(config.seed)
    with torch.device(device):
        if label == HF_TWIN:
            model, is_hf = hf_gpt_neox(config), True
        else:
            model, is_hf = GPT(config_lib.with_overrides(config, variant_named(label).overrides).model), False
    return model.to(DTYPES[precision]).train(), is_hf


def loss_head_gemm(model: torch.nn.Module) -> str | None:
    """Our loss head's GEMM mode (``lm_head.gemm``), None where the head has none (HF, older code)."""
    return getattr(getattr(model, "lm_head", None), "gemm", None)


def _set_gemm(model: torch.nn.Module, gemm: str) -> None:
    if loss_head_gemm(model) is None:
        raise ValueError(f"loss-head GEMM mode {gemm!r}: this code's LMHead has no 'gemm' attribute")
    model.lm_head.gemm = gemm  # type: ignore[union-attr]


def run_census(settings: CensusSettings, progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """One row per (device, model, loss-head GEMM mode)."""
    for name in settings.schemes:
        variant_named(name)  # unknown labels stop here, before anything runs
    unknown = [device for device in settings.devices if device not in CENSUS_DEVICES + ("cuda",)]
    if unknown:
        raise ValueError(f"census devices {unknown}: expected some of cpu, meta, cuda")
    if settings.precision not in DTYPES:
        raise ValueError(f"census precision {settings.precision!r}: expected one of {', '.join(DTYPES)}")
    config = config_lib.load(settings.config_path)
    labels = [*settings.schemes, *([HF_TWIN] if settings.hf_twin else [])]
    rows: list[dict[str, Any]] = []
    for device in settings.devices:
        generator = torch.Generator().manual_seed(settings.seed)
        ids = torch.randint(0, config.model.vocab_size, (settings.batch_size, config.model.seq_length + 1),
                            generator=generator).to(device)
        for label in labels:
            model, is_hf = build_census_model(label, config, device, settings.precision)
            gemms: Sequence[str | None] = [None] if is_hf or not settings.gemms else settings.gemms
            for gemm in gemms:
                if gemm is not None:
                    _set_gemm(model, gemm)
                start = time.perf_counter()
                census = census_step(model, ids, is_hf=is_hf, optimizer=settings.optimizer)
                row = {"device": device, "model": HF_TWIN if is_hf else "ours",
                       "scheme": "rope" if is_hf else label, "gemm": loss_head_gemm(model),
                       **census.as_dict(), "seconds": time.perf_counter() - start}
                rows.append(row)
                progress(f"census {device} {row['model']} {row['scheme']}"
                         f"{'' if row['gemm'] is None else ' gemm=' + row['gemm']}: fp32 share "
                         f"{row['fp32_share']:.1%}, sync {row['sync_count']}, ops {row['dispatched_ops']:,} "
                         f"({row['non_view_ops']:,} non-view), other ops' traffic {row['traffic_bytes'] / 1e9:,.2f} GB")
            del model
    return rows


def _syncs(row: dict[str, Any]) -> str:
    if not row["sync_count"]:
        return "0"
    detail = ", ".join(f"{count} {'item' if name == '_local_scalar_dense' else name}"
                       for name, count in sorted(row["sync_ops"].items()))
    return f"{row['sync_count']} ({detail})"


def format_census(rows: list[dict[str, Any]], settings: CensusSettings) -> str:
    config = config_lib.load(settings.config_path).model
    lines = [
        f"Step census: one {settings.precision} training step (forward with labels -> loss, backward"
        f"{', AdamW' if settings.optimizer else ''}) of {settings.config_path} ({config.num_layers} layers, "
        f"hidden {config.hidden_size}, {config.num_attention_heads} heads, seq {config.seq_length}, vocab "
        f"{config.padded_vocab_size}), batch {settings.batch_size}; torch {torch.__version__}. Figures cover "
        "forward + backward. fp32 share: GEMM FLOPs (mm/addmm/bmm/baddbmm, any overload) with a float32 "
        "operand; SDPA FLOPs apart (fwd 4BHTSD, bwd 8BHTSD). Sync: item/nonzero/is_nonzero/equal on the model's "
        f"device and '{HOST_TO_DEVICE}' copies (always 0 on cpu, where the host is the device; meta shows "
        "the CUDA path's operators). Dispatched ops: every aten call; non-view: those not views (about the "
        "kernels an eager CUDA step launches). Other ops' traffic: bytes read and written by the operators that "
        "are not GEMMs, fused attention or views (memory-bound on a GPU: the eager step's time beside its GEMMs).",
        "",
        "| device | model | scheme | loss GEMM | GEMM GFLOP | fp32-operand share | SDPA GFLOP | sync ops | "
        "dispatched ops | non-view ops | other ops' traffic GB |",
        "|---|---|---|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(f"| {row['device']} | {row['model']} | {row['scheme']} | {row['gemm'] or '–'} | "
                     f"{row['gemm_flops'] / 1e9:,.2f} | {row['fp32_share']:.1%} | {row['sdpa_flops'] / 1e9:,.2f} | "
                     f"{_syncs(row)} | {row['dispatched_ops']:,} | {row['non_view_ops']:,} | "
                     f"{row['traffic_bytes'] / 1e9:,.2f} |")
    lines += ["", *census_ratios(rows)]
    return "\n".join(lines) + "\n"


def census_ratios(rows: list[dict[str, Any]]) -> list[str]:
    """Per device: ours vs the HF twin, dispatched operators and fp32 share, one line per scheme row."""
    lines = []
    for row in rows:
        twin = next((other for other in rows if other["device"] == row["device"] and other["model"] == HF_TWIN), None)
        if row["model"] == HF_TWIN or twin is None:
            continue
        gemm = "" if row["gemm"] is None else f" ({row['gemm']})"
        lines.append(f"{row['device']} {row['scheme']}{gemm} / {HF_TWIN}: dispatched ops "
                     f"{row['dispatched_ops'] / twin['dispatched_ops']:.2f}x, non-view ops "
                     f"{row['non_view_ops'] / twin['non_view_ops']:.2f}x, other ops' traffic "
                     f"{row['traffic_bytes'] / max(twin['traffic_bytes'], 1):.2f}x, fp32 share "
                     f"{row['fp32_share']:.1%} vs {twin['fp32_share']:.1%}, sync ops {row['sync_count']} vs "
                     f"{twin['sync_count']}")
    return lines
