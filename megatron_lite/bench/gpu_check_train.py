"""gpu_check's ``train`` section: a short real ``train.py`` run (350M, bf16, 300 steps; the tiny config on CPU
under ``--smoke``) on a made-up 75/25 corpus, reporting whether the loss falls and its tokens/s."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import yaml

REPO = Path(__file__).resolve().parents[2]
CONFIG_350M = "configs/coca_350m.yml"
CONFIG_TINY = "configs/tiny/rope.yml"
Progress = Callable[[str], None]


class CheckSettings(Protocol):
    """What this section reads of gpu_check's CheckSettings."""

    out: Path
    smoke: bool


WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches near "
         "old stone bridges and rivers flow past green fields under blue skies").split()


def make_corpus(root: Path, documents: int) -> Path:
    """A 75/25 mix of seeded pseudo-prose (jsonl) and Python-like files (txt dir); returns the mix file."""
    rng = random.Random(0)
    root.mkdir(parents=True, exist_ok=True)
    with (root / "prose.jsonl").open("w") as handle:
        for _ in range(documents):
            sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))).capitalize() + "."
                         for _ in range(rng.randint(8, 20))]
            handle.write(json.dumps({"text": " ".join(sentences)}) + "\n")
    code = root / "code"
    code.mkdir(exist_ok=True)
    for index in range(max(documents // 2, 1)):
        lines = [f"def function_{index}_{j}(x, y):\n    total = x + {j} * y\n    return total\n"
                 for j in range(rng.randint(4, 12))]
        (code / f"module_{index:04d}.txt").write_text("\n".join(lines))
    mix = {"groups": {
        "text": {"weight": 0.75, "sources": {"prose": {"type": "jsonl", "path": str(root / "prose.jsonl")}}},
        "code": {"weight": 0.25, "sources": {"code": {"type": "text", "path": str(code)}}},
    }}
    path = root / "mix.yml"
    path.write_text(yaml.safe_dump(mix))
    return path


def train_arguments(settings: CheckSettings, mix: Path, cache: Path, run_dir: Path) -> list[str]:
    if settings.smoke:
        config, iters, micro = CONFIG_TINY, 3, 2
        extra = ["model.vocab_size=384", "model.seq_length=32", "model.max_position_embeddings=32",
                 "model.num_layers=2", "model.hidden_size=64", "model.intermediate_size=256", "precision=fp32"]
    else:
        # ~60 s on one H100; the made-up corpus trains a tokenizer of a few hundred pieces, so the vocabulary
        # is 512 (model.vocab_size must not exceed what the tokenizer can learn)
        config, iters, micro = CONFIG_350M, 300, 8
        extra = ["precision=bf16", "model.vocab_size=512"]
    sets = [f"data.mix={mix}", f"data.cache_dir={cache}", "data.num_workers=1", "data.validation_fraction=0.05",
            "data.tokenizer.sample_chars=200000", "train.train_epochs=1", f"train.train_iters={iters}",
            "train.train_batch_size=null", f"train.train_micro_batch_size_per_gpu={micro}",
            "train.gradient_accumulation_steps=1", "train.zero_stage=0", "train.log_interval=1",
            "train.eval_interval=0", "train.save_interval=0", "train.num_workers=0", "train.wandb.mode=disabled",
            "train.warmup=0.01", "train.lr=3.0e-4" if not settings.smoke else "train.lr=3.0e-3", *extra]
    arguments = [sys.executable, str(REPO / "train.py"), "--config", str(REPO / config), "--run-dir", str(run_dir),
                 "--resume", "none"]
    for assignment in sets:
        arguments += ["--set", assignment]
    return arguments


def section_train(settings: CheckSettings, progress: Progress) -> list[dict[str, Any]]:
    work = settings.out / "train_run"
    run_dir = work / "run"
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    mix = make_corpus(work / "corpus", 240 if settings.smoke else 12000)
    arguments = train_arguments(settings, mix, work / "cache", run_dir)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}
    if settings.smoke:
        env["OMP_NUM_THREADS"] = "1"
    start = time.perf_counter()
    result = subprocess.run(arguments, cwd=REPO, env=env, text=True, capture_output=True, timeout=900)
    seconds = time.perf_counter() - start
    row: dict[str, Any] = {"config": CONFIG_TINY if settings.smoke else CONFIG_350M, "exit_code": result.returncode,
                           "wall_seconds": seconds}
    metrics_path = run_dir / "metrics.jsonl"
    if result.returncode != 0 or not metrics_path.is_file():
        tail = (result.stderr.strip() or result.stdout.strip()).splitlines()[-1:] or ["no output"]
        row["status"] = f"failed: train.py exited {result.returncode}: {tail[0][:300]}"
        return [row]
    metrics = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    losses = [(m["step"], m["loss"]) for m in metrics if m.get("loss") is not None and "step" in m]
    speeds = [m["tokens_per_sec"] for m in metrics if m.get("tokens_per_sec") is not None]
    if not losses:
        row["status"] = "failed: no loss rows in metrics.jsonl"
        return [row]
    first, last = losses[0][1], losses[-1][1]
    steady = speeds[1:] or speeds
    row.update(steps=losses[-1][0], loss_first=first, loss_last=last, loss_falls=last < first,
               tokens_per_sec=sum(steady) / len(steady) if steady else None,
               status="ok" if last < first else "failing: loss did not fall")
    return [row]
