"""tools/reproduce.py --profile cpu-tiny (megatron_lite.repro) on a toy budget: tiny books with Gutenberg headers
made in tmp_path, a capped stdlib, a 2-layer model trained 2 steps per scheme, 2 windows and 1 passkey
case; then the resume behaviour (finished models skipped, an unfinished one resumed) and user errors."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import yaml

from megatron_lite import config as config_lib
from megatron_lite import results_board
from megatron_lite.repro import SCHEMES, ReproSettings, run_reproduction
from megatron_lite.repro.settings import load_scheme_configs, validate_settings
from megatron_lite.repro.training import training_status, training_summary
from megatron_lite.training.deepspeed_config import resolve_batch_sizes

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import reproduce  # noqa: E402

WORDS = ("the old ship sailed past green hills while seven sailors sang of rivers stone bridges quiet towns and "
         "the long road home under a blue sky where the grass is green and the sun is yellow").split()
TOY_MODEL = ["model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=2", "model.intermediate_size=64",
             "model.seq_length=32", "model.max_position_embeddings=32", "model.vocab_size=384",
             "data.tokenizer.sample_chars=200000", "data.num_workers=1", "train.train_micro_batch_size_per_gpu=4",
             "train.log_interval=1", "train.eval_interval=0", "train.save_interval=0",
             "train.extrapolation_eval.windows=[1, 2]", "train.extrapolation_eval.scored_tokens_per_book=32"]


def write_books(directory: Path, names: list[str], num_paragraphs: int, seed: int) -> Path:
    """Raw Gutenberg-style books: licence header and footer around seeded prose, CRLF line ends."""
    rng = random.Random(seed)
    directory.mkdir(parents=True)
    for name in names:
        paragraphs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 60))).capitalize() + "."
                      for _ in range(num_paragraphs)]
        text = (f"The Project Gutenberg EBook of {name}\nThis eBook is for the use of anyone anywhere.\n\n"
                f"*** START OF THIS PROJECT GUTENBERG EBOOK {name.upper()} ***\n\n" + "\n\n".join(paragraphs)
                + f"\n\n*** END OF THIS PROJECT GUTENBERG EBOOK {name.upper()} ***\nLICENSE BOILERPLATE\n")
        (directory / f"{name}.txt").write_bytes(text.replace("\n", "\r\n").encode())
    return directory


@pytest.fixture(scope="module")
def toy_books(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("repro_books")
    return (write_books(root / "books", [f"book{i}" for i in range(6)], 40, seed=1),
            write_books(root / "eval_books", ["heldout_a", "heldout_b"], 60, seed=2))


def toy_argv(books: Path, eval_books: Path, out: Path, *extra: str) -> list[str]:
    argv = ["--books", str(books), "--eval-books", str(eval_books), "--out", str(out), "--train-iters", "2",
            "--windows", "32,64", "--max-doc-tokens", "128", "--passkey-lengths", "512", "--passkey-cases", "1",
            "--ntk-factors", "2", "--headline-ntk-factor", "2", "--code-max-documents", "8", "--quiet",
            "--board", str(out.parent / "board.md"), *extra]
    for override in TOY_MODEL:
        argv += ["--set", override]
    return argv


@pytest.mark.slow
def test_toy_reproduction_end_to_end_and_resume(toy_books: tuple[Path, Path], tmp_path: Path) -> None:
    books, eval_books = toy_books
    out = tmp_path / "repro"
    assert reproduce.main(toy_argv(books, eval_books, out)) == 0

    results = json.loads((out / "results.json").read_text())
    assert list(results["training"]) == list(SCHEMES)
    assert all(info["action"] == "trained" and info["steps"] == 2 for info in results["training"].values())
    # every model x scaling x window: ALiBi has no rotary embedding, so no dynamic NTK rows
    cells = {(row["model"], row["scaling"], row["window"]) for row in results["perplexity"]}
    expected = {(s, scaling, w) for s in SCHEMES for scaling in ("none", "dynamic:2") for w in (32, 64)
                if s != "alibi" or scaling == "none"}
    assert cells == expected
    assert all(row["ppl"] > 1 for row in results["perplexity"])
    assert {(row["model"], row["scaling"]) for row in results["passkey"]} == {(s, c) for s, c, _ in expected}
    assert results["eval_documents"] == {"used": 2, "skipped_short": 0}
    mix = yaml.safe_load((out / "data/mix.yml").read_text())
    assert mix["groups"]["text"]["weight"] == 0.75 and mix["groups"]["code"]["weight"] == 0.25
    assert mix["groups"]["text"]["sources"]["gutenberg_books"]["strip_gutenberg"] is True
    manifest = json.loads((out / "data/cache/manifest.json").read_text())
    assert manifest["sources"]["python_stdlib"]["documents"] <= 8
    tables = (out / "tables.md").read_text()
    for heading in ("## Training", "## Table 1", "## Table 2", "## Table 3", "## Extrapolation while training",
                    "## Wall time"):
        assert heading in tables
    assert "| CoCA (slack) + dynamic NTK (x2) |" in tables and "32 (x1)" in tables
    for scheme in SCHEMES:  # the configs' curve: every 50 steps, so before step 1 and at the last step
        curve = results["training"][scheme]["extrapolation_curve"]
        assert [row["step"] for row in curve] == [0, 2] and all(row["extrapolation_ratio_x2"] > 0 for row in curve)
    assert "| tokens seen | ALiBi ppl 1x | ALiBi x2/x1 |" in tables
    for plot in ("perplexity_vs_window.png", "perplexity_ntk_factors.png", "passkey_heatmap.png",
                 "extrapolation_curves.png"):
        assert (out / plot).stat().st_size > 1000
    first_phases = results["wall_seconds"]
    (row,) = results_board.read_rows(tmp_path / "board.md", results_board.REPRODUCTIONS)  # the finished run's row
    assert (row["kind"], row["run"], row["this call"]) == ("full", "reproduce cpu-tiny", "trained 4 of 4 models")
    assert row["length"] == "32" and row["steps"] == "2" and row["tokens/s"] != "–"
    for scheme in SCHEMES:  # windows 32 and 64 of a 32-token model: 1x evaluated, 4x and 32x not
        cell = row[f"{scheme} ppl ×1 / ×4 / ×32"]
        assert cell.endswith(" / – / –") and float(cell.split(" / ")[0].replace(",", "")) > 1, cell
    board_before = (tmp_path / "board.md").read_text()
    assert set(first_phases) == {"data", "report", *(f"{kind} {s}" for s in SCHEMES
                                                     for kind in ("train", "perplexity", "passkey"))}

    # Again: every model is finished, so no training runs, and the evaluation comes from its cache.
    cache_files = sorted((out / "eval").rglob("cache/*/*.json"))
    stamps = [path.stat().st_mtime_ns for path in cache_files]
    log_sizes = [(out / f"logs/train_{s}.log").stat().st_size for s in SCHEMES]
    assert reproduce.main(toy_argv(books, eval_books, out)) == 0
    again = json.loads((out / "results.json").read_text())
    assert all(info["action"] == "skipped (finished)" for info in again["training"].values())
    assert [(out / f"logs/train_{s}.log").stat().st_size for s in SCHEMES] == log_sizes  # train.py never ran
    assert [path.stat().st_mtime_ns for path in cache_files] == stamps
    assert again["perplexity"] == results["perplexity"] and again["passkey"] == results["passkey"]
    history = json.loads((out / "wall_times.json").read_text())
    assert len(history) == 2
    assert again["wall_seconds_all_invocations"]["train rope"] >= first_phases["train rope"]
    # the re-run, which only re-read OUT, adds a row too; the first one is kept
    first, second = results_board.read_rows(tmp_path / "board.md", results_board.REPRODUCTIONS)
    assert second["this call"] == "trained 0 of 4 models (all re-read from OUT)" and first == row
    assert (tmp_path / "board.md").read_text().startswith(board_before)

    # One more step for RoPE only: its final checkpoint is no longer final, so it resumes from step 2.
    settings = reproduce.settings_from_args(reproduce.parse_args(
        toy_argv(books, eval_books, out, "--schemes", "rope", "--train-iters", "3")))
    resumed = run_reproduction(settings)
    assert resumed["training"]["rope"]["action"] == "resumed from step 2"
    assert resumed["training"]["rope"]["steps"] == 3
    assert "resumed from" in (out / "logs/train_rope.log").read_text()
    assert training_status(out / "runs/rope", 3).finished


def test_a_final_checkpoint_whose_step_lacks_an_evaluation_row_is_not_finished(tmp_path: Path) -> None:
    """A stop in the last step's evaluation drops its rows (train.py's resume redoes them): with the run's config,
    such a run is not finished, so the reproduction runs train.py again instead of skipping it."""
    from megatron_lite import checkpoint_dirs

    config = config_lib.with_overrides(config_lib.load("configs/tiny/rope.yml"), [
        "train.eval_interval=4", "train.extrapolation_eval.interval=4", "train.extrapolation_eval.books=unused"])
    step_dir = tmp_path / checkpoint_dirs.CHECKPOINTS_DIR / checkpoint_dirs.step_tag(6)
    step_dir.mkdir(parents=True)
    (step_dir / checkpoint_dirs.COMPLETE_MARKER).write_text(json.dumps({"step": 6, "world_size": 1}))
    rows = [{"step": 6, "loss": 5.0}, {"step": 6, "stopped_by": "signal", "signal": "SIGTERM"}]

    def finished(config_given: bool) -> bool:
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        return training_status(tmp_path, 6, config if config_given else None).finished

    assert finished(config_given=False)  # the step alone: the final checkpoint
    assert not finished(config_given=True)  # the last step is due both evaluations, and has neither row
    rows.append({"step": 6, "val_loss": 4.0, "val_ppl": 54.6})
    assert not finished(config_given=True)
    rows.append({"step": 6, "tokens_seen": 99, "extrapolation_ppl_x1": 60.0})
    assert finished(config_given=True)
    assert not training_status(tmp_path, 8, config).finished  # another run length: not its final step


def test_training_summary_counts_the_tokens_of_every_data_parallel_rank(tmp_path: Path) -> None:
    config = config_lib.load("configs/tiny/rope.yml")
    step_tokens = resolve_batch_sizes(config, 1).tokens_per_step(config.model.seq_length)
    for world_size in (1, 2):
        step_dir = tmp_path / f"ranks{world_size}" / "checkpoints" / "step_00000003"
        step_dir.mkdir(parents=True)
        (step_dir / "COMPLETE").write_text(json.dumps({"step": 3, "world_size": world_size}))
        summary = training_summary(step_dir.parent.parent, config, 3, "skipped (finished)")
        assert summary["steps"] == 3 and summary["tokens"] == 3 * step_tokens * world_size


def test_shipped_configs_differ_only_in_position(toy_books: tuple[Path, Path], tmp_path: Path) -> None:
    books, eval_books = toy_books
    configs = load_scheme_configs(ReproSettings(books=books, eval_books=eval_books, out_dir=tmp_path))
    positions = {scheme: (config.model.position.scheme, config.model.position.constraint)
                 for scheme, config in configs.items()}
    assert positions == {"alibi": ("alibi", "slack"), "rope": ("rope", "slack"), "coca_slack": ("coca", "slack"),
                         "coca_strict": ("coca", "strict")}
    rope = configs["rope"]
    assert rope.model.seq_length == 128 and 8000 <= rope.model.vocab_size <= 16000
    assert rope.data.mix.endswith("data/mix.yml") and str(tmp_path) in rope.data.mix  # pointed at OUT/data


def test_configs_that_differ_beyond_position_are_refused(toy_books: tuple[Path, Path], tmp_path: Path) -> None:
    books, eval_books = toy_books
    config_dir = tmp_path / "configs"
    config_dir.mkdir()
    for scheme in SCHEMES:
        config = config_lib.load(REPO / f"configs/repro/tiny/{scheme}.yml")
        if scheme == "coca_strict":
            config.model.num_layers = 5
        config_lib.save(config, config_dir / f"{scheme}.yml")
    with pytest.raises(ValueError, match="differs .* outside model.position.*model.num_layers"):
        load_scheme_configs(ReproSettings(books=books, eval_books=eval_books, out_dir=tmp_path, config_dir=config_dir))


@pytest.mark.parametrize(("change", "message"), [
    ({"books": Path("/nonexistent/books")}, "--books /nonexistent/books: not a directory"),
    ({"schemes": ["rope", "yarn"]}, "--schemes 'yarn': unknown"),
    ({"train_iters": 0}, "--train-iters 0: must be >= 1"),
    ({"windows": [128, 16384]}, "--windows: 16384 is longer than --max-doc-tokens 8192"),
    ({"ntk_factors": [2.0, 4.0], "headline_ntk_factor": 8.0}, "--headline-ntk-factor 8: must be one of"),
    ({"ntk_factors": [1.0]}, "--ntk-factors 1: a dynamic-NTK factor must be > 1"),
])
def test_user_errors_name_the_flag(toy_books: tuple[Path, Path], tmp_path: Path, change: dict, message: str) -> None:
    books, eval_books = toy_books
    settings = ReproSettings(books=books, eval_books=eval_books, out_dir=tmp_path)
    for key, value in change.items():
        setattr(settings, key, value)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        validate_settings(settings)


def test_evaluation_books_must_be_held_out(toy_books: tuple[Path, Path], tmp_path: Path) -> None:
    books, _ = toy_books
    leaked = tmp_path / "leaked"
    leaked.mkdir()
    (leaked / "copy.txt").write_bytes((books / "book3.txt").read_bytes())
    with pytest.raises(ValueError, match=r"--eval-books .*1 book\(s\) are also in --books .*copy.txt = book3.txt"):
        validate_settings(ReproSettings(books=books, eval_books=leaked, out_dir=tmp_path))
    assert reproduce.main(toy_argv(books, leaked, tmp_path / "out")) == 2


def test_documented_command_parses_to_the_documented_defaults() -> None:
    import shlex

    doc = (REPO / "docs/reproduction.md").read_text()
    command = next(line for line in doc.splitlines() if line.startswith("python tools/reproduce.py --profile cpu-tiny"))
    settings = reproduce.settings_from_args(reproduce.parse_args(shlex.split(command)[2:]))
    assert settings.schemes == list(SCHEMES) and settings.windows == [128, 256, 512, 1024, 2048, 4096]
    assert settings.passkey_lengths == [128, 256, 512, 1024, 2048] and settings.passkey_cases == 100
    assert settings.ntk_factors == [2.0, 4.0, 8.0] and settings.threads == 1
