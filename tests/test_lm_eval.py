"""lm-evaluation-harness on exported models: `lm_eval --model hf` scores a local log-likelihood task
(defined here: a JSON-lines file and a task YAML, nothing downloaded) on a tiny stock GPT-NeoX export
(RoPE) and a tiny remote-code export (CoCA), and every per-example log-likelihood equals our own
model's, summed over the continuation tokens, to 1e-4.

The CoCA model goes through the documented command line (`trust_remote_code=True`); the RoPE model
through `lm_eval.simple_evaluate`, the same HFLM class, to keep the test's time down.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_lite.data.tokenizer import Tokenizer
from megatron_lite.model import GPT, build_model
from test_convert_hf import converter_config, export, train_small_tokenizer

pytestmark = pytest.mark.slow  # end-to-end: lm-evaluation-harness on exported checkpoints

lm_eval = pytest.importorskip("lm_eval")

TASK = "megatron_lite_tiny_loglikelihood"
TOLERANCE = 1e-4
# (context, continuation): prose and code in the tokenizer's domain; contexts end without spaces so that
# lm_eval's context/continuation split (context tokens = tokens of the context alone) is the plain one
DOCS = [
    ("def f(x):\n\tif x:\n\t\treturn", " x"),
    ("the of and to in is was for on that with as by at from it an were are which the of and to in",
     " is was for on that"),
    ("def decode(self, s):\n    return", " self.raw_decode(s)"),
    ("numbers 1234567890", " 3.14159 0xFF 1e-5"),
    ("The grass is green. The sky is blue. The sun is yellow.", " Here we go. There and back again."),
]
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def write_task(directory: Path) -> Path:
    """A loglikelihood task over a local JSON-lines file; its metrics (perplexity, acc) download nothing."""
    directory.mkdir()
    data = directory / "docs.jsonl"
    data.write_text("".join(json.dumps({"context": c, "continuation": t}) + "\n" for c, t in DOCS))
    (directory / f"{TASK}.yaml").write_text(f"""\
task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: perplexity
  - metric: acc
""")
    return directory


def our_loglikelihoods(model: GPT, tokenizer: Tokenizer) -> list[float]:
    """Sum of log p(continuation token | everything before it), one forward over context + continuation."""
    values = []
    for context, continuation in DOCS:
        context_ids, whole_ids = tokenizer.encode(context), tokenizer.encode(context + continuation)
        assert whole_ids[: len(context_ids)] == context_ids, "pick texts whose tokens split at the context"
        inputs_1T = torch.tensor([whole_ids[:-1]])
        with torch.no_grad():
            logprobs_TV = torch.log_softmax(model(inputs_1T)[0].double(), dim=-1)
        targets = torch.tensor(whole_ids[len(context_ids) :])
        rows = torch.arange(len(context_ids) - 1, len(whole_ids) - 1)
        values.append(float(logprobs_TV[rows, targets].sum()))
    return values


def harness_loglikelihoods(samples: list[dict]) -> list[float]:
    by_doc = sorted(samples, key=lambda sample: sample["doc_id"])
    assert [(s["doc"]["context"], s["doc"]["continuation"]) for s in by_doc] == DOCS
    return [float(sample["resps"][0][0][0]) for sample in by_doc]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[GPT, Path, Tokenizer]]:
    root = tmp_path_factory.mktemp("lm_eval")
    tokenizer = train_small_tokenizer(root / "tokenizer.model")
    models = {}
    for scheme in ("rope", "coca"):
        config = converter_config(scheme, "slack", seq_length=16)
        torch.manual_seed(3)
        model = build_model(config).eval()  # the framework's own initialisation: log-likelihoods of a few nats
        models[scheme] = (model, export(model, config, root / scheme, tokenizer.path), tokenizer)
    return models


def test_lm_eval_cli_scores_a_remote_code_coca_export_like_our_model(
    exported: dict[str, tuple[GPT, Path, Tokenizer]], tmp_path: Path
) -> None:
    model, path, tokenizer = exported["coca"]
    assert (path / "modeling_megatron_lite.py").exists()  # remote code, not a stock class
    tasks, out = write_task(tmp_path / "tasks"), tmp_path / "out"
    command = [sys.executable, "-m", "lm_eval", "--model", "hf",
               "--model_args", f"pretrained={path},trust_remote_code=True,dtype=float32",
               "--tasks", TASK, "--include_path", str(tasks), "--device", "cpu", "--batch_size", "2",
               "--log_samples", "--output_path", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **OFFLINE}, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    [samples_file] = out.rglob(f"samples_{TASK}_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    harness, ours = harness_loglikelihoods(samples), our_loglikelihoods(model, tokenizer)
    assert max(abs(a - b) for a, b in zip(harness, ours)) <= TOLERANCE, (harness, ours)
    assert all(value < 0 for value in ours)


def test_lm_eval_scores_a_stock_gpt_neox_rope_export_like_our_model(
    exported: dict[str, tuple[GPT, Path, Tokenizer]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lm_eval.tasks import TaskManager

    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    model, path, tokenizer = exported["rope"]
    assert json.loads((path / "config.json").read_text())["architectures"] == ["GPTNeoXForCausalLM"]
    tasks = TaskManager(include_path=str(write_task(tmp_path / "tasks")), include_defaults=False)
    results = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={path},dtype=float32", tasks=[TASK],
                                      task_manager=tasks, device="cpu", batch_size=2, bootstrap_iters=0,
                                      log_samples=True)
    harness, ours = harness_loglikelihoods(results["samples"][TASK]), our_loglikelihoods(model, tokenizer)
    assert max(abs(a - b) for a, b in zip(harness, ours)) <= TOLERANCE, (harness, ours)
