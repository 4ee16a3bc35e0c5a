"""How long the paper's 350M run is and how fast it trains: the one place the figures come from.

README.md (its results table), docs/run_at_scale.md, docs/reproduction.md (profile paper-350m) and the budget
that ``tools/reproduce.py --profile paper-350m`` prints all use this module. The docs carry its figures between
``<!-- run_length:NAME -->`` and ``<!-- /run_length -->`` markers: ``python -m megatron_lite.repro.run_length
--write`` regenerates them and tests/test_run_length.py fails while they differ. The speed they assume is read
from the run records (benchmarks/runs/<record>/record.json): ``MEASURED`` is the newest record of the users'
command, ``BASELINE`` the first (``BASELINE_RECORD``); a new record is picked up by regenerating.

The measured runs trained on a data bundle whose tokenizer has 16,000 pieces: 335,079,424 parameters, not the
404.8M of the paper's vocabulary. MFU carries over between the two (the FLOPs are counted for the model that
ran); tokens/s does not, so the hours are computed from the MFU and the paper model's FLOPs per token.

"350M" is the paper's name for the model of configs/coca_350m.yml: 404,809,728 parameters counted with the
embeddings, 353,560,576 without the input embedding (the count ``model_flops_per_token`` multiplies by 6; the
untied output layer stays in it).

Tokens per epoch of configs/data/paper_mix.yml are computed from the sources' published sizes, not measured:
the Hugging Face hub was out of reach of every machine this project ran on, so the mix has never been built.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_lite.config import ModelConfig
from megatron_lite.repro.settings import REPO_ROOT

PAPER_CONFIG = REPO_ROOT / "configs" / "coca_350m.yml"
PAPER_MIX = REPO_ROOT / "configs" / "data" / "paper_mix.yml"
DOCS = (REPO_ROOT / "README.md", REPO_ROOT / "docs" / "run_at_scale.md", REPO_ROOT / "docs" / "reproduction.md")
PAPER_SAMPLE_TOKENS = 50_000_000_000  # the paper (section 4): a ~50B-token sample of its mix, trained 2 epochs
PLAN_GPUS = (1, 8)
# label -> KNOWN_PEAK_TFLOPS key; an H100 SXM has the H200's dense bf16 peak (989 TFLOP/s)
PLAN_DEVICES = {"H100/H200": "H200", "A100": "A100"}


RUNS = REPO_ROOT / "benchmarks" / "runs"
BASELINE_RECORD = "2026-11-26_baseline_h200"  # the users' command before the speed work


@dataclass(frozen=True)
class Measurement:
    """The users' command (``deepspeed --num_gpus 1 train.py --config configs/coca_350m.yml``) timed on a GPU, as
    its run record holds it."""

    mfu: float
    tokens_per_sec: float
    first_step_s: float
    vocab_size: int  # of the measured run: its data bundle's tokenizer, not the paper's 50,048
    parameters: int  # of the measured run, at that vocabulary
    device: str
    date: str
    commit: str
    record: str  # the folder under benchmarks/runs/
    command: str
    setup: str  # how the loop ran: micro batch, compile, CUDA graphs

    def describe(self) -> str:
        return (f"the users' command on one {self.device}, {self.date}, commit {self.commit}, at vocabulary "
                f"{self.vocab_size:,} (the data bundle's tokenizer: {self.parameters:,} parameters; "
                f"benchmarks/runs/{self.record}); 8 GPUs assumed to scale linearly")


def users_command_records() -> list[Path]:
    """The run records holding a users' command measurement, oldest first (records are named by date)."""
    return sorted(path.parent for path in RUNS.glob("*/record.json")
                  if "users_command_mfu" in json.loads(path.read_text())["figures"])


def load_measurement(record: Path) -> Measurement:
    """The users' command figures of one run record (benchmarks/runs/<record>/record.json)."""
    path = record / "record.json"
    if not path.is_file():
        raise ValueError(f"{path}: no such run record")
    data = json.loads(path.read_text())
    figures = data["figures"]
    conditions = figures["users_command_mfu"]["conditions"]
    setup = (f"micro batch {conditions['micro_batch']} x {conditions['accumulation']} accumulation, "
             f"ZeRO 1, {conditions['compile']}")
    return Measurement(mfu=figures["users_command_mfu"]["value"],
                       tokens_per_sec=figures["users_command_tokens_per_sec"]["value"],
                       first_step_s=figures["users_command_first_step_s"]["value"],
                       vocab_size=figures["users_command_vocab_size"]["value"],
                       parameters=figures["users_command_parameters"]["value"], device=data["device"],
                       date=data["date"], commit=data["commit"], record=data["record"],
                       command=data["conditions"]["users_command"], setup=setup)


MEASURED = load_measurement(users_command_records()[-1])
BASELINE = load_measurement(RUNS / BASELINE_RECORD)


@dataclass(frozen=True)
class ModelSize:
    parameters: int  # every weight, embeddings included
    without_input_embedding: int  # what the FLOPs count: 6 x this + attention scores
    flops_per_token: float  # training (forward + backward), megatron_lite.training.metrics

    @property
    def name(self) -> str:
        return (f"{self.parameters:,} parameters ({self.parameters / 1e6:.1f}M) with the embeddings, "
                f"{self.without_input_embedding:,} ({self.without_input_embedding / 1e6:.1f}M) without the input "
                "embedding")


def model_size(model: ModelConfig) -> ModelSize:
    from megatron_lite.model.params import counted_parameter_count
    from megatron_lite.training.metrics import model_flops_per_token

    parameters = counted_parameter_count(model)
    return ModelSize(parameters, parameters - model.padded_vocab_size * model.hidden_size,
                     model_flops_per_token(model))


@dataclass(frozen=True)
class RunLength:
    tokens_requested: int
    tokens_per_step: int

    @property
    def steps(self) -> int:
        return max(1, math.ceil(self.tokens_requested / self.tokens_per_step))

    @property
    def tokens(self) -> int:
        return self.steps * self.tokens_per_step


def training_hours(tokens: int, flops_per_token: float, gpus: int, peak_tflops: float, mfu: float) -> float:
    """Wall-clock hours of training on ``gpus`` data-parallel GPUs, each at ``mfu`` of its peak."""
    return tokens * flops_per_token / (gpus * peak_tflops * 1e12 * mfu) / 3600


def plan_hours(tokens: int, flops_per_token: float, mfu: float) -> dict[str, dict[str, float]]:
    """{"8xA100": {"gpus", "peak_tflops", "hours"}, ...} for PLAN_GPUS x PLAN_DEVICES."""
    from megatron_lite.training.metrics import KNOWN_PEAK_TFLOPS

    return {f"{gpus}x{label}": {"gpus": gpus, "peak_tflops": KNOWN_PEAK_TFLOPS[key],
                                "hours": training_hours(tokens, flops_per_token, gpus, KNOWN_PEAK_TFLOPS[key], mfu)}
            for label, key in PLAN_DEVICES.items() for gpus in PLAN_GPUS}


# ----------------------------------------------------------------------------------------------
# configs/data/paper_mix.yml's tokens per epoch, from published sizes

TEXT_BYTES_PER_TOKEN = 4.0  # assumed: the usual figure for English under a ~50K-piece BPE
# measured: the Python standard library (12,118,641 bytes) is 3,650,702 tokens under the project's own 8,000-piece
# tokenizer (docs/data.md's sample cache); a 50,000-piece one compresses code further, so code is overestimated
CODE_BYTES_PER_TOKEN = 3.32
GIB, KIB = 2**30, 2**10
# The Pile (Gao et al. 2020, table 1): 825.18 GiB in 210,607,728 training documents. pile-uncopyrighted drops five
# components: their raw GiB and mean document KiB (table 1); GiB / mean size gives their document counts
# (Books3 196,641, BookCorpus2 17,861: the published 196,640 and 17,868).
PILE_GIB, PILE_DOCUMENTS = 825.18, 210_607_728
PILE_DROPPED = {"Books3": (100.96, 538.36), "OpenWebText2": (62.77, 3.85), "OpenSubtitles": (12.98, 30.48),
                "BookCorpus2": (6.30, 369.87), "YoutubeSubtitles": (3.73, 22.55)}


@dataclass(frozen=True)
class SourceSize:
    source: str  # its key in paper_mix.yml
    group: str
    documents: int  # what the source reads: its max_documents or all it has, the smaller
    bytes: float
    bytes_per_token: float
    basis: str  # where the sizes come from

    @property
    def tokens(self) -> float:
        return self.bytes / self.bytes_per_token + self.documents  # + the EOD after every document


def _pile_documents_and_bytes() -> tuple[float, float]:
    """pile-uncopyrighted: documents and bytes per document."""
    dropped_documents = sum(gib * GIB / (kib * KIB) for gib, kib in PILE_DROPPED.values())
    kept_gib = PILE_GIB - sum(gib for gib, _ in PILE_DROPPED.values())
    documents = PILE_DOCUMENTS - dropped_documents
    return documents, kept_gib * GIB / documents


def _mix_sources() -> dict[str, dict]:
    import yaml

    groups = yaml.safe_load(PAPER_MIX.read_text())["groups"]
    return {name: {**source, "group": group, "weight": spec["weight"]}
            for group, spec in groups.items() for name, source in spec["sources"].items()}


def paper_mix_sizes() -> tuple[SourceSize, ...]:
    """Each source of paper_mix.yml: what its max_documents keeps of the published sizes."""
    pile_documents, pile = _pile_documents_and_bytes()
    wikipedia = 22_057_264_844 / 6_797_834  # bytes per article of the 2024-03-20 English dump (its dataset card)
    github = 1e12 / 115e6  # codeparrot/github-code: 115M files, 1 TB; github-code-clean filters and dedups it
    # source -> (documents published, bytes per document, bytes per token, basis); None: more than any cap here
    published = {
        "pile": (pile_documents, pile, TEXT_BYTES_PER_TOKEN,
                 f"the Pile's {pile:,.0f} bytes per document once pile-uncopyrighted's five components are dropped"),
        "bookcorpus": (74_004_228, 4_853_859_824 / 74_004_228, TEXT_BYTES_PER_TOKEN,
                       "74,004,228 sentences in 4.85 GB (the bookcorpus dataset card); min_chars drops some"),
        "wikipedia": (6_407_814, wikipedia, TEXT_BYTES_PER_TOKEN,
                      f"6,407,814 articles in 20231101.en at {wikipedia:,.0f} bytes each (the 2024-03-20 dump's)"),
        "github_code": (None, github, CODE_BYTES_PER_TOKEN,
                        f"{github:,.0f} bytes per file (codeparrot/github-code: 115M files, 1 TB)"),
    }
    sources = _mix_sources()
    if set(sources) != set(published):
        raise ValueError(f"{PAPER_MIX}: sources {sorted(sources)}, but sizes are known for {sorted(published)}")
    sizes = []
    for name, (available, per_document, per_token, basis) in published.items():
        cap = sources[name].get("max_documents")
        documents = round(min(value for value in (available, cap) if value is not None))
        sizes.append(SourceSize(name, sources[name]["group"], documents, documents * per_document, per_token, basis))
    return tuple(sizes)


def code_weight() -> float:
    return next(source["weight"] for source in _mix_sources().values() if source["group"] == "code")


def paper_mix_tokens() -> int:
    return round(sum(size.tokens for size in paper_mix_sizes()))


# ----------------------------------------------------------------------------------------------
# The two runs: the paper's (tools/reproduce.py) and the users' command on paper_mix.yml


@dataclass(frozen=True)
class PaperRuns:
    size: ModelSize
    epochs: float
    tokens_per_step: int
    paper: RunLength  # train.train_epochs x the paper's ~50B-token sample: tools/reproduce.py's default
    users_command: RunLength  # train.train_epochs x paper_mix.yml's training tokens (estimated)


def paper_runs() -> PaperRuns:
    from megatron_lite import config as config_lib
    from megatron_lite.training.deepspeed_config import resolve_batch_sizes

    config = config_lib.load(PAPER_CONFIG)
    step = resolve_batch_sizes(config, 8).tokens_per_step(config.model.seq_length)  # the same on 1-16 GPUs
    epochs = config.train.train_epochs
    training_tokens = paper_mix_tokens() * (1.0 - config.data.validation_fraction)
    return PaperRuns(model_size(config.model), epochs, step, RunLength(round(epochs * PAPER_SAMPLE_TOKENS), step),
                     RunLength(round(epochs * training_tokens), step))


# ----------------------------------------------------------------------------------------------
# The docs' figures


def _billions(tokens: float) -> str:
    return f"{tokens / 1e9:.1f}B"


def _rounded(steps: int) -> str:
    """An estimated step count to the thousand: its last digits mean nothing."""
    return f"{round(steps, -3):,}"


def _hours_cells(run: RunLength, flops_per_token: float, mfu: float) -> str:
    return " | ".join(f"{row['hours']:,.1f} h" for row in plan_hours(run.tokens, flops_per_token, mfu).values())


def _runs_table(runs: PaperRuns) -> str:
    heads = " | ".join(f"{key.split('x', 1)[0]} × {key.split('x', 1)[1]}"
                       for key in plan_hours(1, 1.0, 1.0))
    flops = runs.size.flops_per_token
    return "\n".join([
        f"| run (per model) | tokens | steps of {runs.tokens_per_step:,} tokens | {heads} |",
        "|---|---:|---:|" + "---:|" * len(PLAN_GPUS) * len(PLAN_DEVICES),
        f"| the paper's: {runs.epochs:g} epochs × its ~{PAPER_SAMPLE_TOKENS / 1e9:g}B-token sample "
        f"(`tools/reproduce.py --profile paper-350m`) | {_billions(runs.paper.tokens)} | {runs.paper.steps:,} | "
        f"{_hours_cells(runs.paper, flops, MEASURED.mfu)} |",
        f"| the users' command on `paper_mix.yml`: {runs.epochs:g} epochs × ~{_billions(paper_mix_tokens())} "
        f"(estimated) | ~{_billions(runs.users_command.tokens)} | ~{_rounded(runs.users_command.steps)} | "
        f"{_hours_cells(runs.users_command, flops, MEASURED.mfu)} |",
    ])


def _speed_table(runs: PaperRuns) -> str:
    from megatron_lite.training.metrics import KNOWN_PEAK_TFLOPS

    peak = KNOWN_PEAK_TFLOPS["H200"]
    lines = ["| measured: the users' command, one GPU | MFU | tokens/s at the measured vocabulary | tokens/s of the "
             "paper's model (vocabulary 50,048) at that MFU |", "|---|---:|---:|---:|"]
    for measurement in (MEASURED, BASELINE):
        paper_speed = measurement.mfu * peak * 1e12 / runs.size.flops_per_token
        lines.append(f"| {measurement.device}, {measurement.date}, commit {measurement.commit}: {measurement.setup} "
                     f"([record](../benchmarks/runs/{measurement.record}/)) | {measurement.mfu:.1%} | "
                     f"{measurement.tokens_per_sec:,.0f} (vocabulary {measurement.vocab_size:,}: "
                     f"{measurement.parameters:,} parameters) | {paper_speed:,.0f} |")
    return "\n".join(lines)


def _mix_table() -> str:
    lines = ["| source | group | documents | bytes | bytes per token | tokens | from |",
             "|---|---|---:|---:|---:|---:|---|"]
    for size in paper_mix_sizes():
        lines.append(f"| {size.source} | {size.group} | {size.documents:,} | {size.bytes / 1e9:.1f} GB | "
                     f"{size.bytes_per_token:g} | {_billions(size.tokens)} | {size.basis} |")
    code = sum(size.tokens for size in paper_mix_sizes() if size.group == "code")
    lines.append(f"| **all** | | | | | **{_billions(paper_mix_tokens())}** | code {code / paper_mix_tokens():.0%} of "
                 f"the tokens (its weight in the mix: {code_weight():.0%}) |")
    return "\n".join(lines)


def doc_figures() -> dict[str, str]:
    """Every figure the docs carry between run_length markers, by name."""
    runs = paper_runs()
    size = runs.size
    hours = plan_hours(runs.paper.tokens, size.flops_per_token, MEASURED.mfu)
    return {
        "size": size.name,
        "flops": f"{size.flops_per_token:,.0f}",
        "mfu": f"{MEASURED.mfu:.1%}",
        "measured": MEASURED.describe(),
        "paper_tokens": _billions(runs.paper.tokens),
        "paper_steps": f"{runs.paper.steps:,}",
        "paper_hours_8": f"{hours[f'8x{next(iter(PLAN_DEVICES))}']['hours']:,.1f} h",
        "mix_tokens": _billions(paper_mix_tokens()),
        "users_tokens": _billions(runs.users_command.tokens),
        "users_steps": _rounded(runs.users_command.steps),
        "runs_table": _runs_table(runs),
        "speed_table": _speed_table(runs),
        "mix_table": _mix_table(),
    }


MARKED = re.compile(r"(<!-- run_length:(\w+) -->)(.*?)(<!-- /run_length -->)", flags=re.S)


def render(text: str, figures: dict[str, str]) -> str:
    """``text`` with every marked figure replaced by its current value (tables on lines of their own)."""
    def replace(match: re.Match[str]) -> str:
        name = match.group(2)
        if name not in figures:
            raise ValueError(f"<!-- run_length:{name} -->: no such figure (known: {', '.join(sorted(figures))})")
        value = figures[name]
        body = f"\n{value}\n" if "\n" in value or match.group(3).startswith("\n") else value
        return f"{match.group(1)}{body}{match.group(4)}"

    return MARKED.sub(replace, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the marked figures in the docs")
    args = parser.parse_args(argv)
    figures = doc_figures()
    if not args.write:
        for name, value in figures.items():
            print(f"{name}:\n{value}\n" if "\n" in value else f"{name}: {value}")
        return 0
    for path in DOCS:
        text = path.read_text()
        updated = render(text, figures)
        if updated != text:
            path.write_text(updated)
            print(f"updated {path.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
