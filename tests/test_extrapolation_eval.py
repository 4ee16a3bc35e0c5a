"""The in-training extrapolation evaluation (train.extrapolation_eval): the same targets at every window, each
window's perplexity equal to the sliding-window evaluation's on those targets for every scheme and scaling, the
metrics keys and the plot; and through train.py (slow): the rows, the plot, the printed cost, training unchanged."""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
from pathlib import Path

import pytest
import torch

from megatron_lite import checkpoint_dirs
from megatron_lite import config as config_lib
from megatron_lite.config import ExtrapolationEvalConfig, RopeScalingConfig
from megatron_lite.eval.perplexity import token_nlls
from megatron_lite.eval.scaling import parse_scaling
from megatron_lite.model import build_model
from megatron_lite.model.loss import IGNORE_INDEX
from megatron_lite.training.extrapolation import (ExtrapolationEval, format_row, plot_curve, ppl_key, ratio_key,
                                                  window_blocks)
from megatron_lite.training.step import evaluate as validation_loss
from megatron_lite.training.stopping import EvaluationInterrupted, StopRequest, evaluation_interrupt_check
from test_eval_support import single_thread, tiny_eval_config  # noqa: F401 (fixture)
from training_helpers import WORDS, metrics, run_train, tiny_train_config, train_losses, write_config

SEQ = 16
SCHEMES = [("alibi", "slack"), ("rope", "slack"), ("coca", "slack"), ("coca", "strict")]


def test_every_window_scores_the_same_targets_with_its_last_predictions() -> None:
    book_T = torch.arange(1000, 1000 + 8 * SEQ + 3 * SEQ + 5)  # 5 tokens too many: not a whole block, unused
    max_window = 8 * SEQ
    targets = None
    for window in (SEQ, 2 * SEQ, 8 * SEQ):
        blocks = window_blocks(book_T, window, SEQ, max_window)
        assert len(blocks) == 3
        scored = []
        for block in blocks:
            assert block.input_ids_T.shape == block.labels_T.shape == (window,)
            assert bool((block.labels_T[:window - SEQ] == IGNORE_INDEX).all())
            # the book counts up, so each scored label is its input's next token
            assert torch.equal(block.labels_T[window - SEQ:], block.input_ids_T[window - SEQ:] + 1)
            scored += block.labels_T[window - SEQ:].tolist()
        targets = targets or scored
        assert scored == targets == list(range(1000 + max_window, 1000 + max_window + 3 * SEQ))


def _settings(scalings: list[str]) -> ExtrapolationEvalConfig:
    return ExtrapolationEvalConfig(interval=1, windows=[1, 2, 4], scored_tokens_per_book=2 * SEQ + 7,
                                   scalings=scalings, batch_size=2)


def _reference_ppl(model: torch.nn.Module, books: list[torch.Tensor], window: int, max_window: int,
                   scored: int) -> float:
    """The sliding-window evaluation (eval.perplexity, stride = the training length) of each book from where its
    windows line up with the in-training ones, over the same targets (positions max_window ..)."""
    nll = []
    for book in books:
        # where the reference's windows read what the blocks read: its second window is the first block, or (at the
        # largest window) its first window, whose last SEQ predictions are the first block's
        offset = max(max_window - 1 - window, SEQ - 1)
        nll_N, _ = token_nlls(model, book[offset:max_window + scored], window, SEQ)
        nll.append(nll_N[max_window - offset:])
    return math.exp(float(torch.cat(nll).mean()))


@pytest.mark.parametrize("scheme,constraint", SCHEMES)
def test_perplexity_is_the_sliding_window_perplexity_of_the_same_targets(scheme: str, constraint: str) -> None:
    model = build_model(tiny_eval_config(scheme, constraint, seq_length=SEQ, vocab_size=300)).eval()
    generator = torch.Generator().manual_seed(7)
    books = [torch.randint(0, 300, (4 * SEQ + 3 * SEQ,), generator=generator) for _ in range(2)]
    rotary = scheme != "alibi"
    settings = _settings(["dynamic:4"])
    evaluation = ExtrapolationEval(settings, model.config, books, torch.device("cpu"))
    assert evaluation.scored_tokens == 2 * 2 * SEQ  # rounded down to whole blocks
    row = evaluation.evaluate(model)
    assert model.config.position.scaling == RopeScalingConfig()  # the model's own scaling is back
    assert model.training is True  # evaluate() leaves the model training, as the engine was

    scalings = [parse_scaling("none")] + ([parse_scaling("dynamic:4")] if rotary else [])
    assert (ppl_key(2, parse_scaling("dynamic:4")) in row) == rotary  # non-rotary schemes skip the scaling
    model.eval()
    for scaling in scalings:
        if scaling.type != "none":
            model.set_rope_scaling(scaling.config())
        for multiple in (1, 2, 4):
            expected = _reference_ppl(model, evaluation.books, multiple * SEQ, 4 * SEQ, 2 * SEQ)
            assert row[ppl_key(multiple, scaling)] == pytest.approx(expected, rel=1e-5), (scaling, multiple)
        for multiple in (2, 4):
            assert row[ratio_key(multiple, scaling)] == pytest.approx(
                row[ppl_key(multiple, scaling)] / row[ppl_key(1, scaling)])
    assert row["extrapolation_seconds"] > 0


def test_learned_positions_skip_the_windows_past_their_table() -> None:
    model = build_model(tiny_eval_config("learned", seq_length=SEQ, vocab_size=300))  # positions end at SEQ
    books = [torch.randint(0, 300, (4 * SEQ + 2 * SEQ,), generator=torch.Generator().manual_seed(3))]
    evaluation = ExtrapolationEval(_settings([]), model.config, books, torch.device("cpu"))
    assert (evaluation.windows, evaluation.skipped_windows, evaluation.max_window) == ([1], [2, 4], 4 * SEQ)
    assert "windows 2x, 4x skipped (learned positions cannot extrapolate)" in evaluation.describe()
    row = evaluation.evaluate(model)  # the same targets as the other schemes score: after the largest window
    assert set(row) == {ppl_key(1), "extrapolation_scored_tokens", "extrapolation_seconds"}
    model.eval()
    assert row[ppl_key(1)] == pytest.approx(_reference_ppl(model, evaluation.books, SEQ, 4 * SEQ, 2 * SEQ), rel=1e-5)


def test_a_stop_signal_drops_the_evaluation_and_leaves_the_model_as_it_was() -> None:
    """A SIGTERM during an evaluation stops it before its next batch (validation too), the model back in training
    mode with its own rotary scaling; the fault injection's check sends a real SIGTERM first."""
    model = build_model(tiny_eval_config("rope", seq_length=SEQ, vocab_size=300))
    books = [torch.randint(0, 300, (4 * SEQ + 3 * SEQ,), generator=torch.Generator().manual_seed(5)) for _ in range(2)]
    evaluation = ExtrapolationEval(_settings(["dynamic:4"]), model.config, books, torch.device("cpu"))
    batches = []
    with StopRequest() as stop:
        check = evaluation_interrupt_check(stop, torch.device("cpu"), world_size=1)

        def counted_check() -> None:
            batches.append(len(batches))
            if len(batches) == 8:  # 2 batches per window, 3 windows: the 8th is under the dynamic scaling
                os.kill(os.getpid(), signal.SIGTERM)
            check()

        check()  # no signal yet: nothing raised
        with pytest.raises(EvaluationInterrupted):
            evaluation.evaluate(model, counted_check)
        assert len(batches) == 8 and stop.signal_name == "SIGTERM"
        with pytest.raises(EvaluationInterrupted):  # validation: stopped before its first batch
            validation_loss(model, [{"input_ids": books[0][None, :SEQ], "labels": books[0][None, 1:SEQ + 1]}],
                            torch.device("cpu"), check)
    assert model.training is True and model.config.position.scaling == RopeScalingConfig()
    with StopRequest() as stop:
        with pytest.raises(EvaluationInterrupted):
            evaluation_interrupt_check(stop, torch.device("cpu"), world_size=1, inject_sigterm=True)()
        assert stop.signal_name == "SIGTERM"


def test_keys_console_line_and_plot(tmp_path: Path) -> None:
    dynamic = parse_scaling("dynamic:4")
    assert (ppl_key(4), ratio_key(4), ppl_key(4, dynamic)) == (
        "extrapolation_ppl_x4", "extrapolation_ratio_x4", "extrapolation_ppl_x4_dynamic4")
    rows = []
    for step, growth in ((0, 1.0), (10, 1.2), (20, 1.5)):
        row = {"step": step, "tokens_seen": step * 100, ppl_key(1): 100.0, ppl_key(2): 100.0 * growth,
               ratio_key(2): growth, ppl_key(1, dynamic): 100.0, ppl_key(2, dynamic): 101.0,
               ratio_key(2, dynamic): 1.01, "extrapolation_seconds": 0.5}
        rows.append(row)
    assert format_row(rows[1], [1, 2], 20) == "step 10/20 | extrapolation ppl x1 100.00 x2 120.00 (1.200) | 0.5 s"
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in [{"step": 1, "loss": 3.0}, *rows]))
    plot = plot_curve(path, tmp_path / "extrapolation.png", "title")
    assert plot is not None and plot.stat().st_size > 10_000
    assert plot_curve(tmp_path / "none.jsonl", tmp_path / "none.png", "title") is None


@pytest.mark.parametrize("key,value,message", [
    ("windows", [2, 4], "windows=[2, 4]: positive multiples"),
    ("windows", [1, 2, 2], "windows=[1, 2, 2]: repeats a window"),
    ("interval", -1, "interval=-1"),
    ("scored_tokens_per_book", 0, "scored_tokens_per_book=0: must be positive"),
    ("scalings", ["dynamic:0.5"], "scalings[0] 'dynamic:0.5': factor must be >= 1"),
    ("scalings", ["none"], "scalings[0]=none"),
    ("max_seconds", 0, "max_seconds=0"),
])
def test_settings_errors_name_the_key(key: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"train.extrapolation_eval.{message}")):
        config_lib.load(Path(__file__).parents[1] / "configs/tiny/rope.yml",
                        [f"train.extrapolation_eval.{key}={json.dumps(value)}"])


# ----------------------------------------------------------------------------------------------
# Through train.py


def write_books(directory: Path, count: int = 2, words: int = 900) -> Path:
    """Held-out pseudo-prose books (another seed than the training corpus's)."""
    rng = random.Random(99)
    directory.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        (directory / f"book_{index}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(words)) + ".\n")
    return directory


def curve_settings(books: Path) -> dict[str, object]:
    return {"interval": 4, "windows": [1, 2, 4], "scored_tokens_per_book": 64, "books": str(books),
            "strip_gutenberg": False, "scalings": ["dynamic:2"]}


@pytest.mark.slow
def test_train_py_logs_the_curve_and_trains_the_same_steps(training_corpus, tmp_path: Path) -> None:
    """The curve, and train.profile (tests/test_profiling.py) through train.py in the same run."""
    mix, cache = training_corpus
    books = write_books(tmp_path / "books")
    plain = write_config(tmp_path / "plain.yml", tiny_train_config(mix, cache, eval_interval=0, save_interval=0))
    with_curve = write_config(tmp_path / "curve.yml", tiny_train_config(
        mix, cache, eval_interval=0, save_interval=0, extrapolation_eval=curve_settings(books),
        profile={"start_step": 3, "steps": 2}))
    run_train(plain, tmp_path / "plain")
    output = run_train(with_curve, tmp_path / "curve").stdout

    # neither the evaluation nor the profiler draws random numbers or changes a weight
    assert train_losses(tmp_path / "curve") == train_losses(tmp_path / "plain")
    profile = tmp_path / "curve" / "profile"
    assert f"profiling steps 3-4 on rank 0 into {profile}" in output
    assert re.search(r"profiled steps 3-4: [\d.]+ s wall; CPU self time: .*gemm \d+%", output)
    assert sorted(path.name for path in profile.iterdir()) == [
        "steps_3-4_rank0.json", "steps_3-4_rank0.trace.json.gz", "steps_3-4_rank0.txt"]
    assert "aten::mm" in (profile / "steps_3-4_rank0.txt").read_text()
    rows = [row for row in metrics(tmp_path / "curve") if "extrapolation_ppl_x1" in row]
    assert [row["step"] for row in rows] == [0, 4, 8]
    assert [row["tokens_seen"] for row in rows] == [0, 4 * 8 * 32, 8 * 8 * 32]  # 8 samples of 32 tokens per step
    for row in rows:
        for key in ("extrapolation_ppl_x2", "extrapolation_ratio_x4", "extrapolation_ppl_x4_dynamic2",
                    "extrapolation_ratio_x2_dynamic2", "extrapolation_seconds"):
            assert math.isfinite(row[key]), key
        assert row["extrapolation_scored_tokens"] == 2 * 64
    assert rows[-1]["extrapolation_ppl_x1"] < rows[0]["extrapolation_ppl_x1"]  # it learnt something
    assert (tmp_path / "curve" / "extrapolation.png").stat().st_size > 10_000
    assert "extrapolation eval every 4 steps: windows 1x, 2x, 4x of 32" in output
    assert "step 8/8 | extrapolation ppl x1 " in output and output.count("extrapolation ppl") == 3


@pytest.mark.slow
def test_a_sigterm_during_an_evaluation_saves_the_step_at_once_and_the_resume_redoes_it(training_corpus,
                                                                                       tmp_path: Path) -> None:
    """A scheduler's stop mid-evaluation (a real SIGTERM to rank 0 of 2, from train.fault_injection): both ranks
    drop the step's validation and long-context rows and save its checkpoint with the stop recorded. The resumed
    run evaluates that step first, also at the run's last step: its rows, and every row and loss after them, are
    the uninterrupted run's."""
    mix, cache = training_corpus
    settings = tiny_train_config(mix, cache, train_iters=4, eval_interval=2, save_interval=0, extrapolation_eval={
        **curve_settings(write_books(tmp_path / "books")), "interval": 2})
    reference = write_config(tmp_path / "reference.yml", settings)

    def stopped_at(step: int) -> Path:
        return write_config(tmp_path / f"stop_{step}.yml", {**settings, "train": {
            **settings["train"], "fault_injection": {"sigterm_during_evaluation_step": step}}})

    config = stopped_at(2)
    output = run_train(config, tmp_path / "run", ranks=2).stdout
    assert "step 2: SIGTERM received: the step's evaluation is dropped, its checkpoint saved first" in output
    assert "stopped by SIGTERM at step 2; resume with --resume auto" in output
    final = checkpoint_dirs.latest_complete(tmp_path / "run" / checkpoint_dirs.CHECKPOINTS_DIR)
    assert final is not None and checkpoint_dirs.read_complete_marker(final)["step"] == 2
    assert checkpoint_dirs.read_complete_marker(final)["stopped_by"] == "signal"
    assert len(list(final.glob("rng_state_rank*.pt"))) == 2  # both ranks saved
    rows = metrics(tmp_path / "run")
    assert [row["step"] for row in rows if "extrapolation_ppl_x1" in row] == [0]  # at the start only
    assert not [row for row in rows if "val_loss" in row]
    assert rows[-1] == {"step": 2, "stopped_by": "signal", "signal": "SIGTERM"}

    # resumed with the fault again: a SIGTERM in the redone evaluation stops the run before its next step
    again = run_train(config, tmp_path / "run", ranks=2).stdout
    assert "stopped by SIGTERM at step 2, during its redone evaluation (dropped again" in again
    assert checkpoint_dirs.latest_complete(tmp_path / "run" / checkpoint_dirs.CHECKPOINTS_DIR) == final
    assert not [row for row in metrics(tmp_path / "run") if "val_loss" in row]
    # --resume auto, stopped again in the evaluation of the last step (4), then resumed there once more
    resumed = run_train(stopped_at(4), tmp_path / "run", ranks=2).stdout
    assert ("step 2: due at this step and not in metrics.jsonl: validation, extrapolation; evaluating before the "
            "next step") in resumed
    assert "stopped by SIGTERM at step 4; resume with --resume auto" in resumed
    last = run_train(reference, tmp_path / "run", ranks=2).stdout
    assert "step 4: due at this step and not in metrics.jsonl" in last and "done: completed at step 4/4" in last
    assert "already complete" in run_train(reference, tmp_path / "run").stdout  # nothing left to redo
    run_train(reference, tmp_path / "reference", ranks=2)

    def evaluations(run: Path) -> list[dict]:
        return [row for row in metrics(run) if "val_loss" in row or "extrapolation_ppl_x1" in row]

    redone, uninterrupted = evaluations(tmp_path / "run"), evaluations(tmp_path / "reference")
    assert [row["step"] for row in redone] == [0, 2, 2, 4, 4]  # at the start, then validation, long context
    for row, expected in zip(redone, uninterrupted, strict=True):
        assert row.keys() == expected.keys()
        assert {key: value for key, value in row.items() if key != "extrapolation_seconds"} == {
            key: value for key, value in expected.items() if key != "extrapolation_seconds"}
    assert train_losses(tmp_path / "run") == train_losses(tmp_path / "reference")


def test_missing_books_stop_before_training(training_corpus, tmp_path: Path) -> None:
    mix, cache = training_corpus
    config = write_config(tmp_path / "curve.yml", tiny_train_config(
        mix, cache, extrapolation_eval=curve_settings(tmp_path / "no_books")))
    result = run_train(config, tmp_path / "run", check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and output.count("\n") < 20, output  # one line, no traceback wall
    assert f"train.extrapolation_eval.books {str(tmp_path / 'no_books')!r}" in output
    assert not (tmp_path / "run" / "checkpoints").exists()
