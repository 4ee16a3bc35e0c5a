"""The scheme variants: every position scheme a user can pick, by label (``coca_slack``) and by
``(model.position.scheme, model.position.constraint)``, with the properties code outside the
position schemes asks about (benches, conversion, evaluation, parameter counts, the reproduction).

One table, so that such code asks a variant a question instead of comparing scheme names. How a
scheme computes is ``megatron_lite.model.position``; whether it rotates (and so takes RoPE scalings)
is the config's ``PositionConfig.is_rotary``, which validation needs without the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lite.config import PositionConfig


@dataclass(frozen=True)
class SchemeVariant:
    """One position scheme a user can pick, and what callers outside the schemes need to know of it."""

    label: str  # how CLIs, benches, result files and run directories name it: 'rope', 'coca_slack'
    scheme: str  # model.position.scheme
    constraint: str = "slack"  # model.position.constraint; only the coca scheme has more than one
    alibi_bias: bool = False  # a per-head linear distance bias on the scores (fused kernels take it dense)
    absolute_embedding: bool = False  # a (T, hidden) position embedding added to the token embedding
    position_table: bool = False  # learned rows up to max_position_embeddings: parameters, no extrapolation
    pairwise_keys: bool = False  # the paper's reference form builds a key per (query, key) pair: (B, H, T, S, D)
    stock_gpt_neox: bool = False  # transformers' own GPTNeoXForCausalLM computes it (no remote code)
    stock_llama: bool = False  # transformers' own LlamaForCausalLM / Qwen2ForCausalLM compute it at rotary_pct 1
    in_paper: bool = False  # one of the four models the paper compares (the reproduction, the attention bench)

    @property
    def position(self) -> PositionConfig:
        """This variant's ``model.position`` with every other setting at its default."""
        return PositionConfig(scheme=self.scheme, constraint=self.constraint)  # type: ignore[arg-type]

    @property
    def rotary(self) -> bool:
        """Whether queries and keys are rotated (a rotary embedding; RoPE scalings apply)."""
        return self.position.is_rotary

    @property
    def positionless(self) -> bool:
        """No position information at all: a stock GPT-NeoX export has zero rotary dims."""
        return not (self.rotary or self.alibi_bias or self.absolute_embedding)

    @property
    def overrides(self) -> list[str]:
        """``--set`` overrides that switch a config to this variant."""
        return [f"model.position.scheme={self.scheme}", f"model.position.constraint={self.constraint}"]


VARIANTS: tuple[SchemeVariant, ...] = (
    SchemeVariant("none", "none", stock_gpt_neox=True),
    SchemeVariant("learned", "learned", absolute_embedding=True, position_table=True),
    SchemeVariant("sinusoidal", "sinusoidal", absolute_embedding=True),
    SchemeVariant("alibi", "alibi", alibi_bias=True, in_paper=True),
    SchemeVariant("rope", "rope", stock_gpt_neox=True, stock_llama=True, in_paper=True),
    SchemeVariant("coca_slack", "coca", "slack", in_paper=True),
    SchemeVariant("coca_strict", "coca", "strict", pairwise_keys=True, in_paper=True),
)
LABELS: tuple[str, ...] = tuple(variant.label for variant in VARIANTS)
PAPER_LABELS: tuple[str, ...] = tuple(variant.label for variant in VARIANTS if variant.in_paper)

_BY_LABEL = {variant.label: variant for variant in VARIANTS}


def variant_named(label: str) -> SchemeVariant:
    """The variant a CLI or result file calls ``label``."""
    if label not in _BY_LABEL:
        raise ValueError(f"scheme {label!r}: unknown; choose from {', '.join(LABELS)}")
    return _BY_LABEL[label]


def variant_of(scheme: str, constraint: str = "slack") -> SchemeVariant:
    """The variant of a (scheme, constraint) pair; as in ``model.position``, a scheme with one variant
    ignores the constraint."""
    candidates = [variant for variant in VARIANTS if variant.scheme == scheme]
    if len(candidates) == 1:
        return candidates[0]
    for variant in candidates:
        if variant.constraint == constraint:
            return variant
    if not candidates:
        known = ", ".join(dict.fromkeys(variant.scheme for variant in VARIANTS))
        raise ValueError(f"position scheme {scheme!r}: unknown; choose from {known}")
    raise ValueError(f"position constraint {constraint!r} of scheme {scheme}: choose from "
                     f"{', '.join(variant.constraint for variant in candidates)}")


def variant_of_position(position: PositionConfig) -> SchemeVariant:
    """The variant a config's ``model.position`` selects."""
    return variant_of(position.scheme, position.constraint)
