"""Settings of the reproduction (all three profiles), their validation, the four configs and the data mix file.

Profiles: ``cpu-tiny`` (configs/repro/tiny/*.yml, books read and tokenised here), ``gpu-speedrun``
(configs/repro/speedrun/*.yml, a pre-tokenised data bundle, the step count from a throughput probe;
megatron_lite.repro.speedrun) and ``paper-350m`` (configs/repro/paper350m/*.yml: the repository's 350M
configs, a mix file read in place, the step count from a token budget, every model through the deepspeed
launcher; megatron_lite.repro.paper).

OUT layout: ``data/mix.yml`` + ``data/cache/`` (tokenizer, shards; the speedrun adds ``data/bundle/``),
``runs/<scheme>/`` (train.py run dirs), ``logs/train_<scheme>.log``, ``eval/<scheme>/{perplexity,passkey}/``
(evaluation outputs and caches), ``results.json``, ``tables.md``, plots, ``wall_times.json``; the speedrun
also ``probe/`` and ``probe.json``; paper-350m ``budget.json`` (and no ``data/mix.yml``: its mix is read in place).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from megatron_lite import config as config_lib
from megatron_lite.config import Config
from megatron_lite.files import file_sha256, write_text_atomic
from megatron_lite.model.variants import PAPER_LABELS
from megatron_lite.repro.bundle import parse_sha256

REPO_ROOT = Path(__file__).resolve().parents[2]
SCHEMES = PAPER_LABELS  # the four models, by label (configs/repro/<profile>/<label>.yml)
SPEEDRUN_PAIR = ("rope", "coca_slack")  # the speedrun's default: the paper's question, twice the tokens per model
PROFILES = ("cpu-tiny", "gpu-speedrun", "paper-350m")
PHASES = ("data", "probe", "train", "eval", "report")  # the speedrun's; the other profiles have no probe
DEFAULT_CONFIG_DIR = REPO_ROOT / "configs" / "repro" / "tiny"
SPEEDRUN_CONFIG_DIR = REPO_ROOT / "configs" / "repro" / "speedrun"
PAPER_CONFIG_DIR = REPO_ROOT / "configs" / "repro" / "paper350m"
PAPER_MIX = REPO_ROOT / "configs" / "data" / "paper_mix.yml"
SAMPLE_MIX = REPO_ROOT / "configs" / "data" / "sample_mix.yml"  # offline: the paper-350m dry run's default mix
DEFAULT_WINDOWS = [128 * 2**i for i in range(6)]  # 128 ... 4096: 1x ... 32x the training length
DEFAULT_PASSKEY_LENGTHS = [128 * 2**i for i in range(5)]  # 128 ... 2048
DEFAULT_NTK_FACTORS = [2.0, 4.0, 8.0]
TEXT_WEIGHT, CODE_WEIGHT = 0.75, 0.25  # the paper's text / code token shares


@dataclass
class SpeedrunBudget:
    """The gpu-speedrun's wall-time budget (seconds); the probe turns it into one step count."""

    total_seconds: float = 540.0  # training + evaluation of all four models: 9 minutes on one H100
    eval_seconds_per_model: float = 40.0  # perplexity + passkey of one model, all scalings (an allowance)
    curve_seconds_per_model: float = 20.0  # the in-training extrapolation curve's evaluations (an allowance)
    curve_points: int = 10  # evaluations of the curve per model (and one before the first step)
    report_seconds: float = 10.0
    probe_steps: int = 30  # steps per scheme in the probe (its first log interval, with the compile, is dropped)
    max_train_tokens: int = 200_000_000  # cap on tokens per model however fast the device is
    min_train_iters: int = 100  # below this the budget cannot train anything worth evaluating: refuse


@dataclass
class PaperRunSettings:
    """The paper-350m profile's own settings (megatron_lite.repro.paper)."""

    mix: Path | None = None  # the mix file, read in place; None: the paper's (a dry run: the offline sample mix)
    tokens: int | None = None  # training tokens per model; None: the paper's (train.train_epochs x the ~50B sample)
    num_gpus: int | None = None  # ranks on this node; None: every local GPU (a dry run: 2 CPU ranks)
    hostfile: Path | None = None  # a DeepSpeed hostfile, passed to the launcher instead of --num_gpus
    master_port: int | None = None  # the launcher's --master_port; None: DeepSpeed's (a dry run: a free one)
    mfu: float | None = None  # MFU the budget assumes, given by the user; None: measured (gpu_check/board) or assumed
    gpu_check: Path | None = None  # a gpu_check.json whose throughput rows give a measured MFU
    board: Path | None = None  # the results board whose rows may give a measured MFU
    budget_printed: bool = False  # the CLI printed the budget before fetching evaluation books


@dataclass
class ReproSettings:
    books: Path | None  # cpu-tiny: training books, a directory of raw Project Gutenberg .txt files
    eval_books: Path | None  # evaluation books (PG-19 test): .txt (or parquet) books; the speedrun: the bundle's
    out_dir: Path
    profile: str = "cpu-tiny"
    bundle: Path | None = None  # gpu-speedrun: the data bundle (tools/build_data_bundle.py)
    bundle_sha256: str | None = None  # the sha256 it must have; None: the one in BUNDLE.sha256 beside it
    dry_run: bool = False  # gpu-speedrun at toy size (CPU, fp32): every phase, minutes
    phases: list[str] = field(default_factory=lambda: list(PHASES))  # run only these phases (the rest must be done)
    budget: SpeedrunBudget = field(default_factory=SpeedrunBudget)
    paper: PaperRunSettings = field(default_factory=PaperRunSettings)
    eval_device: str = "cpu"  # the speedrun: cuda when there is one (not in a dry run)
    eval_dtype: str = "fp32"  # the speedrun on CUDA: bf16
    profile_overrides: list[str] = field(default_factory=list)  # set by the profile (bundle vocab, tokenizer, toy model)
    schemes: list[str] = field(default_factory=lambda: list(SCHEMES))
    train_iters: int | None = None  # None: the configs' train.train_iters
    windows: list[int] = field(default_factory=lambda: list(DEFAULT_WINDOWS))
    stride: int | None = None  # sliding-window stride; None: the training length (the paper: 512 = its training length)
    max_doc_tokens: int = 8192  # evaluation books truncated to this many tokens (shorter ones skipped)
    max_docs: int = 100
    passkey_lengths: list[int] = field(default_factory=lambda: list(DEFAULT_PASSKEY_LENGTHS))
    passkey_cases: int = 100  # the paper's count
    ntk_factors: list[float] = field(default_factory=lambda: list(DEFAULT_NTK_FACTORS))
    headline_ntk_factor: float = 4.0  # the dynamic-NTK row of Tables 1 and 2 (fixed before the run)
    batch_size: int = 4  # windows / passkey cases per forward
    threads: int = 1  # torch threads of train.py and of the evaluation (1: fastest on a shared 2-core machine)
    seed: int = 1234  # passkey keys and depths
    code_max_documents: int | None = None  # cap on stdlib files read (None: all)
    overrides: list[str] = field(default_factory=list)  # --set KEY=VALUE for every config (same for all models)
    config_dir: Path = DEFAULT_CONFIG_DIR
    python: str = sys.executable
    progress: bool = True


# ----------------------------------------------------------------------------------------------
# Settings, configs, data


def _text_files(directory: Path) -> list[Path]:
    return sorted(path for path in directory.rglob("*.txt") if path.is_file())


def check_no_overlap(books: Path, eval_books: Path) -> None:
    """ValueError if an evaluation book is also a training book (same content): test-set leakage."""
    if not eval_books.is_dir():
        return
    training = {file_sha256(path): path for path in _text_files(books)}
    shared = [(path, training[digest]) for path in _text_files(eval_books)
              if (digest := file_sha256(path)) in training]
    if shared:
        examples = ", ".join(f"{a.name} = {b.name}" for a, b in shared[:3])
        raise ValueError(f"--eval-books {eval_books}: {len(shared)} book(s) are also in --books {books} ({examples}); "
                         "evaluation books must be held out of training")


def _validate_paper_run(settings: ReproSettings) -> None:
    if settings.eval_books is None:
        raise ValueError("--eval-books: the paper-350m profile evaluates on held-out books (the paper: PG-19 test, "
                         "e.g. emozilla/pg19-test)")
    if not settings.eval_books.exists():
        raise ValueError(f"--eval-books {settings.eval_books}: no such file or directory")
    validate_paper_flags(settings)


def validate_paper_flags(settings: ReproSettings) -> None:
    """The paper-350m flags that the budget needs, checked before it is printed (evaluation books may still be a
    datasets id then)."""
    paper = settings.paper
    if paper.mix is not None and not paper.mix.is_file():
        raise ValueError(f"--mix {paper.mix}: no such file")
    if paper.hostfile is not None and paper.num_gpus is not None:
        raise ValueError("--hostfile/--num-gpus: give one (the hostfile names every node's GPU slots)")
    if paper.hostfile is not None and not paper.hostfile.is_file():
        raise ValueError(f"--hostfile {paper.hostfile}: no such file")
    for flag, value in {"--tokens": paper.tokens, "--num-gpus": paper.num_gpus}.items():
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value}: must be >= 1")
    if paper.mfu is not None and not 0 < paper.mfu <= 1:
        raise ValueError(f"--mfu {paper.mfu:g}: a fraction of the peak, in (0, 1]")
    if paper.gpu_check is not None and not paper.gpu_check.is_file():
        raise ValueError(f"--gpu-check {paper.gpu_check}: no such file")
    if settings.train_iters is not None:
        raise ValueError("--train-iters: the paper-350m profile sets its step count from --tokens")


def _validate_sources(settings: ReproSettings) -> None:
    if settings.profile == "paper-350m":
        _validate_paper_run(settings)
        return
    if settings.profile == "gpu-speedrun":
        if settings.bundle is None:
            raise ValueError("--bundle: the gpu-speedrun profile trains on a data bundle (tools/build_data_bundle.py)")
        if not settings.bundle.is_file():
            raise ValueError(f"--bundle {settings.bundle}: no such file")
        if settings.bundle_sha256 is not None:
            parse_sha256(settings.bundle_sha256, "--bundle-sha256")
        return
    if settings.books is None or settings.eval_books is None:
        raise ValueError(f"--books and --eval-books: the {settings.profile} profile needs both")
    if not settings.books.is_dir():
        raise ValueError(f"--books {settings.books}: not a directory")
    if not _text_files(settings.books):
        raise ValueError(f"--books {settings.books}: no .txt files in it")
    if not settings.eval_books.exists():
        raise ValueError(f"--eval-books {settings.eval_books}: no such file or directory")
    if settings.books.resolve() == settings.eval_books.resolve():
        raise ValueError(f"--eval-books {settings.eval_books}: the same directory as --books; hold the evaluation "
                         "books out of training")


def validate_settings(settings: ReproSettings) -> None:
    """ValueError naming the offending flag for every user error that needs no config."""
    if settings.profile not in PROFILES:
        raise ValueError(f"--profile {settings.profile!r}: unknown; choose from {', '.join(PROFILES)}")
    for phase in settings.phases:
        if phase not in PHASES:
            raise ValueError(f"--only {phase!r}: unknown phase; choose from {', '.join(PHASES)}")
    _validate_sources(settings)
    if not settings.schemes:
        raise ValueError("--schemes: give at least one of " + ", ".join(SCHEMES))
    for scheme in settings.schemes:
        if scheme not in SCHEMES:
            raise ValueError(f"--schemes {scheme!r}: unknown; choose from {', '.join(SCHEMES)}")
    if len(set(settings.schemes)) != len(settings.schemes):
        raise ValueError(f"--schemes {' '.join(settings.schemes)}: a scheme is repeated")
    positive = {"--train-iters": settings.train_iters, "--passkey-cases": settings.passkey_cases,
                "--batch-size": settings.batch_size, "--max-doc-tokens": settings.max_doc_tokens,
                "--max-docs": settings.max_docs, "--code-max-documents": settings.code_max_documents,
                "--stride": settings.stride, "--threads": settings.threads}
    for flag, value in positive.items():
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value}: must be >= 1")
    if not settings.windows:
        raise ValueError("--windows: give at least one window")
    if max(settings.windows) > settings.max_doc_tokens:
        raise ValueError(f"--windows: {max(settings.windows)} is longer than --max-doc-tokens "
                         f"{settings.max_doc_tokens}")
    for factor in settings.ntk_factors:
        if not factor > 1:
            raise ValueError(f"--ntk-factors {factor:g}: a dynamic-NTK factor must be > 1")
    if settings.ntk_factors and settings.headline_ntk_factor not in settings.ntk_factors:
        raise ValueError(f"--headline-ntk-factor {settings.headline_ntk_factor:g}: must be one of --ntk-factors "
                         f"{','.join(f'{f:g}' for f in settings.ntk_factors)}")
    if settings.books is not None and settings.eval_books is not None:
        check_no_overlap(settings.books, settings.eval_books)


def absolute(settings: ReproSettings) -> ReproSettings:
    """The settings with every path absolute (train.py runs as a subprocess)."""
    def resolved(path: Path | None) -> Path | None:
        return None if path is None else path.resolve()

    paper = replace(settings.paper, mix=resolved(settings.paper.mix), hostfile=resolved(settings.paper.hostfile),
                    gpu_check=resolved(settings.paper.gpu_check), board=resolved(settings.paper.board))
    return replace(settings, books=resolved(settings.books), eval_books=resolved(settings.eval_books),
                   bundle=resolved(settings.bundle), out_dir=settings.out_dir.resolve(),
                   config_dir=settings.config_dir.resolve(), paper=paper)


def mix_path(settings: ReproSettings) -> Path:
    """The mix every model trains on: OUT/data/mix.yml, written by the run; paper-350m reads its mix in place."""
    if settings.profile == "paper-350m":
        return settings.paper.mix or (SAMPLE_MIX if settings.dry_run else PAPER_MIX)
    return settings.out_dir / "data" / "mix.yml"


def run_dir(settings: ReproSettings, scheme: str) -> Path:
    return settings.out_dir / "runs" / scheme


def config_path(settings: ReproSettings, scheme: str) -> Path:
    return settings.config_dir / f"{scheme}.yml"


def all_overrides(settings: ReproSettings) -> list[str]:
    """The profile's overrides, the in-training extrapolation curve on the evaluation books, the evaluation books
    kept out of the training data, the user's --set overrides, then the data location (JSON strings are valid YAML
    scalars)."""
    # paper-350m trains the repository's configs unchanged unless the user turns the curve on with --set
    wanted = (settings.profile != "paper-350m"
              or any(override.startswith("train.extrapolation_eval.") for override in settings.overrides))
    curve = ([f"train.extrapolation_eval.books={json.dumps(str(settings.eval_books))}"]
             if settings.eval_books is not None and wanted else [])
    held_out = [f"data.eval_texts={json.dumps([str(settings.eval_books)])}"] if settings.eval_books is not None else []
    return [*settings.profile_overrides, *curve, *held_out, *settings.overrides,
            f"data.mix={json.dumps(str(mix_path(settings)))}",
            f"data.cache_dir={json.dumps(str(settings.out_dir / 'data' / 'cache'))}"]


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def load_scheme_configs(settings: ReproSettings) -> dict[str, Config]:
    """Every scheme's config with the overrides; ValueError unless they differ only in model.position."""
    configs = {scheme: config_lib.load(config_path(settings, scheme), all_overrides(settings))
               for scheme in settings.schemes}
    flat = {scheme: {key: value for key, value in _flatten(config_lib.to_dict(config)).items()
                     if not key.startswith("model.position.")} for scheme, config in configs.items()}
    first = settings.schemes[0]
    for scheme in settings.schemes[1:]:
        differing = sorted(key for key in flat[first].keys() | flat[scheme].keys()
                           if flat[first].get(key) != flat[scheme].get(key))
        if differing:
            raise ValueError(f"{config_path(settings, scheme)} differs from {config_path(settings, first)} outside "
                             f"model.position ({', '.join(differing[:5])}); the comparison needs identical models")
    return configs


def planned_train_iters(settings: ReproSettings, config: Config, scheme: str) -> int:
    if settings.train_iters is not None:
        return settings.train_iters
    if config.train.train_iters is None:
        raise ValueError(f"{config_path(settings, scheme)}: train.train_iters is null; pass --train-iters")
    return config.train.train_iters


def curve_interval(train_iters: int, budget: SpeedrunBudget) -> int:
    """Steps between the speedrun's in-training extrapolation evaluations: ``budget.curve_points`` per model."""
    return max(1, train_iters // budget.curve_points)


def speedrun_save_interval(train_iters: int) -> int:
    """About four checkpoints per speedrun model: a job cut off at its time limit loses at most a quarter."""
    return max(1, train_iters // 4)


def mix_document(settings: ReproSettings) -> dict[str, Any]:
    """The cpu-tiny mix: the books and the stdlib, tokenised by the run (the speedrun's: speedrun.py)."""
    code: dict[str, Any] = {"type": "python_code"}
    if settings.code_max_documents is not None:
        code["max_documents"] = settings.code_max_documents
    return {
        "description": "Tiny CoCA reproduction: Project Gutenberg books (headers stripped) as text, the Python "
                       "standard library as code, 75/25 by tokens",
        "groups": {
            "text": {"weight": TEXT_WEIGHT, "sources": {
                "gutenberg_books": {"type": "text", "path": str(settings.books), "strip_gutenberg": True}}},
            "code": {"weight": CODE_WEIGHT, "sources": {"python_stdlib": code}},
        },
    }


def write_mix(settings: ReproSettings, document: dict[str, Any]) -> Path:
    """Write the mix file only when its content changes (the cached tokenizer is keyed on it)."""
    from megatron_lite.data.mix import load_mix

    path = mix_path(settings)
    text = yaml.safe_dump(document, sort_keys=False)
    if not path.is_file() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, text)
    load_mix(path)  # validates
    return path


def log(settings: ReproSettings, message: str) -> None:
    if settings.progress:
        print(f"[reproduce] {message}", flush=True)

