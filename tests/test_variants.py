"""The scheme-variant table (megatron_lite/model/variants.py): it covers the config schema exactly, its
labels round-trip, and every property it states agrees with what the built model does."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import tiny_config
from megatron_lite import config as config_lib
from megatron_lite.bench.memory import track_peak_memory
from megatron_lite.config import CONSTRAINTS, SCHEMES, Config
from megatron_lite.model import GPT, build_model
from megatron_lite.model.params import analytic_parameter_count
from megatron_lite.model.variants import (
    LABELS,
    PAPER_LABELS,
    VARIANTS,
    SchemeVariant,
    variant_named,
    variant_of,
    variant_of_position,
)

IDS = [variant.label for variant in VARIANTS]
LENGTH = 24  # tokens per test sequence; within tiny_config's 128 learned positions


def variant_config(variant: SchemeVariant, **overrides: object) -> Config:
    return tiny_config(variant.scheme, variant.constraint, **overrides)


def noisy_model(config: Config, seed: int = 0) -> GPT:
    """Large random weights, so that any difference in how positions enter moves the logits."""
    torch.manual_seed(seed)
    model = build_model(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return model


def token_ids(vocab_size: int, length: int = LENGTH, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------
# The table itself


def test_every_schema_setting_has_exactly_one_variant() -> None:
    assert {variant.scheme for variant in VARIANTS} == set(SCHEMES)
    assert len({(variant.scheme, variant.constraint) for variant in VARIANTS}) == len(VARIANTS)
    for scheme in SCHEMES:
        for constraint in CONSTRAINTS:
            matching = [variant for variant in VARIANTS if variant.position == variant_of(scheme, constraint).position]
            assert len(matching) == 1, (scheme, constraint)


@pytest.mark.filterwarnings("ignore:model.position.constraint=strict is ignored")
@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_scheme_has_one_variant_per_constraint_exactly_when_the_constraint_changes_the_model(scheme: str) -> None:
    ids = token_ids(250)
    logits = {constraint: noisy_model(tiny_config(scheme, constraint))(ids) for constraint in CONSTRAINTS}
    differs = not torch.allclose(logits["slack"], logits["strict"])
    assert len({variant_of(scheme, constraint) for constraint in CONSTRAINTS}) == (2 if differs else 1)


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_labels_and_positions_round_trip(variant: SchemeVariant) -> None:
    assert variant_named(variant.label) is variant
    assert variant_of_position(variant.position) is variant
    switched = config_lib.with_overrides(tiny_config("rope"), variant.overrides)
    assert variant_of_position(switched.model.position) is variant


def test_labels_are_those_the_command_lines_offer() -> None:
    assert LABELS == ("none", "learned", "sinusoidal", "alibi", "rope", "coca_slack", "coca_strict")
    assert PAPER_LABELS == ("alibi", "rope", "coca_slack", "coca_strict")


def test_unknown_names_are_one_line_value_errors() -> None:
    with pytest.raises(ValueError, match="'coca'.*coca_slack, coca_strict"):
        variant_named("coca")
    with pytest.raises(ValueError, match="'xpos'.*alibi, rope, coca"):
        variant_of("xpos")
    with pytest.raises(ValueError, match="'loose'.*slack, strict"):
        variant_of("coca", "loose")


def test_variants_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        VARIANTS[0].label = "other"  # type: ignore[misc]


# ----------------------------------------------------------------------------------------------
# Properties against the built model


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_rotary_bias_and_embedding_are_what_the_model_owns(variant: SchemeVariant) -> None:
    model = build_model(variant_config(variant))
    positions = torch.arange(LENGTH)
    assert variant.rotary == (model.rotary is not None)
    assert variant.alibi_bias == (model.position.slopes() is not None)
    assert variant.absolute_embedding == (model.position.embed(positions) is not None)


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_position_table_is_parameters_that_stop_at_max_position_embeddings(variant: SchemeVariant) -> None:
    config = variant_config(variant)
    model = build_model(config)
    assert variant.position_table == any(True for _ in model.position.parameters())
    assert analytic_parameter_count(config.model) == sum(parameter.numel() for parameter in model.parameters())
    beyond = torch.arange(config.model.max_positions, config.model.max_positions + LENGTH)
    if variant.position_table:
        with pytest.raises(ValueError, match="cannot extrapolate"):
            model(token_ids(250), positions=beyond)
    else:
        assert torch.isfinite(model(token_ids(250), positions=beyond)).all()


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_positionless_means_the_order_of_earlier_tokens_does_not_matter(variant: SchemeVariant) -> None:
    model = noisy_model(variant_config(variant, num_layers=1))  # one layer: earlier tokens are a set to the last
    ids = token_ids(250)
    shuffled = torch.cat([ids[:, :-1].flip(1), ids[:, -1:]], dim=1)  # same last token, earlier ones reversed
    last, last_shuffled = model(ids)[:, -1], model(shuffled)[:, -1]
    assert variant.positionless == torch.allclose(last, last_shuffled, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_pairwise_keys_are_what_the_reference_kernel_materialises(variant: SchemeVariant) -> None:
    config = variant_config(variant, **{"attention.backend": "reference"})
    model = build_model(config).eval()
    heads, head_dim = config.model.num_attention_heads, config.model.head_dim
    length = 64
    pairwise_bytes = heads * length * length * head_dim * 4  # one float32 (B=1, H, T, S, D) tensor
    with torch.no_grad(), track_peak_memory() as tracker:
        model(token_ids(250, length))
    assert variant.pairwise_keys == (tracker.peak_bytes >= pairwise_bytes)


def stock_class_computes(model: GPT, config: Config) -> bool:
    """Whether transformers' own class of the architecture, built from our exported config fields and given our
    renamed weights, computes our logits."""
    transformers = pytest.importorskip("transformers")
    from megatron_lite.convert.hf_config import hf_config_fields
    from megatron_lite.convert.hf_names import HF_IN_MEMORY_LM_HEAD, HF_LM_HEAD, to_hf_state

    fields = hf_config_fields(config.model)
    if config.model.is_llama:
        hf_class, hf_config = transformers.LlamaForCausalLM, transformers.LlamaConfig(**fields)
    else:
        hf_class, hf_config = transformers.GPTNeoXForCausalLM, transformers.GPTNeoXConfig(**fields)
    ids = token_ids(250)
    try:
        hf_model = hf_class(hf_config).eval()
        state = {HF_IN_MEMORY_LM_HEAD if name == HF_LM_HEAD else name: tensor  # save_pretrained renames it on disk
                 for name, tensor in to_hf_state(model.state_dict(), config.model).items()}
        unexpected = hf_model.load_state_dict(state, strict=False).unexpected_keys
        if unexpected:  # weights the stock class has no place for (a learned position table)
            return False
        with torch.no_grad():
            hf_logits = hf_model(ids).logits
    except (RuntimeError, ValueError, IndexError):  # settings the stock class cannot run (zero rotary dims)
        return False
    with torch.no_grad():
        return torch.allclose(hf_logits, model(ids), atol=1e-4)


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_stock_gpt_neox_is_what_transformers_gpt_neox_computes(variant: SchemeVariant) -> None:
    config = variant_config(variant)
    assert variant.stock_gpt_neox == stock_class_computes(noisy_model(config), config)


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_stock_llama_is_what_transformers_llama_computes(variant: SchemeVariant) -> None:
    config = variant_config(variant, architecture="llama")
    assert variant.stock_llama == stock_class_computes(noisy_model(config), config)
