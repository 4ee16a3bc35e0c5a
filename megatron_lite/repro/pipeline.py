"""Train ALiBi / RoPE / CoCA slack / CoCA strict models that differ only in the position scheme,
then measure their long-context extrapolation (the CoCA paper's Tables 1-3; profiles cpu-tiny,
gpu-speedrun and paper-350m).

Phases, each timed (``OUT/wall_times.json`` keeps every invocation, so a resumed run adds up):

1. ``data``: write ``OUT/data/mix.yml`` (75% Gutenberg books with their headers stripped / 25%
   Python sources, by tokens) and build the tokenizer and shards in ``OUT/data/cache``; the speedrun
   unpacks and verifies its data bundle and reads the bundle's shards in place instead; paper-350m
   prints its budget first (megatron_lite.repro.paper) and tokenises its mix file, read in place.
   ``probe`` (speedrun): a few steps of every scheme set the one step count (megatron_lite.repro.speedrun).
2. ``train <scheme>``: ``python train.py --config configs/repro/tiny/<scheme>.yml --run-dir
   OUT/runs/<scheme> --resume auto`` (paper-350m: through the deepspeed launcher), logged to
   ``OUT/logs/train_<scheme>.log``. A model whose
   latest complete checkpoint is at ``train_iters`` is skipped; an interrupted one resumes.
3. ``perplexity <scheme>`` / ``passkey <scheme>``: the long-context evaluation library
   (megatron_lite.eval.long_context) with no scaling and dynamic NTK; every (scaling, window)
   result is cached under ``OUT/eval/<scheme>/{perplexity,passkey}/cache``, so a re-run is cheap.
4. ``report``: ``OUT/results.json``, ``OUT/tables.md`` and the plots (megatron_lite.repro.report).
"""
from __future__ import annotations

import datetime
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from megatron_lite.files import write_text_atomic
from megatron_lite.repro.settings import (ReproSettings, absolute, load_scheme_configs, log, mix_document, mix_path,
                                          planned_train_iters, run_dir, validate_paper_flags, validate_settings,
                                          write_mix)
from megatron_lite.repro import paper, speedrun
from megatron_lite.repro.training import train_scheme


def scaling_names(settings: ReproSettings) -> list[str]:
    return ["none", *(f"dynamic:{factor:g}" for factor in settings.ntk_factors)]


def _evaluate(settings: ReproSettings, scheme: str, kind: str, stride: int) -> dict[str, Any]:
    from megatron_lite.eval.long_context import LongContextSettings, run_long_context_eval
    from megatron_lite.eval.scaling import parse_scaling_list

    out_dir = settings.out_dir / "eval" / scheme / kind
    base = LongContextSettings(checkpoints=[f"{scheme}={run_dir(settings, scheme)}"], out_dir=out_dir,
                               scalings=parse_scaling_list(",".join(scaling_names(settings))), seed=settings.seed,
                               batch_size=settings.batch_size, device=settings.eval_device,
                               dtype=settings.eval_dtype, progress=settings.progress)
    if kind == "perplexity":
        eval_settings = replace(base, ppl_docs=str(settings.eval_books), windows=list(settings.windows), stride=stride,
                                max_doc_tokens=settings.max_doc_tokens, max_docs=settings.max_docs,
                                strip_gutenberg=True)
    else:
        eval_settings = replace(base, passkey_lengths=list(settings.passkey_lengths),
                                passkey_cases=settings.passkey_cases)
    threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    try:
        results = run_long_context_eval(eval_settings)
    finally:
        torch.set_num_threads(threads)
    cases_path = out_dir / "passkey_cases.json"
    results["passkey_cases"] = json.loads(cases_path.read_text()) if cases_path.is_file() else []
    return results


# ----------------------------------------------------------------------------------------------
# Wall time


class PhaseClock:
    """Seconds per phase of this invocation, appended to a history file after every phase."""

    def __init__(self, history_path: Path, settings: ReproSettings) -> None:
        self.history_path = history_path
        self.settings = settings
        self.history: list[dict[str, Any]] = json.loads(history_path.read_text()) if history_path.is_file() else []
        self.current: dict[str, float] = {}
        self.history.append({"started": datetime.datetime.now().isoformat(timespec="seconds"), "phases": self.current})

    @contextmanager
    def phase(self, name: str, timed: bool = True) -> Iterator[None]:
        """Time the block as ``name``; ``timed=False`` (a phase skipped by --only) records nothing."""
        if not timed:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            self.current[name] = round(self.current.get(name, 0.0) + seconds, 1)
            log(self.settings, f"phase {name}: {seconds:,.1f} s")
            self.history_path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.history_path, json.dumps(self.history, indent=1) + "\n")

    def all_invocations(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for entry in self.history:
            for name, seconds in entry["phases"].items():
                totals[name] = round(totals.get(name, 0.0) + seconds, 1)
        return totals


# ----------------------------------------------------------------------------------------------
# The whole reproduction


def _prepare_profile(settings: ReproSettings) -> tuple[ReproSettings, dict[str, Any] | None]:
    """The settings and the mix file's content (None: paper-350m reads its mix in place). The speedrun: its
    bundle unpacked and verified, the bundle's tokenizer, vocabulary and held-out books. The speedrun and
    paper-350m evaluate on CUDA in bf16 where there is one (not in a dry run)."""
    on_cuda = torch.cuda.is_available() and not settings.dry_run
    if settings.profile == "paper-350m":
        return (replace(settings, profile_overrides=paper.profile_overrides(settings),
                        eval_device="cuda" if on_cuda else "cpu", eval_dtype="bf16" if on_cuda else "fp32"), None)
    if settings.profile != "gpu-speedrun":
        return settings, mix_document(settings)
    bundle = speedrun.unpack(settings)
    return (replace(settings, eval_books=bundle.eval_books,
                    profile_overrides=speedrun.profile_overrides(settings, bundle),
                    eval_device="cuda" if on_cuda else "cpu", eval_dtype="bf16" if on_cuda else "fp32"),
            speedrun.bundle_mix_document(bundle))


def _jsonable(value: Any) -> Any:
    """``value`` with every Path (nested dataclasses' too, after asdict) as a string."""
    if isinstance(value, dict):
        return {key: _jsonable(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_jsonable(item) for item in value]
    return str(value) if isinstance(value, Path) else value


def _require(settings: ReproSettings, phase: str, done: bool, what: str) -> None:
    if not done:
        raise ValueError(f"--only {','.join(settings.phases)}: the {phase} phase has not run yet ({what}); include it")


def print_paper_budget(settings: ReproSettings) -> ReproSettings:
    """paper-350m: the budget printed now, before evaluation books are fetched (the run keeps it in
    OUT/budget.json without printing it again); the settings to run with."""
    validate_paper_flags(absolute(settings))
    prepared, _ = _prepare_profile(absolute(settings))
    paper.announce_budget(prepared, load_scheme_configs(prepared))
    return replace(settings, paper=replace(settings.paper, budget_printed=True))


def run_reproduction(settings: ReproSettings) -> dict[str, Any]:
    """Data, (probe,) training, evaluation and report; returns what OUT/results.json holds. With
    ``settings.phases`` a subset, only those run (the earlier ones must be done: a split run)."""
    from megatron_lite.repro import report
    from megatron_lite.repro.training import training_status

    settings = absolute(settings)
    validate_settings(settings)
    gpu_plan = speedrun.announce_reference_plan(settings) if settings.profile == "gpu-speedrun" else None
    clock = PhaseClock(settings.out_dir / "wall_times.json", settings)
    with clock.phase("data", timed="data" in settings.phases):
        settings, mix = _prepare_profile(settings)
    configs = load_scheme_configs(settings)
    first = configs[settings.schemes[0]]
    budget = paper.announce_budget(settings, configs) if settings.profile == "paper-350m" else None
    train_length = first.model.seq_length
    stride = settings.stride or train_length
    if stride > min(settings.windows):
        raise ValueError(f"--stride {stride}: longer than the smallest --windows {min(settings.windows)}")
    if "data" in settings.phases:
        with clock.phase("data"):
            from megatron_lite.data.preprocess import prepare_data

            if mix is not None:
                write_mix(settings, mix)
            else:
                from megatron_lite.data.mix import load_mix

                load_mix(mix_path(settings))  # one line naming a malformed mix, before any tokenising
            prepare_data(first.data, first.model.vocab_size, progress=settings.progress)
    if settings.profile == "gpu-speedrun":
        _require(settings, "data", (settings.out_dir / "data" / "mix.yml").is_file(), "no OUT/data/mix.yml")
        with clock.phase("probe", timed="probe" in settings.phases):
            train_iters = speedrun.planned_iters(settings, configs)
        extra_env = speedrun.environment(settings)
    elif budget is not None:
        train_iters = int(budget["train_iters"])
        extra_env = paper.environment(settings)
    else:
        train_iters = planned_train_iters(settings, first, settings.schemes[0])
        extra_env = {}
    log(settings, f"schemes {', '.join(settings.schemes)}; {train_iters} steps each; out {settings.out_dir}")

    training: dict[str, dict[str, Any]] = {}
    for scheme in settings.schemes:
        if "train" in settings.phases:
            with clock.phase(f"train {scheme}"):
                training[scheme] = train_scheme(settings, scheme, configs[scheme], train_iters, extra_env)
        else:
            from megatron_lite.repro.training import training_summary

            status = training_status(run_dir(settings, scheme), train_iters, configs[scheme])
            if {"eval", "report"} & set(settings.phases):
                _require(settings, "train", status.finished, f"{scheme} is at step {status.step} of {train_iters}")
            training[scheme] = training_summary(run_dir(settings, scheme), configs[scheme], train_iters,
                                                "skipped (--only)")
    if not {"eval", "report"} & set(settings.phases):
        log(settings, f"stopping after {', '.join(settings.phases)} (--only)")
        return {"training": training, "train_iters": train_iters}

    evaluations: dict[str, dict[str, Any]] = {}
    for scheme in settings.schemes:
        # the evaluation caches every cell, so a report-only invocation re-reads results without recomputing
        with clock.phase(f"perplexity {scheme}", timed="eval" in settings.phases):
            evaluations[f"{scheme} perplexity"] = _evaluate(settings, scheme, "perplexity", stride)
        if settings.passkey_lengths:
            with clock.phase(f"passkey {scheme}", timed="eval" in settings.phases):
                evaluations[f"{scheme} passkey"] = _evaluate(settings, scheme, "passkey", stride)
    if "report" not in settings.phases:
        log(settings, f"stopping after {', '.join(settings.phases)} (--only); evaluation results are cached")
        return {"training": training, "train_iters": train_iters}

    with clock.phase("report"):
        results = report.assemble_results(evaluations, training, train_length, train_iters, stride,
                                          _jsonable(asdict(settings)))
        plots = report.write_plots(results, [case for evaluation in evaluations.values()
                                             for case in evaluation["passkey_cases"]], settings.out_dir)
    results["plots"] = [path.name for path in plots]
    if settings.profile == "gpu-speedrun" and speedrun.probe_path(settings).is_file():
        results["probe"] = json.loads(speedrun.probe_path(settings).read_text())
    if gpu_plan is not None:
        results["reference_plan"] = gpu_plan
    if budget is not None:
        results["budget"] = budget
    results["wall_seconds"] = dict(clock.current)
    results["wall_seconds_all_invocations"] = clock.all_invocations()
    (settings.out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (settings.out_dir / "tables.md").write_text(report.tables_markdown(results, settings.headline_ntk_factor))
    log(settings, f"wall time {sum(clock.current.values()):,.1f} s in this invocation, "
                  f"{sum(results['wall_seconds_all_invocations'].values()):,.1f} s in all; per phase in tables.md")
    log(settings, f"wrote {settings.out_dir / 'results.json'}, {settings.out_dir / 'tables.md'}, "
                  + ", ".join(str(settings.out_dir / name) for name in results["plots"]))
    return results
