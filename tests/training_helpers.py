"""Tiny runs of the real train.py (plain python or the deepspeed launcher) on a corpus made in tmp."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

from megatron_lite import checkpoint_dirs
from megatron_lite.checkpoint_integrity import safe_load
from megatron_lite.training.distributed import free_port
from megatron_lite.weights import load_step_state_dict

REPO = Path(__file__).resolve().parents[1]
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches near "
         "old stone bridges and rivers flow past green fields under blue skies").split()


def make_corpus(root: Path) -> Path:
    """A 75/25 text/code mix of seeded pseudo-prose (jsonl) and Python-like files (txt dir); returns the mix file."""
    rng = random.Random(0)
    root.mkdir(parents=True, exist_ok=True)
    with (root / "prose.jsonl").open("w") as handle:
        for _ in range(240):
            sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))).capitalize() + "."
                         for _ in range(rng.randint(8, 20))]
            handle.write(json.dumps({"text": " ".join(sentences)}) + "\n")
    code_dir = root / "code"
    code_dir.mkdir(exist_ok=True)
    for index in range(120):
        lines = [f"def function_{index}_{j}(x, y):\n    total = x + {j} * y\n    return total\n"
                 for j in range(rng.randint(4, 12))]
        (code_dir / f"module_{index:03d}.txt").write_text("\n".join(lines))
    mix = {
        "groups": {
            "text": {"weight": 0.75, "sources": {"prose": {"type": "jsonl", "path": str(root / "prose.jsonl")}}},
            "code": {"weight": 0.25, "sources": {"code": {"type": "text", "path": str(code_dir)}}},
        }
    }
    mix_path = root / "mix.yml"
    mix_path.write_text(yaml.safe_dump(mix))
    return mix_path


def tiny_train_config(mix: Path, cache_dir: Path, **train: Any) -> dict[str, Any]:
    """2 layers, width 64, seq 32, vocab 384; fp32, ZeRO 0, wandb disabled, every step logged."""
    train_section = {
        "train_iters": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
        "lr": 3.0e-3, "min_lr": 3.0e-4, "warmup": 0.1, "log_interval": 1, "eval_interval": 4, "eval_iters": 2,
        "save_interval": 4, "keep_last_checkpoints": 5, "num_workers": 0, "wandb": {"mode": "disabled"},
    }
    train_section.update(train)
    return {
        "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
                  "vocab_size": 384, "position": {"scheme": "coca", "constraint": "slack"}},
        "data": {"mix": str(mix), "cache_dir": str(cache_dir), "num_workers": 1, "validation_fraction": 0.05,
                 "tokenizer": {"sample_chars": 200_000}},
        "train": train_section,
        "precision": "fp32",
        "seed": 11,
    }


def write_config(path: Path, data: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def train_command(config: Path, run_dir: Path, *extra: str, ranks: int = 1) -> list[str]:
    args = [str(REPO / "train.py"), "--config", str(config), "--run-dir", str(run_dir), *extra]
    if ranks == 1:
        return [sys.executable, *args]
    deepspeed = Path(sys.executable).with_name("deepspeed")
    launcher = [str(deepspeed)] if deepspeed.exists() else [sys.executable, "-m", "deepspeed.launcher.runner"]
    return [*launcher, "--num_gpus", str(ranks), "--master_port", str(free_port()), *args]


def run_train(config: Path, run_dir: Path, *extra: str, ranks: int = 1, timeout: float = 600,
              check: bool = True, progress_bar: bool = False) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    if progress_bar:  # tqdm draws on stderr
        del env["TQDM_DISABLE"]
    result = subprocess.run(train_command(config, run_dir, *extra, ranks=ranks), cwd=REPO, env=env, text=True,
                            capture_output=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"train.py exited {result.returncode}\nSTDOUT:\n{result.stdout[-4000:]}\n"
                             f"STDERR:\n{result.stderr[-4000:]}")
    return result


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in metrics(run_dir) if row.get("loss") is not None}


def step_weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_step_state_dict(run / checkpoint_dirs.CHECKPOINTS_DIR / checkpoint_dirs.step_tag(step))


def optimizer_elements(step_dir: Path) -> dict[str, int]:
    """Elements of every Adam moment and fp32 master partition in a checkpoint's files (any ZeRO stage)."""
    found = {"exp_avg": 0, "exp_avg_sq": 0, "fp32": 0}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, torch.Tensor):
            if path.endswith(("/exp_avg", "/exp_avg_sq")):
                found[path.rsplit("/", 1)[1]] += node.numel()
            elif re.search(r"/(fp32_flat_groups|single_partition_of_fp32_groups)\[\d+\]$", path):
                found["fp32"] += node.numel()
        elif isinstance(node, dict):
            for key, value in node.items():
                if key != "module":  # the model's own copy, not optimizer state
                    walk(value, f"{path}/{key}")
        elif isinstance(node, (list, tuple)):
            for index, value in enumerate(node):
                walk(value, f"{path}[{index}]")

    for file in sorted(step_dir.glob("*_states.pt")):
        walk(safe_load(file), "")
    return found
