"""The paper's fine-tune on the LLaMA family, as a user runs it: a tiny ``LlamaForCausalLM`` built by
transformers (random config, grouped-query attention, no download) is imported with ``--coca slack``, then
train.py runs the three stages (K projection -> q/k/v -> everything) from it with train.init_from. Frozen
tensors stay bitwise unchanged in stages 1-2, everything trains in stage 3, optimizer state covers the
trainable elements only, the counts are logged, and a SIGKILL inside stage 2 resumes bitwise."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_lite import checkpoint_dirs
from megatron_lite import config as config_lib
from megatron_lite.convert import convert_checkpoint
from megatron_lite.weights import load_state_dict
from training_helpers import metrics, optimizer_elements, run_train, step_weights, tiny_train_config, train_losses, write_config

pytestmark = pytest.mark.slow  # multi-rank or end-to-end runs of train.py

transformers = pytest.importorskip("transformers")

STAGES = [{"steps": 3, "trainable": ["*.self_attn.k_proj.*"]},
          {"steps": 3, "trainable": ["*.self_attn.q_proj.*", "*.self_attn.k_proj.*", "*.self_attn.v_proj.*"]},
          {"steps": 2, "trainable": ["*"]}]
STAGE_ENDS = (3, 6, 8)
TRAINS = [("self_attn.k_proj",), ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("",)]  # name parts


@pytest.fixture(scope="module")
def imported_coca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny HF Llama (4 query heads on 2 key/value heads, the training vocabulary of 384) as CoCA slack."""
    root = tmp_path_factory.mktemp("llama_import")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "hf")
    convert_checkpoint(root / "hf", root / "coca", "megatron_lite", coca="slack")
    return root / "coca"


def staged_config(imported: Path, mix: Path, cache: Path, **train: Any) -> dict[str, Any]:
    data = tiny_train_config(mix, cache, **{"train_iters": None, "save_interval": 4, "eval_interval": 0,
                                            "stages": STAGES, "init_from": str(imported), **train})
    data["model"] = config_lib.to_dict(config_lib.load(imported / checkpoint_dirs.CONFIG_FILE))["model"]
    return data


@pytest.fixture(scope="module")
def uninterrupted(training_corpus, imported_coca: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("llama_stages")
    config = write_config(root / "config.yml", staged_config(imported_coca, *training_corpus))
    return root / "run", run_train(config, root / "run").stdout


def trains(name: str, stage: int) -> bool:
    return any(part in name for part in TRAINS[stage])


def test_imported_llama_three_stages_freeze_train_and_hold_state_for_trainable_only(imported_coca: Path,
                                                                                   uninterrupted) -> None:
    run, stdout = uninterrupted
    imported, config, _ = load_state_dict(imported_coca)
    assert config.model.is_llama and config.model.kv_heads == 2 and config.model.position.label == "coca slack"
    starts = [imported] + [step_weights(run, end) for end in STAGE_ENDS[:-1]]
    total = sum(tensor.numel() for tensor in imported.values())
    for stage, end in enumerate(STAGE_ENDS):
        before, after = starts[stage], step_weights(run, end)
        assert after.keys() == before.keys()
        moved = {name for name in before if not torch.equal(before[name], after[name])}
        assert moved == {name for name in before if trains(name, stage)}, f"stage {stage + 1}"
        expected = sum(tensor.numel() for name, tensor in before.items() if trains(name, stage))
        found = optimizer_elements(run / checkpoint_dirs.CHECKPOINTS_DIR / checkpoint_dirs.step_tag(end))
        assert found["exp_avg"] == found["exp_avg_sq"] == expected, (stage, found)
        assert f"trainable {expected:,} of {total:,} parameters" in stdout
    assert f"initialised weights from {imported_coca}" in stdout
    assert [row["stage"] for row in metrics(run) if row.get("loss") is not None] == [1, 1, 1, 2, 2, 2, 3, 3]


def test_sigkill_inside_stage_2_resumes_bitwise(training_corpus, imported_coca: Path, uninterrupted,
                                               tmp_path: Path) -> None:
    baseline = uninterrupted[0]
    killed = write_config(tmp_path / "killed.yml", staged_config(imported_coca, *training_corpus,
                                                                 fault_injection={"kill_after_step": 5}))
    assert run_train(killed, tmp_path / "run", check=False).returncode == -signal.SIGKILL
    resumed = run_train(write_config(tmp_path / "config.yml", staged_config(imported_coca, *training_corpus)),
                        tmp_path / "run")
    assert "step_00000004 at step 4" in resumed.stdout and "stage 2/3 (steps 4-6)" in resumed.stdout
    assert train_losses(tmp_path / "run") == train_losses(baseline)
    ours, theirs = step_weights(tmp_path / "run", 8), step_weights(baseline, 8)
    assert not [name for name in ours if not torch.equal(ours[name], theirs[name])]
