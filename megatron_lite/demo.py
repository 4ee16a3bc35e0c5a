"""End-to-end demo on CPU until the DeepSpeed training loop lands: train a tiny model on the UTF-8
bytes of English prose that ships with Python (pydoc topics), report the loss, check KV-cache
decoding against the full forward, and generate text greedily.

Byte ids (0-255) fit every vocabulary, so any config runs without a tokenizer.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from megatron_lite import config as config_lib
from megatron_lite.config import Config
from megatron_lite.eval.generation import generate
from megatron_lite.model import build_model, language_model_loss
from megatron_lite.model.params import counted_parameter_count


def python_prose_bytes() -> torch.Tensor:
    """English documentation shipped with every CPython (the pydoc topic pages) as byte ids."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[name] for name in sorted(topics))
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


@dataclass
class DemoResult:
    first_loss: float
    final_loss: float
    validation_loss: float
    tokens_per_sec: float
    cache_max_abs_diff: float
    sample: str


def random_windows(corpus: torch.Tensor, batch_size: int, length: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, corpus.numel() - length - 1, (batch_size,), generator=generator)
    return torch.stack([corpus[start : start + length + 1] for start in starts.tolist()])  # (B, T + 1)


def run_demo(config: Config, steps: int, batch_size: int, learning_rate: float, run_dir: Path) -> DemoResult:
    torch.manual_seed(config.seed)
    corpus = python_prose_bytes()
    split = int(0.95 * corpus.numel())
    train_bytes, validation_bytes = corpus[:split], corpus[split:]
    model = build_model(config)
    length = config.model.seq_length
    print(f"model: {config.model.position.scheme}"
          f"{' ' + config.model.position.constraint if config.model.position.scheme == 'coca' else ''}, "
          f"{counted_parameter_count(config.model):,} parameters, backend {config.model.attention.backend}; "
          f"corpus: {corpus.numel():,} bytes of pydoc topics")

    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, betas=(0.9, 0.95), weight_decay=0.0)
    generator = torch.Generator().manual_seed(config.seed)
    losses: list[float] = []
    start = time.perf_counter()
    progress = tqdm(range(steps), desc="train", unit="step")
    for _ in progress:
        batch = random_windows(train_bytes, batch_size, length, generator)
        loss = language_model_loss(model(batch[:, :-1]), batch[:, 1:])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        progress.set_postfix(loss=f"{losses[-1]:.3f}")
    tokens_per_sec = steps * batch_size * length / (time.perf_counter() - start)

    model.eval()
    with torch.no_grad():
        validation = random_windows(validation_bytes, 16, length, torch.Generator().manual_seed(0))
        validation_loss = language_model_loss(model(validation[:, :-1]), validation[:, 1:]).item()
        # KV cache check: token-by-token decoding must reproduce the full forward.
        probe = validation[:1, :length]
        cache = model.new_cache(length)
        incremental = torch.cat([model(probe[:, i : i + 1], cache=cache) for i in range(length)], dim=1)
        cache_diff = (incremental - model(probe)).abs().max().item()
        prompt = torch.tensor([list("The ".encode())])
        generated = generate(model, prompt, max_new_tokens=min(120, length))
    sample = bytes(generated[0].clamp(max=255).tolist()).decode("utf-8", errors="replace")

    run_dir.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.contiguous() for name, tensor in model.state_dict().items()}, str(run_dir / "model.safetensors"))
    config_lib.save(config, run_dir / "config.yml")
    result = DemoResult(losses[0], sum(losses[-10:]) / min(10, len(losses)), validation_loss, tokens_per_sec, cache_diff, sample)
    (run_dir / "demo_result.json").write_text(json.dumps(result.__dict__, indent=2))
    return result
