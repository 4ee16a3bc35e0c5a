"""gpu_check's ``users_command`` section: the command users launch, measured as they run it.

``deepspeed --num_gpus 1 train.py --config configs/coca_350m.yml`` (the paper's 350M CoCA-slack model, ZeRO 1,
bf16, compiled on CUDA) for ``USERS_ITERS`` steps on given data (a mix, its tokenizer and vocabulary: a data
bundle's shards, ``mix_from_bundle``), logging every ``USERS_LOG_INTERVAL`` steps, then ``USERS_PROFILED_STEPS``
more under ``train.profile``. Its metrics.jsonl gives the steady tokens/s and MFU (the first logged row, step 1,
holds the compile and is left out; the profiled steps too), the first step's seconds and the peak memory; its log
gives the warnings it printed; its profile (run/profile/) how busy the GPU was in a users' step, and on what. The
compile cache starts empty (a fresh ``TORCHINDUCTOR_CACHE_DIR``), so the first step is what a user's first run on
a new machine sees.

On a bare node, ``python -m megatron_lite.bench.users_command BUNDLE DEST`` unpacks and verifies a data bundle
(tools/build_data_bundle.py) into DEST, writes DEST/mix.yml (its shards read in place) and prints the
gpu_check arguments that point this section at it: ``--mix DEST/mix.yml --tokenizer ... --vocab-size N``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
USERS_CONFIG = "configs/coca_350m.yml"
USERS_ITERS = 20
USERS_LOG_INTERVAL = 4
MICRO_BATCH_KEY = "train.train_micro_batch_size_per_gpu"
# the runs beside the config as it is: each variant's name (in its row, its run dir and log names) and its settings
# inductor's settings for fewer launches: independent kernels launched as one (combo kernels, each part with the
# block sizes it would have alone) and the LayerNorms' weight and bias gradients summed in Triton instead of by
# inductor's mix-order reduction and its 4 ATen sums per block: 41 -> 28 launches per coca_slack block and micro batch
# in inductor's CUDA code (tools/inductor_cuda_code.py); the GPU check's -fewer-launches compile modes take them too
FEWER_LAUNCHES_INDUCTOR: dict[str, Any] = {"combo_kernels": True, "combo_kernel_per_subkernel_blocks": True,
                                           "triton": {"mix_order_reduction": False}}
FEWER_LAUNCHES = "train.compile_options=" + yaml.safe_dump(FEWER_LAUNCHES_INDUCTOR, default_flow_style=True,
                                                           sort_keys=False, width=1_000).strip()
# 4 blocks per compiled region: 50 -> 14 region calls per micro batch (their guards and wrappers on the host), a
# first compile ~1.3x longer (tools/bench_train.py --compile-time)
BLOCKS_OF_4 = "train.compile_blocks_per_region=4"
USERS_VARIANTS: dict[str, tuple[str, ...]] = {
    # train.cuda_graphs is on by default for this config on a GPU: the run without them, for comparison
    "no_cuda_graphs": ("train.cuda_graphs=false",), "cpp_wrapper": ("train.compile_cpp_wrapper=true",),
    # the LayerNorms' weight and bias gradients summed in Triton kernels instead of 4 ATen sums per block and micro
    # batch (docs/performance.md)
    "no_mix_order": ("train.compile_options.triton.mix_order_reduction=false",),
    "fewer_launches": (FEWER_LAUNCHES,), "blocks_of_4": (BLOCKS_OF_4,),
    # both: the host's two levers that ask nothing of the user's machine (no C++ build, no graph pool)
    "fewer_launches_blocks_of_4": (FEWER_LAUNCHES, BLOCKS_OF_4)}
USERS_PROFILED_STEPS = 1  # after the measured steps: 16 micro batches on one GPU, a trace of a few MB
USERS_PROFILE_ROWS = 80  # operators in its table (the config's 40 stopped above the small kernels)
SHOWN_COMMAND = f"deepspeed --num_gpus 1 train.py --config {USERS_CONFIG}"
MAX_LISTED_WARNINGS, WARNING_CHARS = 8, 160
# A Python warning ("path.py:83: UserWarning: ..."), a c10 TORCH_WARN line ("[W1126 21:13:03.258 File.cpp:1]")
# or any other "...Warning: " line; "warnings.warn(" is the source line Python prints under a warning.
PYTHON_WARNING = re.compile(r"(?P<path>[^\s:]+\.py):(?P<line>\d+): (?P<category>[A-Z]\w*Warning): (?P<message>.*)")
TORCH_WARNING = re.compile(r"\[W\d{4} [\d:.]+ (?P<where>[^\]]+)\] (?P<message>.*)")
ANY_WARNING = re.compile(r"\b\w*Warning: ")
SOURCE_ECHO = re.compile(r"^\s*warnings\.warn\(")

Progress = Callable[[str], None]


def users_arguments(mix: Path, tokenizer: Path, vocab_size: int, run_dir: Path, cache_dir: Path,
                    iters: int = USERS_ITERS, log_interval: int = USERS_LOG_INTERVAL,
                    master_port: int | None = None, profiled: int = USERS_PROFILED_STEPS,
                    micro_batch: int | None = None, variant: str | None = None) -> list[str]:
    """The deepspeed launcher's command line (this interpreter's ``deepspeed.launcher.runner``, as the
    ``deepspeed`` script runs it): the paper config as it is (at ``micro_batch``, if given; with a
    ``USERS_VARIANTS`` settings if ``variant`` names one), pointed at the data, for ``iters`` measured steps and
    ``profiled`` more under train.profile."""
    sets = [f"data.mix={json.dumps(str(mix))}", f"data.cache_dir={json.dumps(str(cache_dir))}",
            f"data.tokenizer.model={json.dumps(str(tokenizer))}", f"model.vocab_size={vocab_size}",
            "train.train_epochs=1", f"train.train_iters={iters + profiled}", f"train.log_interval={log_interval}",
            "train.eval_interval=0", "train.save_interval=0", "train.save_final=false", "train.wandb.mode=disabled"]
    if profiled:  # shapes (trace, _shapes.txt): which tensors an operator took (e.g. which sums a block's backward runs)
        sets += [f"train.profile.start_step={iters + 1}", f"train.profile.steps={profiled}",
                 "train.profile.record_shapes=true", f"train.profile.row_limit={USERS_PROFILE_ROWS}"]
    if micro_batch:
        sets.append(f"{MICRO_BATCH_KEY}={micro_batch}")
    if variant:
        sets += USERS_VARIANTS[variant]
    port = ["--master_port", str(master_port)] if master_port else []
    arguments = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", *port,
                 str(REPO / "train.py"), "--config", str(REPO / USERS_CONFIG), "--run-dir", str(run_dir),
                 "--resume", "none"]
    for assignment in sets:
        arguments += ["--set", assignment]
    return arguments


def find_warnings(log_text: str) -> list[str]:
    """The warnings a run printed, one short entry each, in order: Python warnings as ``file.py:LINE: Category:
    message``, torch's C++ warnings as ``File.cpp:LINE] message``, other ``...Warning:`` lines from the match on.
    A ``warnings.warn(`` source line counts only where no warning line precedes it (its message was lost).
    Progress-bar carriage returns split lines as a terminal shows them."""
    found: list[str] = []
    previous_was_warning = False
    for line in log_text.replace("\r", "\n").splitlines():
        entry = None
        if match := PYTHON_WARNING.search(line):
            entry = (f"{Path(match['path']).name}:{match['line']}: {match['category']}: "
                     f"{match['message'].strip()}")
        elif match := TORCH_WARNING.search(line):
            entry = f"{match['where'].strip()}] {match['message'].strip()}"
        elif match := ANY_WARNING.search(line):
            entry = line[max(0, match.start() - 40):].strip()
        elif SOURCE_ECHO.match(line) and not previous_was_warning:
            entry = f"(message lost) {line.strip()}"
        if entry is not None:
            found.append(entry[:WARNING_CHARS])
        previous_was_warning = entry is not None
    return found


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's rows (a torn last line, from a killed run, left out)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def summarise_metrics(rows: Sequence[dict[str, Any]], seq_length: int,
                      through_step: int | None = None) -> dict[str, Any]:
    """Steady tokens/s, TFLOP/s and MFU over the training rows after the first logged one (time-weighted:
    total tokens over total time), the first step's seconds, peak memory (GB, as train.py logs it), the first
    and last logged loss and the last step; rows past ``through_step`` (the profiled steps) left out."""
    train = [row for row in rows if row.get("tokens_per_sec") and "step" in row
             and (through_step is None or row["step"] <= through_step)]
    summary: dict[str, Any] = {}
    if not train:
        return summary
    first = train[0]
    if first["step"] == 1 and first.get("consumed_samples"):
        summary["first_step_s"] = first["consumed_samples"] * seq_length / first["tokens_per_sec"]
    steady = train[1:]
    if steady:
        previous = [first["step"], *(row["step"] for row in steady[:-1])]
        steps = [row["step"] - before for row, before in zip(steady, previous)]
        # a row's tokens/s is tokens_per_step x steps / seconds: the tokens per step cancel out
        tokens_per_sec = sum(steps) / sum(count / row["tokens_per_sec"] for count, row in zip(steps, steady))
        summary["steady_steps"] = f"{steady[0]['step'] - steps[0] + 1}-{steady[-1]['step']}"
        summary["tokens_per_sec"] = tokens_per_sec
        last = steady[-1]
        for key in ("tflops", "mfu"):
            if last.get(key) is not None:  # both proportional to tokens/s within a run
                summary[key] = last[key] / last["tokens_per_sec"] * tokens_per_sec
    peaks = [row["memory_gb"] for row in rows if row.get("memory_gb") is not None
             and (through_step is None or row.get("step", 0) <= through_step)]
    if peaks:
        summary["peak_memory_gb"] = max(peaks)
    losses = [row["loss"] for row in train if row.get("loss") is not None]
    if losses:
        summary.update(loss_first=losses[0], loss_last=losses[-1])
    summary["last_step"] = train[-1]["step"]
    return summary


def profile_fields(run_dir: Path) -> dict[str, Any]:
    """The profiled step's summary (megatron_lite.training.profiling) as row fields: the GPU's busy share of the
    step's wall time, and the summary line; nothing when the run wrote none."""
    from megatron_lite.training.profiling import PROFILE_DIR, ProfileSummary

    found = sorted((run_dir / PROFILE_DIR).glob("steps_*_rank0.json"))
    if not found:
        return {}
    try:
        summary = ProfileSummary(**json.loads(found[-1].read_text()))
    except (OSError, TypeError, ValueError):
        return {}
    fields: dict[str, Any] = {"profile": summary.line(), "profile_table": str(found[-1].with_suffix(".txt"))}
    if summary.busy_s is not None and summary.wall_s > 0:
        fields["gpu_busy"] = summary.busy_s / summary.wall_s
    return fields


def _seq_length(run_dir: Path) -> int:
    """model.seq_length of the run (its config.yml), else the paper config's."""
    for path in (run_dir / "config.yml", REPO / USERS_CONFIG):
        try:
            return int(yaml.safe_load(path.read_text())["model"]["seq_length"])
        except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError):
            continue
    return 512


def _stop_tree(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the launcher and every process under it (the rank), then SIGKILL what is left after 30 s."""
    import psutil  # a DeepSpeed requirement

    try:
        processes = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    except psutil.Error:
        processes = []
    for each in processes:
        try:
            each.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(processes, timeout=30)
    for each in alive:
        try:
            each.kill()
        except psutil.Error:
            pass
    process.wait()


def _failure_line(log_text: str) -> str:
    lines = [line.strip() for line in log_text.replace("\r", "\n").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:") or "Error" in line]
    return (errors or lines or ["no output"])[-1][:300]


def run_users_command(mix: Path | None, tokenizer: Path | None, vocab_size: int | None, work: Path, cuda: bool,
                      timeout_s: float, progress: Progress, iters: int = USERS_ITERS,
                      micro_batch: int | None = None, variant: str | None = None,
                      skipped: str | None = None) -> list[dict[str, Any]]:
    """One row: the users' command run in ``work`` (run dir, data cache, compile cache, log.txt); with
    ``micro_batch``, at that micro batch (the global batch, so the optimizer steps, unchanged: the accumulation
    follows), in ``run_micro_batch_N`` with ``log_micro_batch_N.txt``; with ``variant``, with its
    ``USERS_VARIANTS`` settings (``..._cudagraphs``, ``..._cpp_wrapper``). ``skipped``: the row's status, nothing
    run (a section past its budget)."""
    shown = (SHOWN_COMMAND + (f" --set {MICRO_BATCH_KEY}={micro_batch}" if micro_batch else "")
             + "".join(f" --set {shlex.quote(setting)}" for setting in USERS_VARIANTS.get(variant or "", ())))
    row: dict[str, Any] = {"command": shown, "steps": iters, "micro_batch": micro_batch or "config",
                           "variant": variant or "-"}
    if skipped is not None or not cuda:
        row["status"] = skipped or "skipped: no CUDA"
        return [row]
    if mix is None or tokenizer is None or vocab_size is None:
        row["status"] = "skipped: no --mix/--tokenizer/--vocab-size (a bundle's shards: tools/gpu/check_gpu.sh)"
        return [row]
    from megatron_lite.training.distributed import free_port

    suffix = (f"_micro_batch_{micro_batch}" if micro_batch else "") + (f"_{variant}" if variant else "")
    run_dir, log_path = work / f"run{suffix}", work / f"log{suffix}.txt"
    for stale in (run_dir, work / "inductor_cache"):  # a fresh run and a cold compile cache, as a user's first run
        shutil.rmtree(stale, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    arguments = users_arguments(mix, tokenizer, vocab_size, run_dir, work / "cache", iters,
                                master_port=free_port(), micro_batch=micro_batch, variant=variant)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor_cache")}
    progress(f"  users_command: {shown} ({iters} steps, log {log_path})")
    start = time.perf_counter()
    timed_out = False
    with log_path.open("wb") as log:
        log.write(f"$ {shlex.join(arguments)}\n".encode())
        log.flush()
        process = subprocess.Popen(arguments, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            if process.poll() is None:  # timed out, or gpu_check itself stopped: never leave the GPU busy
                _stop_tree(process)
    seconds = time.perf_counter() - start
    log_text = log_path.read_text(errors="replace")
    warnings_found = find_warnings(log_text)
    summary = summarise_metrics(read_metrics(run_dir / "metrics.jsonl"), _seq_length(run_dir), through_step=iters)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the final save: GBs nobody reads
    row.update(exit_code=process.returncode, wall_s=seconds, **summary, **profile_fields(run_dir),
               warnings=len(warnings_found),
               warning_lines=" ; ".join(warnings_found[:MAX_LISTED_WARNINGS])
               + (f" ; (+{len(warnings_found) - MAX_LISTED_WARNINGS} more)"
                  if len(warnings_found) > MAX_LISTED_WARNINGS else ""),
               log=str(log_path))
    if timed_out:
        row["status"] = f"failed: timed out after {timeout_s:.0f} s (metrics so far kept)"
    elif process.returncode != 0:
        row["status"] = f"failed: exited {process.returncode}: {_failure_line(log_text)}"
    elif "tokens_per_sec" not in summary:
        row["status"] = "failed: no steady training rows in metrics.jsonl"
    else:
        row["status"] = "ok"
    return [row]


# ----------------------------------------------------------------------------------------------
# A data bundle as the section's data


def mix_from_bundle(bundle: Path, dest: Path) -> tuple[Path, Path, int]:
    """``bundle`` unpacked and verified into ``dest/bundle`` (megatron_lite.repro.bundle), its shards as the mix
    ``dest/mix.yml``; returns (mix, tokenizer, vocabulary size)."""
    from megatron_lite.files import write_text_atomic
    from megatron_lite.repro.bundle import unpack_bundle
    from megatron_lite.repro.speedrun import bundle_mix_document

    unpacked = unpack_bundle(bundle, dest / "bundle")
    mix = dest / "mix.yml"
    write_text_atomic(mix, yaml.safe_dump(bundle_mix_document(unpacked), sort_keys=False))
    return mix, unpacked.tokenizer, unpacked.vocab_size


def main(argv: list[str] | None = None) -> int:
    from megatron_lite.cli import print_error

    arguments = sys.argv[1:] if argv is None else argv
    if len(arguments) != 2:
        print_error("usage: python -m megatron_lite.bench.users_command BUNDLE DEST")
        return 2
    try:
        mix, tokenizer, vocab_size = mix_from_bundle(Path(arguments[0]).resolve(), Path(arguments[1]).resolve())
    except ValueError as error:
        print_error(error)
        return 2
    print(shlex.join(["--mix", str(mix), "--tokenizer", str(tokenizer), "--vocab-size", str(vocab_size)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
