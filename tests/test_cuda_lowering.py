"""dev/inductor_cuda_code.py: what inductor generates for CUDA for one block, read on a CPU. The counting is
checked on lines of a real generated wrapper (torch 2.11's, for an H200); the lowering itself where a CUDA build of
torch and triton are installed (a developer's venv with the GPU node's torch 2.11.0+cu130 and triton 3.6; CI has
the CPU build, and skips it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from dev.cuda_lowering import (LoweringSettings, count_launches, format_lowering, heads_cuda_gemms_on_cpu,
                               lower_for_cuda, lowering_settings)
from megatron_lite.cli import EXIT_USER_ERROR
from megatron_lite.model import loss

# from the backward of one rope block at micro batch 16 (the wrapper's call, comments and bookkeeping left out)
WRAPPER = """
    def call(self, args):
        with torch.cuda._DeviceGuard(0):
            stream0 = get_raw_stream(0)
            triton_red_fused_sum_view_1.run(tangents_1, buf2, buf19, 65536, 128, stream=stream0)
            # Topologically Sorted Source Nodes: [view_10, permute_9, mm_1], Original ATen: [aten.view, aten.mm]
            extern_kernels.mm(reinterpret_tensor(tangents_1, (1024, 8192), (1, 1024), 0), view_8, out=buf1)
            buf22 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(buf17, add_2, 0.0)
            triton_per_fused_add_native_layer_norm_native_layer_norm_backward_view_8.run(buf27, workspace_0, 8192, 1024, stream=stream0)
            buf12 = workspace_0[0 * 512 * 1024 : (0 + 1) * 512 * 1024].view(512, 1024).sum(dim=0)
            buf34 = workspace_0[1 * 512 * 1024 : (1 + 1) * 512 * 1024].view(512, 1024).sum(dim=0)
            extern_kernels.mm(reinterpret_tensor(buf4, (8192, 4096), (4096, 1), 0), primals_12, out=buf5)
            triton_poi_fused_native_layer_norm_backward_10.run(buf12, buf15, 1024, stream=stream0)
"""


def test_a_wrappers_launches_library_calls_and_aten_reductions_are_counted() -> None:
    graph = count_launches("block backward", WRAPPER, tokens=8192, scheduler_bytes=8192 * 100)
    assert graph.triton_launches == 3
    assert graph.library_calls == ["extern_kernels.mm",
                                   "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
                                   "extern_kernels.mm"]
    assert graph.wrapper_reductions == ["sum [512, 1024]", "sum [512, 1024]"]
    assert graph.bytes_per_token == 100
    table = format_lowering([graph], LoweringSettings(inductor={"triton": {"mix_order_reduction": True}}))
    assert "with triton.mix_order_reduction=True" in table
    assert ("| block backward | 3 | 2 x extern_kernels.mm, 1 x torch.ops.aten._scaled_dot_product_flash_attention_"
            "for_cpu_backward.default | sum [512, 1024], sum [512, 1024] | 100 |") in table


def test_bad_settings_stop_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"^--inductor.triton.mix_order: not an inductor setting"):
        lowering_settings("configs/coca_350m.yml", "rope", 16, ["triton.mix_order=false"]).validate()
    with pytest.raises(ValueError, match=r"^--micro-batch 0: must be >= 1"):
        lowering_settings("configs/coca_350m.yml", "rope", 0, []).validate()
    with pytest.raises(ValueError, match=r"^--layers 0: must be >= 1"):
        lowering_settings("configs/coca_350m.yml", "rope", 16, [], "whole", 0).validate()
    with pytest.raises(ValueError, match=r"^--blocks-per-region 2: must be >= 1, and 1 unless --compile-mode regional"):
        lowering_settings("configs/coca_350m.yml", "rope", 16, [], "whole", 2, 2).validate()


def test_the_cpu_pass_traces_the_heads_cuda_gemms_and_leaves_cpu_as_it_was() -> None:
    """Inside, a bf16 head on CPU multiplies bf16 operands into float32 (aten::mm.dtype, given a CPU kernel: the CUDA
    path's numerics); outside, CPU has no such kernel again and the head takes its CPU path (float32 operands)."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(32, 16, dtype=torch.bfloat16)
    with heads_cuda_gemms_on_cpu():
        gemms = loss._HeadGemms("mixed", hidden, weight)
        assert gemms.operand_dtype == torch.bfloat16 and gemms.compute_dtype == torch.float32
        logits = gemms.matmul(hidden, gemms.weight_VC.t())
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hidden.float() @ weight.float().t(), rtol=0, atol=1e-5)
    assert loss._HeadGemms("mixed", hidden, weight).operand_dtype == torch.float32
    with pytest.raises(NotImplementedError):
        torch.mm(hidden, weight.t(), out_dtype=torch.float32)


def _a_cuda_build_with_triton() -> bool:
    return torch.version.cuda is not None and importlib.util.find_spec("triton") is not None


@pytest.mark.slow
@pytest.mark.skipif(not _a_cuda_build_with_triton(), reason="needs a CUDA build of torch and triton")
def test_mix_order_reduction_leaves_four_aten_sums_per_block_backward(tmp_path: Path) -> None:
    """The 350M block at the users' micro batch of 16 (at 2, too few rows for mix-order reduction): with it
    (inductor's default for CUDA) the backward finishes the two LayerNorms' weight and bias gradients with 4 ATen
    sums; without it, with none and one Triton launch more. The forward is the same either way."""
    mixed = lower_for_cuda(LoweringSettings(micro_batch=16))
    plain = lower_for_cuda(LoweringSettings(micro_batch=16, inductor={"triton.mix_order_reduction": False}))
    assert [graph.name for graph in mixed] == ["block forward", "block backward", "head forward", "head backward"]
    (forward, backward, *_), (plain_forward, plain_backward, *_) = mixed, plain
    assert forward.wrapper_reductions == [] and forward.library_calls.count("extern_kernels.addmm") == 4
    assert len(backward.wrapper_reductions) == 4 and plain_backward.wrapper_reductions == []
    assert backward.library_calls.count("extern_kernels.mm") == 8
    assert plain_backward.triton_launches == backward.triton_launches + 1
    assert plain_forward.code == forward.code
    # the head as CUDA runs it (aten::mm.dtype: bf16 operands, float32 out), not its CPU path's float32 copies: two
    # chunks of 4,096 tokens, each its logits, hidden gradient and weight gradient
    head_forward = mixed[2]
    assert head_forward.library_calls == ["extern_kernels.mm_dtype"] * 6, head_forward.library_calls
    assert "torch.bfloat16)" in head_forward.code and "_to_copy_0.run(primals_3" not in head_forward.code
    # train.loss_gemm: input_dtype, as the engine sets it: bf16 logits (plain bf16 GEMMs), fewer bytes in the head
    config = Path(LoweringSettings.config_path).read_text()
    assert config.count("\ntrain:\n") == 1
    (tmp_path / "bf16_logits.yml").write_text(config.replace("\ntrain:\n", "\ntrain:\n  loss_gemm: input_dtype\n"))
    bf16_logits = lower_for_cuda(LoweringSettings(config_path=str(tmp_path / "bf16_logits.yml"), micro_batch=16))
    assert bf16_logits[2].library_calls == ["extern_kernels.mm"] * 6, bf16_logits[2].library_calls
    assert bf16_logits[2].bytes_per_token < 0.8 * head_forward.bytes_per_token


def test_the_tool_reports_a_bad_value_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from dev import inductor_cuda_code

    assert inductor_cuda_code.main(["--micro-batch", "0"]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.startswith("error: --micro-batch 0") and len(err.strip().splitlines()) == 1, err
