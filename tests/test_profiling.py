"""train.profile: the step window, its files and summary (CPU here; the CUDA branch of the summary on kernel-like
events), the kinds operators and kernels fall into, and the config's errors. Through train.py: the slow test of
tests/test_extrapolation_eval.py profiles its run."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_lite import config as config_lib
from megatron_lite.config import ProfileConfig
from megatron_lite.bench.step_profile import MODELS, ProfileSettings, gemm_section, training_step
from megatron_lite.training.gemm_shapes import format_table, gemm_table, read_trace
from megatron_lite.training.kernel_kinds import kind_of
from megatron_lite.training.profiling import StepProfiler, describe_window, summarise, union_length


@pytest.mark.parametrize("name, kind", [
    ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NTT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("aten::mm", "gemm"), ("aten::addmm", "gemm"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop", "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("triton_per_fused_native_layer_norm_0", "compiled"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "communication"),
    ("Memcpy HtoD (Pageable -> Device)", "copy"), ("aten::cat", "copy"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>", "other"),
])
def test_kernels_and_operators_fall_into_their_kind(name: str, kind: str) -> None:
    assert kind_of(name) == kind


def test_overlapping_intervals_count_once() -> None:
    assert union_length([]) == 0
    assert union_length([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert union_length([(20, 25), (0, 10)]) == 15


def test_cuda_summary_measures_kernel_time_and_gpu_busy_share() -> None:
    def kernel(name: str, start: float, end: float, annotation: bool = False) -> SimpleNamespace:
        return SimpleNamespace(name=name, device_type=torch.autograd.DeviceType.CUDA, is_user_annotation=annotation,
                               time_range=SimpleNamespace(start=start, end=end))

    cpu_op = SimpleNamespace(name="aten::mm", device_type=torch.autograd.DeviceType.CPU, self_cpu_time_total=9e6)
    events = [cpu_op, kernel("nvjet_gemm", 0, 300_000), kernel("triton_poi_fused_add", 300_000, 400_000),
              kernel("ncclAllReduce", 350_000, 450_000),  # microseconds; the all-reduce overlaps on its stream
              # a compiled graph's call as the GPU timeline shows it: over its kernels and the gaps between them
              kernel("## Call CompiledFxGraph fabc ##", 0, 800_000, annotation=True)]
    summary = summarise(events, "cuda", wall_s=0.9, first_step=3, last_step=4, rank=0)
    assert summary.busy_s == pytest.approx(0.45)  # the CPU operator is not device time
    assert summary.by_kind_s == pytest.approx({"gemm": 0.3, "compiled": 0.1, "communication": 0.1})
    assert summary.line() == ("profiled steps 3-4: GPU busy 50% of 0.90 s; kernel time: gemm 60%, compiled 20%, "
                              "communication 20%")


def _train_like_steps(profiler: StepProfiler, steps: range) -> None:
    torch.manual_seed(0)
    weight = torch.randn(64, 64, requires_grad=True)
    for step in steps:
        profiler.before_step(step)
        loss = torch.nn.functional.gelu(torch.randn(32, 64) @ weight).sum()
        loss.backward()
        profiler.after_step(step)


def test_cpu_window_writes_trace_table_and_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with StepProfiler(ProfileConfig(start_step=2, steps=2), tmp_path, rank=0, device=torch.device("cpu")) as profiler:
        _train_like_steps(profiler, range(1, 6))
    files = sorted(path.name for path in (tmp_path / "profile").iterdir())
    assert files == ["steps_2-3_rank0.json", "steps_2-3_rank0.trace.json.gz", "steps_2-3_rank0.txt"]
    summary = json.loads((tmp_path / "profile" / "steps_2-3_rank0.json").read_text())
    assert (summary["first_step"], summary["last_step"], summary["device"], summary["busy_s"]) == (2, 3, "cpu", None)
    assert summary["by_kind_s"]["gemm"] > 0 and summary["wall_s"] > 0
    table = (tmp_path / "profile" / "steps_2-3_rank0.txt").read_text()
    assert table.startswith("profiled steps 2-3: ") and "aten::mm" in table and "Self CPU" in table
    assert "profiled steps 2-3: " in capsys.readouterr().out


def test_recorded_shapes_get_a_table_of_their_own(tmp_path: Path) -> None:
    section = ProfileConfig(start_step=1, steps=1, record_shapes=True)
    with StepProfiler(section, tmp_path, rank=0, device=torch.device("cpu")) as profiler:
        _train_like_steps(profiler, range(1, 2))
    shapes = (tmp_path / "profile" / "steps_1_rank0_shapes.txt").read_text()
    assert shapes.startswith("profiled step 1: ") and "Input Shapes" in shapes
    # the forward's product and the backward's weight gradient: the same operator, one row per shape pair
    assert "[[32, 64], [64, 64]]" in shapes and "[[64, 32], [32, 64]]" in shapes
    gemms = (tmp_path / "profile" / "steps_1_rank0_gemms.txt").read_text()  # and the GEMMs by shape, per step
    assert gemms.startswith("GEMMs by shape (cpu; time: each operator's own, ms per step)")
    assert "| mm 32 x 64 x 64 | fp32 | 1 |" in gemms and "| mm 64 x 32 x 64 | fp32 | 1 |" in gemms, gemms


def test_window_cut_short_is_written_and_other_ranks_write_nothing(tmp_path: Path) -> None:
    section = ProfileConfig(start_step=2, steps=5, ranks=[1])
    with StepProfiler(section, tmp_path / "rank0", rank=0, device=torch.device("cpu")) as idle:
        _train_like_steps(idle, range(1, 4))
    assert not (tmp_path / "rank0" / "profile").exists()
    with StepProfiler(section, tmp_path / "rank1", rank=1, device=torch.device("cpu")) as profiler:
        _train_like_steps(profiler, range(3, 5))  # resumed at step 2, stopped after step 4: steps 3-4 of 2-6
    assert json.loads((tmp_path / "rank1" / "profile" / "steps_3-4_rank1.json").read_text())["last_step"] == 4


def test_start_up_line_says_which_steps(tmp_path: Path) -> None:
    section = ProfileConfig(start_step=5, steps=3)
    assert describe_window(section, 0, 100, tmp_path) == (
        f"profiling steps 5-7 on rank 0 into {tmp_path / 'profile'} (those steps run a little slower)")
    assert describe_window(section, 6, 100, tmp_path).startswith("profiling steps 7-7 ")
    assert "before this resume (step 9)" in describe_window(section, 9, 100, tmp_path)
    assert describe_window(section, 0, 4, tmp_path) == (
        "train.profile.start_step=5: past the run's last step 4; nothing is profiled")


@pytest.mark.parametrize("assignment, message", [
    ("train.profile.start_step=-1", "train.profile.start_step=-1: must be >= 0"),
    ("train.profile.steps=0", "train.profile.steps=0: must be positive"),
    ("train.profile.ranks=[]", "train.profile.ranks=[]: name at least one global rank"),
])
def test_bad_profile_settings_name_the_key(assignment: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        config_lib.load(Path(__file__).resolve().parents[1] / "configs/tiny/coca_slack.yml", [assignment])


@pytest.mark.parametrize("model", MODELS)
def test_profile_step_trains_ours_and_the_twin(model: str, tmp_path: Path) -> None:
    """tools/profile_step.py's step for either model builds and runs on CPU at a tiny size (the profile itself
    needs CUDA), from the config and scheme given; a model the tool does not know is one error line."""
    settings = ProfileSettings(model=model, label="rope", micro_batch=2, config_path="configs/tiny/rope.yml")
    step, config = training_step(settings, torch.device("cpu"))
    assert config.precision == "bf16" and config.model.position.scheme == "rope"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profiler:
        step()
    kept = tmp_path / "profile" / f"{model}.trace.json.gz"
    gemms = gemm_section(profiler, steps=1, trace_path=kept)  # the 4 layers' QKV: (2 x 128 tokens) x 128 -> 3 x 128
    assert gemms.startswith("GEMMs by shape (cpu; ") and "| addmm 256 x 128 x 384 | bf16 | 4 |" in gemms, gemms
    assert gzip.open(kept).read().lstrip().startswith(b"{")  # kept, gzip'd, and read back to the same table
    assert format_table(gemm_table(read_trace(kept)), 1, "per step") == gemms
    with pytest.raises(ValueError, match="^--model gpt2: must be one of ours, hf_twin$"):
        ProfileSettings(model="gpt2")
