"""What a run reports: console lines, <run-dir>/metrics.jsonl, wandb, and the loss-curve PNG.

Only rank 0 logs. The training loss shown everywhere (progress bar, log lines, metrics.jsonl, wandb,
the final summary) is one quantity, ``LossWindow``: the mean loss of the last ``train.log_interval``
steps (fewer right after a start or resume; skipped non-finite steps left out).

FLOPs follow the PaLM appendix convention: 6·N per token for the matmuls
(N = parameters except the input embedding, a lookup) plus 12·layers·hidden·seq_length for attention
scores; activation recomputation is not counted (that is MFU, not hardware FLOPs).
"""

from __future__ import annotations

import json
import netrc
import os
import resource
import secrets
import string
from collections import deque
from pathlib import Path
from typing import Any

import torch

from megatron_lite.config import Config, ModelConfig
from megatron_lite.console import notice
from megatron_lite.files import write_text_atomic
from megatron_lite.model.params import analytic_parameter_count

WANDB_ID_FILE = "wandb_run_id"  # in the run dir: the wandb run a resume continues

# Dense bf16/fp16 tensor-core peaks (TFLOP/s) by device-name substring.
KNOWN_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "A10G": 125.0, "L40S": 362.0, "V100": 125.0}


def model_flops_per_token(model: ModelConfig) -> float:
    """Training (forward + backward) FLOPs per token."""
    matmul_params = analytic_parameter_count(model) - model.padded_vocab_size * model.hidden_size
    attention_width = model.num_attention_heads * model.head_dim  # = hidden_size for GPT-NeoX
    return 6.0 * matmul_params + 12.0 * model.num_layers * attention_width * model.seq_length


def peak_tflops(config: Config) -> float | None:
    if config.train.peak_tflops is not None:
        return config.train.peak_tflops
    if torch.cuda.is_available() and config.precision in ("bf16", "fp16"):
        return known_peak_tflops(torch.cuda.get_device_name())
    return None


def known_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a device by its name (``KNOWN_PEAK_TFLOPS``), None if not known."""
    return next((value for key, value in KNOWN_PEAK_TFLOPS.items() if key in device_name), None)


def memory_gb() -> float:
    """Peak device memory (GPU) or peak resident set (CPU) of this process, GB."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 1e9
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux: kilobytes
    return peak_kb / 1e6


def _wandb_has_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


class LossWindow:
    """The training loss every report shows: the mean of the finite step losses among the last ``size``
    steps (``size`` = train.log_interval); None when there are none."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._losses: deque[tuple[int, float]] = deque(maxlen=size)  # (step, mean loss of that step)

    def add(self, step: int, loss: float) -> None:
        self._losses.append((step, loss))

    def mean(self, step: int) -> float | None:
        """The window ending at ``step``."""
        recent = [loss for at, loss in self._losses if at > step - self.size]
        return sum(recent) / len(recent) if recent else None


def wandb_run_id(run_dir: Path, resuming: bool) -> str:
    """The id of the run dir's wandb run, kept in <run-dir>/wandb_run_id: a resume continues that wandb
    run; a fresh start (step 0) begins a new one."""
    path = run_dir / WANDB_ID_FILE
    kept = path.read_text().strip() if resuming and path.is_file() else ""
    if kept:
        return kept
    run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    write_text_atomic(path, run_id + "\n")
    return run_id


class MetricsLogger:
    """metrics.jsonl rows (+ wandb) on rank 0; a no-op elsewhere."""

    def __init__(self, config: Config, run_dir: Path, enabled: bool, start_step: int = 0) -> None:
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.run_dir = run_dir
        self._wandb: Any = None
        self.dropped_rows = 0
        if enabled:
            self.dropped_rows = drop_rows_after(self.path, start_step)
            self._wandb = self._start_wandb(config, run_dir, resuming=start_step > 0)

    @staticmethod
    def _start_wandb(config: Config, run_dir: Path, resuming: bool) -> Any:
        settings = config.train.wandb
        mode = settings.mode
        if mode == "disabled":
            return None
        if mode == "online" and not _wandb_has_key():
            notice("train.wandb.mode=online but no WANDB_API_KEY or `wandb login`: logging offline instead")
            mode = "offline"
        os.environ.setdefault("WANDB_SILENT", "true")
        try:
            import wandb

            from megatron_lite.config import to_dict

            return wandb.init(project=settings.project, entity=settings.entity, name=settings.name or run_dir.name,
                              tags=settings.tags, mode=mode, dir=str(run_dir), config=to_dict(config),
                              id=wandb_run_id(run_dir, resuming), resume="allow",
                              settings=wandb.Settings(console="off", init_timeout=60))
        except Exception as error:  # logging must never stop training
            notice(f"wandb disabled: {type(error).__name__}: {error}")
            return None

    def log(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as handle:
            handle.write(json.dumps(row) + "\n")
        if self._wandb is not None:
            numbers = {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}
            if numbers:  # not the final row's stopped_by
                self._wandb.log(numbers, step=row["step"])

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _parse_metrics(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """(rows, whether the last line was cut off). A cut-off last line is what a crash or a full disk
    leaves mid-write; a bad line before it is a ValueError naming the file and line."""
    if not path.is_file():
        return [], False
    lines = [(number, line) for number, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    rows: list[dict[str, Any]] = []
    for index, (number, line) in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as error:
            if index == len(lines) - 1:
                return rows, True
            raise ValueError(f"{path}:{number}: not a JSON row ({error.msg} at column {error.colno})") from None
    return rows, False


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl, without a cut-off last line."""
    return _parse_metrics(path)[0]


def drop_rows_after(path: Path, step: int) -> int:
    """Remove rows logged after ``step``: an interrupted attempt logged them, and the run redoes those
    steps from its checkpoint, so keeping them would give every such step two rows. A cut-off last row
    is dropped too, with a notice. Returns the number of complete rows dropped."""
    rows, cut_off = _parse_metrics(path)
    if cut_off:
        notice(f"{path}: dropped its cut-off last line (an interrupted write)")
    kept = [row for row in rows if row.get("step", 0) <= step]
    if len(kept) < len(rows) or cut_off:
        write_text_atomic(path, "".join(json.dumps(row) + "\n" for row in kept))  # a crash leaves old or new
    return len(rows) - len(kept)


def plot_loss_curve(metrics_path: Path, out_path: Path, title: str) -> Path | None:
    """Training and validation loss against step; None if there is nothing to plot."""
    rows = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
    valid = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    if not train and not valid:
        return None
    from megatron_lite.eval.report import plots_available

    if not plots_available():  # a bare GPU node (docs/reproduction.md): the losses are in metrics.jsonl
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    if train:
        axes.plot(*zip(*train), label="train loss")
    if valid:
        axes.plot(*zip(*valid), "o-", label="validation loss")
    axes.set_xlabel("step")
    axes.set_ylabel("loss (nats/token)")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(out_path, dpi=120)
    plt.close(figure)
    return out_path


def format_row(row: dict[str, Any], total_steps: int) -> str:
    parts = [f"step {row['step']}/{total_steps}"]
    for key, fmt in (("loss", "loss {:.4f}"), ("lr", "lr {:.3e}"), ("grad_norm", "grad_norm {:.3f}"),
                     ("tokens_per_sec", "{:,.0f} tok/s"), ("tflops", "{:.1f} TFLOP/s"), ("mfu", "MFU {:.1%}"),
                     ("memory_gb", "mem {:.2f} GB"), ("skipped_steps", "skipped {}"), ("val_loss", "val_loss {:.4f}"),
                     ("val_ppl", "val_ppl {:.2f}")):
        if row.get(key) is not None:
            parts.append(fmt.format(row[key]))
    return " | ".join(parts)


def loss_summary(rows: list[dict[str, Any]]) -> str:
    """'loss FIRST (step a) -> LAST (step b); validation loss V (step c)' over the whole run's metrics rows,
    earlier attempts of a resumed run included."""
    train = [(row["step"], row["loss"]) for row in rows if row.get("loss") is not None]
    valid = [(row["step"], row["val_loss"]) for row in rows if row.get("val_loss") is not None]
    if not train:
        text = "loss n/a"
    elif len(train) == 1:
        text = f"loss {train[0][1]:.4f} (step {train[0][0]})"
    else:
        text = f"loss {train[0][1]:.4f} (step {train[0][0]}) -> {train[-1][1]:.4f} (step {train[-1][0]})"
    return text + (f"; validation loss {valid[-1][1]:.4f} (step {valid[-1][0]})" if valid else "; validation loss n/a")
