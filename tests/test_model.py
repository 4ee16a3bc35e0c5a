"""Model: parameter counts, init, precisions, activation checkpointing, overfitting, generation."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from conftest import SCHEME_IDS, SCHEMES, tiny_config
from megatron_lite import config as config_lib
from megatron_lite.eval.generation import generate, sample_next_token
from megatron_lite.model import build_model, language_model_loss
from megatron_lite.model.params import analytic_parameter_count, counted_parameter_count

REPO = Path(__file__).resolve().parents[1]


def test_paper_configs_have_identical_parameter_counts() -> None:
    counts = set()
    for name in ("alibi_350m", "rope_350m", "coca_strict_350m", "coca_350m"):
        model = config_lib.load(REPO / f"configs/{name}.yml").model
        analytic, counted = analytic_parameter_count(model), counted_parameter_count(model)
        assert analytic == counted
        counts.add(counted)
    assert counts == {404_809_728}


@pytest.mark.parametrize("scheme, constraint", SCHEMES, ids=SCHEME_IDS)
def test_analytic_count_matches_instantiated_model(scheme: str, constraint: str) -> None:
    for tied in (True, False):
        model_config = tiny_config(scheme, constraint, no_weight_tying=not tied).model
        assert analytic_parameter_count(model_config) == counted_parameter_count(model_config)


def test_gpt_neox_initialisation() -> None:
    config = tiny_config("rope", num_layers=4, hidden_size=256, num_attention_heads=4)
    model = build_model(config)
    small_init = math.sqrt(2 / (5 * 256))
    wang_init = 2 / (4 * math.sqrt(256))
    assert model.layers[0].attention.query_key_value.weight.std().item() == pytest.approx(small_init, rel=0.05)
    assert model.layers[0].attention.dense.weight.std().item() == pytest.approx(wang_init, rel=0.05)
    assert model.layers[0].mlp.dense_4h_to_h.weight.std().item() == pytest.approx(wang_init, rel=0.05)
    assert model.embed_in.weight.std().item() == pytest.approx(small_init, rel=0.05)
    assert torch.all(model.layers[0].attention.query_key_value.bias == 0)
    assert torch.all(model.final_layer_norm.weight == 1)


def test_same_seed_same_weights_and_parameter_names_follow_gpt_neox() -> None:
    first, second = build_model(tiny_config("coca")), build_model(tiny_config("coca"))
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), name
    names = set(first.state_dict())
    assert {"embed_in.weight", "layers.0.attention.query_key_value.weight", "layers.1.mlp.dense_4h_to_h.bias",
            "layers.0.post_attention_layernorm.weight", "final_layer_norm.weight", "lm_head.weight"} <= names


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("scheme, constraint", [("alibi", "slack"), ("coca", "slack"), ("coca", "strict")], ids=["alibi", "coca_slack", "coca_strict"])
def test_half_precisions_run_forward_and_backward(precision: str, scheme: str, constraint: str) -> None:
    config = tiny_config(scheme, constraint)
    config.precision = precision
    model = build_model(config)
    assert model.embed_in.weight.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    input_ids = torch.randint(0, 250, (2, 24))
    logits = model(input_ids)
    loss = language_model_loss(logits[:, :-1], input_ids[:, 1:])
    loss.backward()
    assert torch.isfinite(loss)
    full = build_model(tiny_config(scheme, constraint)).eval()
    with torch.no_grad():
        assert (model.eval()(input_ids).float() - full(input_ids)).abs().max() < 0.1


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    input_ids = torch.randint(0, 250, (2, 20))
    gradients = []
    for recompute in (False, True):
        model = build_model(tiny_config("coca", checkpoint_activations=recompute))
        language_model_loss(model(input_ids)[:, :-1], input_ids[:, 1:]).backward()
        gradients.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(gradients[0], gradients[1])


def test_logits_from_returns_the_suffix_of_the_full_logits() -> None:
    model = build_model(tiny_config("coca", "strict")).eval()
    ids_BT = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full_BTV = model(ids_BT)
        suffix_BTV = model(ids_BT, logits_from=17)
    assert suffix_BTV.shape == (2, 7, full_BTV.shape[-1])
    torch.testing.assert_close(suffix_BTV, full_BTV[:, 17:])


def test_learned_positions_refuse_to_extrapolate() -> None:
    model = build_model(tiny_config("learned", max_position_embeddings=16)).eval()
    with pytest.raises(ValueError, match="max_position_embeddings=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("scheme, constraint", SCHEMES, ids=SCHEME_IDS)
def test_tiny_model_overfits_one_batch(scheme: str, constraint: str) -> None:
    model = build_model(tiny_config(scheme, constraint))
    generator = torch.Generator().manual_seed(1)
    batch = torch.randint(0, 250, (4, 17), generator=generator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for _ in range(150):
        loss = language_model_loss(model(batch[:, :-1]), batch[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.05 * losses[0], (losses[0], losses[-1])


def test_greedy_generation_is_deterministic_and_matches_argmax_of_full_forward() -> None:
    model = build_model(tiny_config("coca", "strict")).eval()
    prompt = torch.randint(0, 250, (2, 5))
    out = generate(model, prompt, max_new_tokens=8)
    assert out.shape == (2, 13) and torch.equal(out[:, :5], prompt)
    assert torch.equal(out, generate(model, prompt, max_new_tokens=8))
    with torch.no_grad():
        full = model(out[:, :-1])
    assert torch.equal(full[:, 4:].argmax(-1), out[:, 5:])


def test_generation_stops_rows_at_eos() -> None:
    model = build_model(tiny_config("rope")).eval()
    prompt = torch.randint(0, 250, (1, 4))
    first = generate(model, prompt, max_new_tokens=1)[0, -1].item()
    out = generate(model, prompt, max_new_tokens=6, eos_token_id=first)
    assert out.shape == (1, 5) and out[0, -1].item() == first


def test_generation_restores_the_callers_mode_even_when_it_raises() -> None:
    model = build_model(tiny_config("rope")).train()
    prompt = torch.randint(0, 250, (1, 4))
    generate(model, prompt, max_new_tokens=2)
    assert model.training
    with pytest.raises(ValueError, match="temperature=-1"):  # raised inside the decoding loop, in eval mode
        generate(model, prompt, max_new_tokens=2, temperature=-1.0)
    assert model.training
    generate(model.eval(), prompt, max_new_tokens=2)
    assert not model.training


def test_sampling_filters() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).repeat(200, 1)
    generator = torch.Generator().manual_seed(0)
    top1 = sample_next_token(logits, temperature=1.0, top_k=1, generator=generator)
    assert torch.all(top1 == 3)
    top2 = sample_next_token(logits, temperature=1.0, top_k=2, generator=generator)
    assert set(top2.tolist()) == {2, 3}
    nucleus = sample_next_token(logits, temperature=1.0, top_p=0.5, generator=generator)  # p(3)=0.64 crosses 0.5
    assert torch.all(nucleus == 3)
    with pytest.raises(ValueError, match="top_p=1.5"):
        sample_next_token(logits, temperature=1.0, top_p=1.5)
