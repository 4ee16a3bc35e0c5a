"""Builders shared by the evaluation tests (no tests here): generated books, a tiny SentencePiece
tokenizer trained on them, and tiny checkpoints trained for a few steps with plain torch."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from megatron_lite import config as config_lib
from megatron_lite.config import Config
from megatron_lite.data.tokenizer import Tokenizer, train_tokenizer
from megatron_lite.eval.passkey import FILLER, KEY_SENTENCE, QUESTION, TASK
from megatron_lite.model import build_model, language_model_loss
from megatron_lite.weights import save_consolidated

WORDS = ("the of and to in was he it that his her with as had for she at on by which not be this from "
         "but they were all said one so there when an their been would my old man house night door").split()
GUTENBERG_HEADER = ("The Project Gutenberg eBook of A Test\r\n\r\n"
                    "*** START OF THE PROJECT GUTENBERG EBOOK A TEST ***\r\n")
GUTENBERG_FOOTER = "\r\n*** END OF THE PROJECT GUTENBERG EBOOK A TEST ***\r\nLicence text that must not be scored.\r\n"


@pytest.fixture(autouse=True, scope="module")
def single_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread; on a shared 2-core machine, two threads per op can be
    100x slower. Restored afterwards. Modules that import this fixture get it automatically."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def book_text(seed: int, num_sentences: int) -> str:
    """Prose from a small word list, in paragraphs."""
    rng = random.Random(seed)
    sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 14))).capitalize() + "."
                 for _ in range(num_sentences)]
    return "\n\n".join(" ".join(sentences[i : i + 6]) for i in range(0, len(sentences), 6))


def tokenizer_corpus() -> list[str]:
    passkey_lines = [TASK, FILLER * 3, QUESTION] + [KEY_SENTENCE.format(key=k) for k in (12345, 67890, 40213)]
    return [book_text(seed, 200) for seed in range(3)] + ["\n".join(passkey_lines)] * 3


def make_tokenizer(directory: Path, vocab_size: int = 320) -> Tokenizer:
    return train_tokenizer(tokenizer_corpus(), directory / "tokenizer.model", vocab_size)


def tiny_eval_config(scheme: str = "rope", constraint: str = "slack", seq_length: int = 32, hidden_size: int = 32,
                     vocab_size: int = 320) -> Config:
    return config_lib.from_dict({
        "model": {"num_layers": 2, "hidden_size": hidden_size, "num_attention_heads": 4, "seq_length": seq_length,
                  "max_position_embeddings": seq_length, "vocab_size": vocab_size,
                  "make_vocab_size_divisible_by": 128,
                  "position": {"scheme": scheme, "constraint": constraint},
                  "attention": {"backend": "sdpa", "chunk_size": 16}},
        "seed": 3, "precision": "fp32",
    })


def train_tiny(config: Config, token_ids: torch.Tensor, steps: int, batch_size: int = 8) -> dict[str, torch.Tensor]:
    """A few AdamW steps on random windows of ``token_ids``; returns the state dict."""
    model = build_model(config)
    generator = torch.Generator().manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    length = config.model.seq_length
    for _ in range(steps):
        starts = torch.randint(0, token_ids.numel() - length - 1, (batch_size,), generator=generator)
        batch_BT = torch.stack([token_ids[s : s + length + 1] for s in starts.tolist()])  # (B, T + 1)
        loss = language_model_loss(model(batch_BT[:, :-1]), batch_BT[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.state_dict()


def make_checkpoint(directory: Path, tokenizer: Tokenizer, scheme: str = "rope", constraint: str = "slack",
                    steps: int = 20, seq_length: int = 32) -> Path:
    config = tiny_eval_config(scheme, constraint, seq_length, vocab_size=tokenizer.vocab_size)
    corpus = torch.tensor(tokenizer.encode(book_text(99, 300)), dtype=torch.long)
    state = train_tiny(config, corpus, steps)
    return save_consolidated(state, config, directory, tokenizer.path)


def write_books(directory: Path, lengths_in_sentences: list[int], gutenberg: bool = True) -> Path:
    """One .txt per book with Gutenberg boilerplate and CRLF line ends, as raw PG files come."""
    directory.mkdir(parents=True, exist_ok=True)
    for index, num_sentences in enumerate(lengths_in_sentences):
        body = book_text(1000 + index, num_sentences).replace("\n", "\r\n")
        text = GUTENBERG_HEADER + body + GUTENBERG_FOOTER if gutenberg else body
        (directory / f"book_{index:02d}.txt").write_text(text, newline="")
    return directory
