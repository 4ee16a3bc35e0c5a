"""train.fp8: which GEMMs run in float8, the head's float8 GEMMs against a dequantised reference, a training step,
plain checkpoints, and the one-line errors. CPU runs torch._scaled_mm's reference kernel: the numerics are real,
the speed is not; the compiled CUDA step is the gpu-marked test."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config

from megatron_lite import config as config_lib
from megatron_lite.console import Notice
from megatron_lite.model import GPT
from megatron_lite.model.float8 import (FLOAT8_CHOICES, Float8HeadGemms, apply_float8, float8_problem,
                                        float8_unavailable, plan_float8)
from megatron_lite.model.gpt import build_model
from megatron_lite.model.loss import LMHead, chunked_cross_entropy
from megatron_lite.training.engine import _convert_float8
from megatron_lite.weights import load_model, save_consolidated

pytest.importorskip("torchao")  # the test extra installs it; a bare checkout without it skips here, not fails

NEOX_MLP = {"mlp.dense_h_to_4h", "mlp.dense_4h_to_h"}
NEOX_ATTENTION = {"attention.query_key_value", "attention.dense"}
LLAMA_MLP = {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
LLAMA_ATTENTION = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"}


def _float8_linears(model: GPT) -> set[str]:
    return {name for name, module in model.named_modules() if type(module).__name__ == "Float8Linear"}


def _per_layer(suffixes: set[str], layers: int = 2) -> set[str]:
    return {f"layers.{index}.{suffix}" for index in range(layers) for suffix in suffixes}


def test_each_choice_converts_exactly_its_layers_and_keeps_the_parameters() -> None:
    expected = {"gpt_neox": {"none": set(), "lm_head": set(), "mlp": NEOX_MLP, "all": NEOX_MLP | NEOX_ATTENTION},
                "llama": {"none": set(), "lm_head": set(), "mlp": LLAMA_MLP, "all": LLAMA_MLP | LLAMA_ATTENTION}}
    for architecture, by_choice in expected.items():
        plain = build_model(tiny_config(architecture=architecture, precision="bf16"))
        for choice in FLOAT8_CHOICES:
            model = copy.deepcopy(plain)
            parameters = dict(model.named_parameters())
            plan = apply_float8(model, choice)
            assert _float8_linears(model) == set(plan.linears) == _per_layer(by_choice[choice]), (architecture, choice)
            head = choice in ("lm_head", "all")
            assert plan.head == head and model.lm_head.gemm == ("float8" if head else "mixed")
            assert type(model.lm_head) is LMHead and not plan.skipped
            # the same Parameter objects in the same order: optimizer state and checkpoints map as before
            assert list(model.named_parameters()) == list(parameters.items())
            assert list(model.state_dict()) == list(plain.state_dict())
            assert all(type(tensor) is torch.Tensor for tensor in model.state_dict().values())


def test_layers_whose_dimensions_are_not_multiples_of_16_stay_and_are_named() -> None:
    model = build_model(tiny_config(intermediate_size=200, precision="bf16"))  # 200 % 16 = 8
    plan = apply_float8(model, "all")
    assert _float8_linears(model) == _per_layer(NEOX_ATTENTION) and plan.head
    assert plan.skipped == ["layers.0.mlp.dense_h_to_4h (200x64)", "layers.0.mlp.dense_4h_to_h (64x200)",
                            "layers.1.mlp.dense_h_to_4h (200x64)", "layers.1.mlp.dense_4h_to_h (64x200)"]
    line = plan.skipped_notice()
    assert line is not None and "\n" not in line and "4 layer(s)" in line and "divisible by 16" in line
    narrow = plan_float8(build_model(tiny_config(hidden_size=72, num_attention_heads=4)), "lm_head")  # 72 % 16 = 8
    assert not narrow.head and narrow.skipped == ["lm_head (256x72)"]


def _dequantised(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x through a float8 cast with one scale (amax -> the dtype's max), back in float32: the reference."""
    scale = torch.finfo(dtype).max / x.float().abs().amax()
    return (x.float() * scale).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype).float() / scale


def test_head_gemms_equal_their_dequantised_operands_products() -> None:
    hidden_NC, weight_VC = torch.randn(20, 64, dtype=torch.bfloat16), torch.randn(256, 64, dtype=torch.bfloat16)
    grad_NV = torch.randn(20, 256, dtype=torch.bfloat16)
    gemms = Float8HeadGemms("float8", hidden_NC, weight_VC)
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    cases = [  # (float8 GEMM, reference, shape)
        (gemms.logits(hidden_NC, weight_VC), _dequantised(hidden_NC, e4m3) @ _dequantised(weight_VC, e4m3).t()),
        (gemms.matmul(grad_NV, weight_VC), _dequantised(grad_NV, e5m2) @ _dequantised(weight_VC, e4m3)),
        # grad_weight: the inner dimension is 20 tokens, padded to 32 with zeros
        (gemms.matmul(grad_NV.t(), hidden_NC), _dequantised(grad_NV, e5m2).t() @ _dequantised(hidden_NC, e4m3)),
    ]
    for product, reference in cases:
        assert product.dtype == torch.float32 and product.shape == reference.shape
        torch.testing.assert_close(product, reference, rtol=1e-5, atol=1e-4)
    plain = hidden_NC.float() @ weight_VC.float().t()
    assert 0 < (cases[0][0] - plain).norm() / plain.norm() < 0.1  # e4m3's 3 mantissa bits, not bf16's 8


def test_fused_head_loss_in_float8_is_the_dequantised_loss() -> None:
    hidden_NC = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    weight_VC = torch.randn(256, 64, dtype=torch.bfloat16, requires_grad=True)
    labels_N = torch.randint(0, 256, (32,))
    labels_N[3] = -100
    loss = chunked_cross_entropy(hidden_NC, weight_VC, labels_N, chunk_tokens=32, gemm="float8")
    logits = _dequantised(hidden_NC.detach(), torch.float8_e4m3fn) @ _dequantised(weight_VC.detach(),
                                                                                  torch.float8_e4m3fn).t()
    torch.testing.assert_close(loss, F.cross_entropy(logits, labels_N), rtol=1e-5, atol=1e-5)
    loss.backward()
    reference_hidden, reference_weight = hidden_NC.detach().clone().requires_grad_(), weight_VC.detach().clone()
    reference_weight.requires_grad_()
    F.cross_entropy(F.linear(reference_hidden.float(), reference_weight.float()), labels_N).backward()
    for grad, reference in ((hidden_NC.grad, reference_hidden.grad), (weight_VC.grad, reference_weight.grad)):
        assert grad is not None and reference is not None and grad.dtype == torch.bfloat16
        assert F.cosine_similarity(grad.float().flatten(), reference.float().flatten(), dim=0) > 0.99


def test_training_step_in_float8_follows_the_bf16_step() -> None:
    plain = build_model(tiny_config(precision="bf16"))
    input_ids, labels = torch.randint(0, 250, (2, 16)), torch.randint(0, 250, (2, 16))
    runs = {}
    for choice in ("none", "all"):
        model = copy.deepcopy(plain)
        apply_float8(model, choice)
        loss = model(input_ids, labels=labels)
        loss.backward()
        runs[choice] = loss.detach(), {name: p.grad for name, p in model.named_parameters()}
    (loss8, grads8), (loss16, grads16) = runs["all"], runs["none"]
    assert abs(loss8.item() - loss16.item()) < 0.05 and loss8.item() != loss16.item()
    for name, grad in grads16.items():
        grad8 = grads8[name]
        assert grad8 is not None and grad is not None and torch.isfinite(grad8).all(), name
        assert F.cosine_similarity(grad8.float().flatten(), grad.float().flatten(), dim=0) > 0.9, name


def test_weights_trained_in_float8_load_into_a_plain_model(tmp_path) -> None:
    config = tiny_config(precision="bf16")
    model = build_model(config)
    apply_float8(model, "all")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 250, (2, 16)), labels=torch.randint(0, 250, (2, 16))).backward()
    optimizer.step()
    save_consolidated(model.state_dict(), config, tmp_path / "consolidated")
    loaded = load_model(tmp_path / "consolidated", dtype=torch.bfloat16).model
    assert not _float8_linears(loaded) and loaded.lm_head.gemm == "mixed"
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_config_and_machine_errors_are_one_line(monkeypatch) -> None:
    with pytest.raises(ValueError, match=r"^train\.fp8='fp4': must be one of 'none', 'lm_head', 'mlp', 'all'$"):
        config_lib.from_dict({"train": {"fp8": "fp4"}})
    cpu = torch.device("cpu")
    assert float8_problem("none", True, cpu) is None and float8_unavailable(cpu) == "this run's device is cpu"
    line = float8_problem("mlp", True, cpu)
    assert line is not None and "\n" not in line
    assert line.startswith("train.fp8=mlp: FP8 matmuls need a CUDA GPU of compute capability 8.9") and "cpu" in line
    assert float8_problem("lm_head", False, cpu) == (
        "train.fp8=lm_head: the head's FP8 GEMMs live in the fused loss, and train.fused_loss=false; "
        "set train.fused_loss=true")
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # torchao not installed
    missing = float8_problem("all", True, cpu)
    assert missing is not None and "\n" not in missing
    assert missing.startswith("train.fp8=all needs torchao")
    assert missing.endswith('pip install -e ".[fp8]" -c constraints.txt')


def test_engine_hook_converts_and_says_what_in_one_line_each(capsys) -> None:
    config = config_lib.from_dict({"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                             "intermediate_size": 200, "vocab_size": 250},
                                   "train": {"fp8": "all", "loss_gemm": "fp32"}})
    model = GPT(config.model)
    model.use_loss_settings(config.train)
    with pytest.warns(Notice) as notices:
        _convert_float8(model, config, is_main=True)
    assert _float8_linears(model) == _per_layer(NEOX_ATTENTION) and model.lm_head.gemm == "float8"
    assert capsys.readouterr().out.startswith("train.fp8=all: 4 block linears and the LM head's loss GEMMs in FP8")
    lines = [str(each.message) for each in notices]
    assert len(lines) == 2 and all("\n" not in line for line in lines)
    assert lines[0].startswith("train.fp8=all: 4 layer(s) stay in the model's dtype")
    assert lines[1] == ("train.loss_gemm=fp32: the LM head's GEMMs run in FP8 (train.fp8=all), "
                        "the setting does not apply")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or float8_unavailable(torch.device("cuda")) is not None,
                    reason="needs a CUDA GPU of compute capability 8.9+")
def test_compiled_float8_step_on_cuda_follows_bf16() -> None:
    from megatron_lite.model.compile import compile_model

    plain = build_model(tiny_config(precision="bf16"), device="cuda")
    input_ids, labels = torch.randint(0, 250, (2, 16), device="cuda"), torch.randint(0, 250, (2, 16), device="cuda")
    losses = {}
    for choice in ("none", "all"):
        model = copy.deepcopy(plain)
        apply_float8(model, choice)
        compile_model(model, "regional")
        loss = model(input_ids, labels=labels)
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        losses[choice] = loss.item()
    assert abs(losses["all"] - losses["none"]) < 0.05
