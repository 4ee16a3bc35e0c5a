"""The paper's learning-rate schedule, weight-decay groups and the DeepSpeed batch triple."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from megatron_lite import config as config_lib
from megatron_lite.model import GPT
from megatron_lite.training.deepspeed_config import deepspeed_config, resolve_batch_sizes
from megatron_lite.training.optim import SkippableAdamW, build_optimizer, weight_decay_groups
from megatron_lite.config import TrainConfig
from megatron_lite.training.schedule import learning_rate, warmup_steps

from conftest import tiny_config


def paper_lr(step: int, total: int) -> float:
    """Paper section 4, written out independently: 1% linear warm-up 1e-7 -> 1e-4, linear decay to 1e-5."""
    warmup = round(0.01 * total)
    if step <= warmup:
        return 1e-7 + (1e-4 - 1e-7) * step / warmup
    return 1e-4 - (1e-4 - 1e-5) * (step - warmup) / (total - 1 - warmup)


@pytest.mark.parametrize("total", [1000, 12_345, 390_000])
def test_paper_schedule_at_key_steps(total: int) -> None:
    train = TrainConfig()  # defaults are the paper's
    warmup = warmup_steps(train, total)
    assert warmup == round(0.01 * total)
    middle = warmup + (total - 1 - warmup) // 2
    for step, expected in [(0, 1e-7), (warmup, 1e-4), (total - 1, 1e-5)]:
        assert learning_rate(step, total, train) == pytest.approx(expected, rel=1e-12, abs=1e-18)
    for step in (0, warmup // 2, warmup, middle, total - 1):
        assert learning_rate(step, total, train) == pytest.approx(paper_lr(step, total), rel=1e-12)
    assert learning_rate(middle, total, train) == pytest.approx((1e-4 + 1e-5) / 2, rel=2 / total)


def test_schedule_rejects_steps_outside_the_run() -> None:
    with pytest.raises(ValueError, match="step=10"):
        learning_rate(10, 10, TrainConfig())


def test_weight_decay_only_on_matrices() -> None:
    model = GPT(tiny_config("coca").model)
    decay, no_decay = weight_decay_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert "embed_in.weight" in decay["param_names"] and "lm_head.weight" in decay["param_names"]
    assert "layers.0.attention.query_key_value.weight" in decay["param_names"]
    assert "layers.0.attention.query_key_value.bias" in no_decay["param_names"]
    assert "layers.0.input_layernorm.weight" in no_decay["param_names"]
    assert "final_layer_norm.bias" in no_decay["param_names"]
    counted = sum(p.numel() for p in decay["params"]) + sum(p.numel() for p in no_decay["params"])
    assert counted == sum(p.numel() for p in model.parameters())


def test_optimizer_reports_its_group_sizes() -> None:
    model = GPT(tiny_config("coca").model)
    decay, no_decay = weight_decay_groups(model, 0.1)
    summary = build_optimizer(model, TrainConfig(weight_decay=0.1)).groups_summary
    for group in (decay, no_decay):
        size = f"{group['name']} {len(group['params'])} tensors ({sum(p.numel() for p in group['params']):,} parameters"
        assert size in summary, summary
    assert "weight decay 0.1)" in summary and "weight decay 0)" in summary


def test_skipped_step_leaves_weights_and_moments_untouched() -> None:
    model = torch.nn.Linear(4, 4)
    optimizer = build_optimizer(model, TrainConfig(lr=0.1))
    assert isinstance(optimizer, SkippableAdamW)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    before = [p.detach().clone() for p in model.parameters()]
    moments = [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]
    model(torch.ones(1, 4)).sum().backward()
    optimizer.skip_next_step = True
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(torch.equal(m, optimizer.state[p]["exp_avg"]) for m, p in zip(moments, model.parameters()))
    assert not optimizer.skip_next_step  # one step only
    optimizer.step()
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def _config(**train: object) -> config_lib.Config:
    return config_lib.from_dict({"model": {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2},
                                 "train": train})


def test_batch_triple_consistent_and_derived() -> None:
    config = _config(train_batch_size=256, train_micro_batch_size_per_gpu=16, gradient_accumulation_steps=2)
    assert resolve_batch_sizes(config, 8).global_batch_size == 256
    generated = deepspeed_config(config, resolve_batch_sizes(config, 8))
    assert (generated["train_batch_size"], generated["train_micro_batch_size_per_gpu"],
            generated["gradient_accumulation_steps"]) == (256, 16, 2)
    assert resolve_batch_sizes(_config(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=3), 2).global_batch_size == 24
    assert resolve_batch_sizes(_config(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=3), 2).tokens_per_step(64) == 24 * 64


def test_inconsistent_batch_triple_names_all_three() -> None:
    config = _config(train_batch_size=256, train_micro_batch_size_per_gpu=16, gradient_accumulation_steps=2)
    with pytest.raises(ValueError) as error:
        resolve_batch_sizes(config, 4)
    message = str(error.value)
    for part in ("train.train_batch_size=256", "train_micro_batch_size_per_gpu=16", "gradient_accumulation_steps=2",
                 "4 data-parallel ranks"):
        assert part in message


SHIPPED_CONFIGS = sorted(path for path in Path("configs").rglob("*.yml") if path.parent.name != "data")
WORLD_SIZES = (1, 2, 4, 8, 16, 32, 64)


@pytest.mark.parametrize("path", SHIPPED_CONFIGS, ids=str)
def test_shipped_configs_keep_their_global_batch_on_any_world_size(path: Path) -> None:
    """Accumulation is derived (null in every shipped config): the global batch holds wherever it divides;
    elsewhere one line names the numbers and micro batch sizes that do keep it, and those work."""
    config = config_lib.load(path)
    train = config.train
    assert train.gradient_accumulation_steps is None
    for world_size in WORLD_SIZES:
        wanted = train.train_batch_size or train.train_micro_batch_size_per_gpu * world_size
        if wanted % (train.train_micro_batch_size_per_gpu * world_size):
            with pytest.raises(ValueError) as error:
                resolve_batch_sizes(config, world_size)
            message = str(error.value)
            assert "\n" not in message and f"train.train_batch_size={wanted} " in message
            assert f"train_micro_batch_size_per_gpu={train.train_micro_batch_size_per_gpu} x {world_size} " in message
            if wanted % world_size:
                assert f"no micro batch size keeps it on {world_size} ranks" in message
                continue
            suggested = re.search(r"train.train_micro_batch_size_per_gpu=([0-9, or]+) keeps it", message)
            assert suggested, message
            for micro in suggested.group(1).replace(" or ", ", ").split(", "):
                fitted = config_lib.load(path, [f"train.train_micro_batch_size_per_gpu={micro}"])
                assert resolve_batch_sizes(fitted, world_size).global_batch_size == wanted
            continue
        batch = resolve_batch_sizes(config, world_size)
        assert batch.global_batch_size == wanted and batch.accumulation_derived
        assert batch.micro_batch_size == train.train_micro_batch_size_per_gpu and batch.data_parallel_size == world_size


def test_paper_batch_on_one_to_sixty_four_gpus() -> None:
    config = config_lib.load("configs/coca_350m.yml")
    triples = {world: resolve_batch_sizes(config, world) for world in (1, 2, 4, 8, 16)}
    assert {world: b.gradient_accumulation_steps for world, b in triples.items()} == {1: 16, 2: 8, 4: 4, 8: 2, 16: 1}
    assert triples[8].describe() == "batch 256 = 16 micro x 2 accumulation (derived) x 8 rank(s)"
    for world_size, micro in ((32, "8, 4, 2 or 1"), (64, "4, 2 or 1")):
        with pytest.raises(ValueError, match=f"x {world_size} data-parallel ranks = {16 * world_size}; "
                                             f"train.train_micro_batch_size_per_gpu={micro} keeps it"):
            resolve_batch_sizes(config, world_size)
    with pytest.raises(ValueError, match="no micro batch size keeps it on 3 ranks"):
        resolve_batch_sizes(config, 3)


def test_explicit_accumulation_keeps_the_strict_check() -> None:
    explicit = config_lib.load("configs/coca_350m.yml", ["train.gradient_accumulation_steps=2"])
    assert not resolve_batch_sizes(explicit, 8).accumulation_derived
    assert "(derived)" not in resolve_batch_sizes(explicit, 8).describe()
    with pytest.raises(ValueError, match=r"train.train_batch_size=256 != train.train_micro_batch_size_per_gpu=16 x "
                                         r"train.gradient_accumulation_steps=2 x 1 data-parallel ranks = 32"):
        resolve_batch_sizes(explicit, 1)
    unset_global = _config(train_micro_batch_size_per_gpu=4)
    assert resolve_batch_sizes(unset_global, 3).global_batch_size == 12
    with pytest.raises(ValueError, match="train.gradient_accumulation_steps=0: must be positive"):
        _config(gradient_accumulation_steps=0)


def test_deepspeed_config_precision_zero_and_passthrough() -> None:
    config = config_lib.from_dict({"precision": "bf16", "train": {"zero_stage": 3, "gradient_clipping": 0.5,
                                                                  "deepspeed": {"zero_optimization": {"overlap_comm": True},
                                                                                "wall_clock_breakdown": True}}})
    generated = deepspeed_config(config, resolve_batch_sizes(config, 1))
    assert generated["bf16"] == {"enabled": True} and "fp16" not in generated
    assert generated["zero_optimization"] == {"stage": 3, "overlap_comm": True}
    assert generated["gradient_clipping"] == 0.5 and generated["wall_clock_breakdown"] is True
    fp16_config = config_lib.from_dict({"precision": "fp16"})
    fp16 = deepspeed_config(fp16_config, resolve_batch_sizes(fp16_config, 1))["fp16"]
    assert fp16["enabled"] and fp16["loss_scale"] == 0  # 0 = dynamic loss scaling


@pytest.mark.parametrize("override, key", [
    ("train.zero_stage=4", "train.zero_stage=4"),
    ("train.min_lr=1.0", "train.min_lr=1.0"),
    ("train.warmup=1.5", "train.warmup=1.5"),
    ("train.gradient_clip=1", "did you mean train.gradient_clipping"),
    ("train.wandb.mode=loud", "train.wandb.mode='loud'"),
])
def test_train_config_errors_name_the_key(override: str, key: str) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.").replace("(", r"\(")):
        config_lib.from_dict(config_lib.apply_overrides({}, [override]))
