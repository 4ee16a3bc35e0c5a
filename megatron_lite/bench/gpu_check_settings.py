"""What one GPU check runs (``tools/gpu_check.py``'s flags): its sections, schemes, batch and budgets, as
``CheckSettings``, and the parsing of the comma-list flags into them, each bad value one error line."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron_lite.model.compile import COMPILE_MODES
from megatron_lite.model.loss import LOSS_GEMMS
from megatron_lite.model.variants import LABELS

CUDA_GRAPHS_SUFFIX, MAX_AUTOTUNE_SUFFIX, FEWER_LAUNCHES_SUFFIX = "-cudagraphs", "-max-autotune", "-fewer-launches"
# the training modes, and each with inductor's CUDA graphs (compile_model's cuda_graphs: what replaying a region's
# kernels from one launch gives the model alone; train.cuda_graphs in training), with its GEMM autotuning and fused
# epilogues (compile_model's max_autotune, a measurement only) or with the users' command's fewer_launches settings
# (FEWER_LAUNCHES_INDUCTOR: what they cost or give the GPU where the host does not bind)
BENCH_COMPILE_MODES: tuple[str, ...] = (*COMPILE_MODES, *(mode + suffix for suffix in (CUDA_GRAPHS_SUFFIX,
                                                                                       MAX_AUTOTUNE_SUFFIX,
                                                                                       FEWER_LAUNCHES_SUFFIX)
                                                          for mode in COMPILE_MODES))
# where the Hugging Face twin's cross entropy runs: outside its compiled model (eager, over the float32 logits it
# returns) or inside one compiled region with it (compiled: the wrapper of TwinWithLoss compiled whole)
TWIN_LOSSES = ("eager", "compiled")
# torch's SDPA kernels a throughput row can pin (torch.nn.attention.sdpa_kernel); auto: torch's own choice
SDPA_KERNELS = ("auto", "cudnn", "flash", "efficient")

SECTIONS = ("env", "parity", "memory", "throughput", "sequence_parallel", "train", "users_command", "sync")
QUICK_SECTIONS = ("env", "parity", "memory", "throughput", "users_command", "sync")
SCHEMES = LABELS  # every scheme, by label (the default of a full check)
QUICK_SCHEMES = ("rope", "coca_slack")
QUICK_MICRO_BATCH = 64  # x 512 tokens: a batch at which the 350M step is the GPU's work, not the host's
# seconds a section may take before its remaining rows are skipped (a row started in time runs to its end)
FULL_BUDGET_S = 480.0
# (users_command: a run started within it runs to its own timeout, gpu_check.USERS_TIMEOUT_S)
QUICK_BUDGET_S = {"memory": 100.0, "throughput": 210.0, "users_command": 240.0, "sync": 60.0}


@dataclass
class CheckSettings:
    """What one check runs; ``None`` fields take the profile's default (``quick`` or the full check)."""

    out: Path
    sections: list[str] | None = None  # None: every section (quick: QUICK_SECTIONS)
    smoke: bool = False
    force: bool = False
    quick: bool = False
    schemes: list[str] | None = None  # scheme labels (None: every scheme; quick: QUICK_SCHEMES)
    micro_batch: int | None = None  # a fixed micro batch, no doubling search (None: search; quick: 64; smoke: 2)
    max_batch: int = 64  # throughput search limit (micro batch)
    compile_mode: str = "regional"  # our model's compile (megatron_lite.model.compile); the HF twin: whole
    extra_compile_modes: list[str] = field(default_factory=list)  # each adds a compiled rope throughput row, last
    loss_gemms: list[str] = field(default_factory=lambda: ["mixed"])  # the first for every row of ours; each
    # further one adds a rope eager throughput row and a compiled one
    sdpa_kernels: list[str] = field(default_factory=lambda: ["auto"])  # the first for every throughput row; each
    # further one adds a compiled rope row, last
    twin_losses: list[str] = field(default_factory=lambda: ["eager"])  # the first for the twin's compiled row; each
    # further one adds a compiled twin row after it (the eager twin row's loss is eager, as its model)
    section_budget_s: float | None = None  # None: FULL_BUDGET_S (quick: QUICK_BUDGET_S per section)
    mix: Path | None = None  # users_command's data: a mix file, its tokenizer and vocabulary
    tokenizer: Path | None = None
    vocab_size: int | None = None
    users_micro_batches: list[int] | None = None  # users_command: one run per micro batch (None: the config's)
    users_no_cuda_graphs: list[int] = field(default_factory=list)  # users_command: a run with train.cuda_graphs=false
    users_cpp_wrapper: list[int] = field(default_factory=list)  # ... with train.compile_cpp_wrapper each

    def __post_init__(self) -> None:
        if self.sections is None:
            self.sections = list(QUICK_SECTIONS if self.quick else SECTIONS)
        if self.schemes is None:
            self.schemes = list(QUICK_SCHEMES if self.quick else SCHEMES)
        if self.micro_batch is None and self.quick and not self.smoke:
            self.micro_batch = QUICK_MICRO_BATCH
        modes = [self.compile_mode, *self.extra_compile_modes]
        if any(mode not in BENCH_COMPILE_MODES for mode in modes) or len(set(modes)) != len(modes):
            raise ValueError(f"--compile-mode {','.join(modes)}: must be distinct values from "
                             f"{', '.join(BENCH_COMPILE_MODES)}")
        if self.micro_batch is not None and self.micro_batch < 1:
            raise ValueError(f"--micro-batch {self.micro_batch}: must be >= 1")
        _check_choices("--loss-gemm", self.loss_gemms, LOSS_GEMMS)
        _check_choices("--sdpa-kernel", self.sdpa_kernels, SDPA_KERNELS)
        _check_choices("--twin-loss", self.twin_losses, TWIN_LOSSES)
        given = [self.mix is not None, self.tokenizer is not None, self.vocab_size is not None]
        if any(given) and not all(given):
            raise ValueError("--mix, --tokenizer and --vocab-size go together (users_command's data)")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"--vocab-size {self.vocab_size}: must be >= 1")
        if self.users_micro_batches is not None:
            _check_micro_batches("--users-micro-batch", self.users_micro_batches, allow_none=False)
        _check_micro_batches("--users-no-cuda-graphs", self.users_no_cuda_graphs, allow_none=True)
        _check_micro_batches("--users-cpp-wrapper", self.users_cpp_wrapper, allow_none=True)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu" if self.smoke else "cuda")

    @property
    def profile_sections(self) -> tuple[str, ...]:
        """Every section of this profile: what a run without --only does."""
        return QUICK_SECTIONS if self.quick else SECTIONS

    def budget_s(self, section: str) -> float:
        if self.section_budget_s is not None:
            return self.section_budget_s
        return QUICK_BUDGET_S.get(section, FULL_BUDGET_S) if self.quick else FULL_BUDGET_S

    def to_dict(self) -> dict[str, Any]:
        """What the report records of these settings (beside each section's rows)."""
        return {"quick": self.quick, "smoke": self.smoke, "schemes": list(self.schemes or ()),
                "micro_batch": self.micro_batch, "compile_mode": self.compile_mode,
                "extra_compile_modes": list(self.extra_compile_modes),
                "loss_gemms": list(self.loss_gemms), "sdpa_kernels": list(self.sdpa_kernels),
                "twin_losses": list(self.twin_losses),
                "users_micro_batches": self.users_micro_batches,
                "users_no_cuda_graphs": list(self.users_no_cuda_graphs),
                "users_cpp_wrapper": list(self.users_cpp_wrapper)}

    def users_variants(self) -> dict[str, list[int]]:
        """users_command's runs beside the plain ones: the micro batches of each variant (users_command.py's
        USERS_VARIANTS), in the order they run."""
        return {"no_cuda_graphs": list(self.users_no_cuda_graphs), "cpp_wrapper": list(self.users_cpp_wrapper)}


def _check_choices(flag: str, values: list[str], allowed: tuple[str, ...]) -> None:
    """One error line naming ``flag`` unless ``values`` are one or more distinct members of ``allowed``."""
    if not values or len(set(values)) != len(values) or any(value not in allowed for value in values):
        raise ValueError(f"{flag} {','.join(values)}: give distinct values from {', '.join(allowed)}")


def _check_micro_batches(flag: str, values: list[int], allow_none: bool) -> None:
    """One error line naming ``flag`` unless ``values`` are distinct positive micro batches (none only where
    ``allow_none``)."""
    if (not values and not allow_none) or min(values, default=1) < 1 or len(set(values)) != len(values):
        raise ValueError(f"{flag} {','.join(map(str, values))}: give distinct positive micro batches")


def parse_sections(text: str | None, quick: bool = False) -> list[str]:
    """The sections --only names, in the run order (default: every section of the profile)."""
    allowed = QUICK_SECTIONS if quick else SECTIONS
    if not text:
        return list(allowed)
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in allowed]
    if unknown or not names:
        raise ValueError(f"--only {text}: unknown section(s) {', '.join(unknown) or '(none)'}"
                         f"{' for --quick' if quick else ''}; choose from {', '.join(allowed)}")
    return [name for name in allowed if name in names]


def _comma_list(flag: str, text: str, allowed: tuple[str, ...] | list[str], what: str) -> list[str]:
    """``text`` split at commas, each in ``allowed``, duplicates dropped; else one error line naming the flag."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in allowed]
    if unknown or not names:
        raise ValueError(f"{flag} {text}: unknown {what} {', '.join(unknown) or '(none)'}; "
                         f"choose from {', '.join(allowed)}")
    return list(dict.fromkeys(names))


def parse_schemes(text: str | None) -> list[str] | None:
    """--schemes a,b as scheme labels (None when not given); an unknown label is one error line naming it."""
    return None if text is None else _comma_list("--schemes", text, LABELS, "scheme(s)")


def parse_loss_gemms(text: str) -> list[str]:
    """--loss-gemm a,b as model.lm_head.gemm values; an unknown one is one error line naming it."""
    return _comma_list("--loss-gemm", text, LOSS_GEMMS, "value(s)")


def parse_twin_losses(text: str) -> list[str]:
    """--twin-loss eager,compiled as where the twin's loss runs; an unknown value is one error line naming it."""
    return _comma_list("--twin-loss", text, TWIN_LOSSES, "value(s)")


def parse_sdpa_kernels(text: str) -> list[str]:
    """--sdpa-kernel auto,flash as SDPA kernel names; an unknown one is one error line naming it."""
    return _comma_list("--sdpa-kernel", text, SDPA_KERNELS, "kernel(s)")


def parse_compile_modes(text: str) -> list[str]:
    """--compile-mode regional,whole: the first for every compiled row of ours, each further one an extra compiled
    rope row (``CheckSettings`` checks the values); no mode at all is one error line naming the flag."""
    modes = [word.strip() for word in text.split(",") if word.strip()]
    if not modes:
        raise ValueError(f"--compile-mode {text}: must be distinct values from {', '.join(BENCH_COMPILE_MODES)}")
    return modes


def parse_micro_batches(text: str | None, flag: str = "--users-micro-batch") -> list[int] | None:
    """--users-micro-batch 16,64 (or ``flag``'s list) as integers (None when not given); a word that is no integer
    is one error line."""
    if text is None:
        return None
    try:
        return [int(word) for word in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} {text}: give micro batches as integers, e.g. 16,64") from None
