"""tools/generate.py and generate_text: prompt continuation, determinism (greedy, seeded sampling),
RoPE scalings, and errors that name the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_lite.data.tokenizer import Tokenizer
from megatron_lite.eval.generation import generate_text
from megatron_lite.weights import load_model
from test_eval_support import make_checkpoint, make_tokenizer, single_thread  # noqa: F401 (fixture)
from script_loading import load_script


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("generate")
    tokenizer = make_tokenizer(root)
    return {"coca": make_checkpoint(root / "coca", tokenizer, "coca", steps=30),
            "alibi": make_checkpoint(root / "alibi", tokenizer, "alibi", steps=2)}


def test_generate_text_is_deterministic(checkpoints: dict[str, Path]) -> None:
    loaded = load_model(checkpoints["coca"])
    assert loaded.tokenizer_path is not None
    tokenizer = Tokenizer(loaded.tokenizer_path)
    greedy = generate_text(loaded.model, tokenizer, "The old man", 20)
    assert greedy == generate_text(loaded.model, tokenizer, "The old man", 20) and len(greedy) == 1
    sampled = generate_text(loaded.model, tokenizer, "", 20, temperature=1.0, top_k=50, num_samples=3, seed=4)
    assert sampled == generate_text(loaded.model, tokenizer, "", 20, temperature=1.0, top_k=50, num_samples=3, seed=4)
    assert len(sampled) == 3 and len(set(sampled)) > 1  # three different samples from one seed
    assert all(tokenizer.eod_id not in tokenizer.encode(text) for text in sampled)


def test_tool_prints_prompt_and_continuation(checkpoints: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    tool = load_script("tools/generate.py")
    args = [str(checkpoints["coca"]), "--prompt", "The old man", "--max-new-tokens", "16", "--temperature", "0.7",
            "--top-p", "0.9", "--seed", "2"]
    assert tool.main(args) == 0
    first = capsys.readouterr().out
    assert first.startswith("The old man") and len(first) > len("The old man\n")
    assert tool.main(args) == 0 and capsys.readouterr().out == first
    assert tool.main([*args, "--scaling", "dynamic:4", "--num-samples", "2"]) == 0
    assert capsys.readouterr().out.count("--- sample") == 2


@pytest.mark.parametrize("checkpoint,extra,flag", [
    ("coca", ["--scaling", "dynamic"], "--scaling"),
    ("alibi", ["--scaling", "dynamic:2"], "RoPE scaling"),
    ("coca", ["--top-p", "1.5"], "top_p"),
])
def test_tool_errors(checkpoints: dict[str, Path], checkpoint: str, extra: list[str], flag: str,
                     capsys: pytest.CaptureFixture[str]) -> None:
    tool = load_script("tools/generate.py")
    assert tool.main([str(checkpoints[checkpoint]), "--temperature", "1", *extra]) == 2
    assert flag in capsys.readouterr().err
