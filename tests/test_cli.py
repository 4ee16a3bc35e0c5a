"""Every command line reports a user error as one line, ``error: MESSAGE``, with no traceback; notices
print once, on rank 0, as console lines; library warnings are dropped only when listed as harmless."""

from __future__ import annotations

import ast
import logging
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from megatron_lite import console
from megatron_lite.cli import EXIT_USER_ERROR
from script_loading import REPO, load_script

BAD_KEY = ["--set", "train.no_such_key=1"]
CONFIG = ["--config", "configs/tiny/rope.yml"]
SCRIPTS = ["train.py", *sorted(f"tools/{path.name}" for path in (REPO / "tools").glob("*.py"))]


def bad_arguments(script: str, tmp_path: Path) -> tuple[list[str], str]:
    """(arguments, what the error names): a bad --set key where the command takes a config, else a path
    that does not exist (a bad value for the benchmark, which reads neither)."""
    missing = str(tmp_path / "missing")
    return {
        "tools/attention_diagnostics.py": ([missing, "--docs", missing, "--out", str(tmp_path / "out")], missing),
        "tools/bench_attention.py": (["--seq-lens", "32", "--hidden-size", "64", "--num-heads", "5"], "must divide"),
        "tools/bench_loss_memory.py": (["--chunk-tokens", "0"], "--chunk-tokens 0"),
        "tools/bench_loss_precision.py": (["--tokens", "0"], "--tokens 0"),
        "tools/profile_step.py": (["--micro-batch", "0"], "--micro-batch 0"),
        "tools/bench_train.py": (["--config", missing, "--no-gpu"], missing),
        "tools/bench_tokenizer.py": (["--text", missing], missing),
        "tools/build_data_bundle.py": (["--books", missing, "--eval-books", missing,
                                        "--out", str(tmp_path / "b.tar.xz")], missing),
        "tools/convert_checkpoint.py": ([missing, str(tmp_path / "out"), "--to", "hf"], missing),
        "tools/eval_long_context.py": (["--checkpoints", missing, "--out", str(tmp_path / "out"),
                                        "--passkey-lengths", "64"], missing),
        "tools/generate.py": ([missing], missing),
        "tools/gemm_table.py": ([missing], missing),
        "tools/gpu_check.py": (["--only", "nonsense", "--out", missing], "nonsense"),
        "tools/fetch_wheels.py": (["--out", str(tmp_path / "wheels"), "--constraints", missing], missing),
        "tools/forecast_break.py": ([missing], missing),
        "tools/reproduce.py": (["--books", missing, "--eval-books", missing, "--out", str(tmp_path / "out")], missing),
    }.get(script, ([*CONFIG, *BAD_KEY], "unknown config key train.no_such_key"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_user_error_is_one_line(script: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    arguments, named = bad_arguments(script, tmp_path)
    assert load_script(script).main(arguments) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and named in err, err


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_runs_through_the_cli_helper(script: str) -> None:
    """main is decorated with @cli_main and the script ends in run_cli(main) (notices, harmless filters)."""
    tree = ast.parse((REPO / script).read_text())
    main = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main")
    assert [ast.unparse(decorator) for decorator in main.decorator_list] == ["cli_main"]
    assert ast.unparse(tree.body[-1]) == "if __name__ == '__main__':\n    run_cli(main)"


def test_run_cli_exits_with_mains_code_and_the_collector_frozen() -> None:
    """The objects torch and DeepSpeed made are left out of the interpreter's final collections (~1 s a process)."""
    import gc

    from megatron_lite.cli import run_cli

    assert gc.get_freeze_count() == 0
    try:
        with pytest.raises(SystemExit) as exited:
            run_cli(lambda: 3)
        assert exited.value.code == 3
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_config_cli_reports_a_bad_key_in_one_line() -> None:
    result = subprocess.run([sys.executable, "-m", "megatron_lite.config", *CONFIG, *BAD_KEY], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == EXIT_USER_ERROR
    assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_train_help_prints_the_whole_description() -> None:
    result = subprocess.run([sys.executable, "train.py", "--help"], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0
    docstring = ast.get_docstring(ast.parse((REPO / "train.py").read_text()))
    assert " ".join(docstring.split()) in " ".join(result.stdout.split())  # every sentence, to its end
    assert result.stdout.rstrip().endswith("--train-iters 100")  # and the example after the options


def _notice_here(message: str) -> None:
    console.notice(message)


def test_notices_print_once_on_rank_zero_and_only_listed_library_warnings_are_dropped(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    deepspeed_logger = logging.getLogger("DeepSpeed")
    filters = list(deepspeed_logger.filters)
    with warnings.catch_warnings():
        console.show_notices()
        try:
            monkeypatch.setenv("RANK", "0")
            _notice_here("resuming with train.lr changed")
            _notice_here("resuming with train.lr changed")  # the same event again: printed once
            monkeypatch.setenv("RANK", "1")
            _notice_here("a notice raised on rank 1")
            warnings.warn_explicit("`torch.distributed.all_gather_into_tensor` is deprecated.", FutureWarning,
                                   "c10d_logger.py", 83, module="torch.distributed.c10d_logger")
            warnings.warn_explicit("`frobnicate` is deprecated, use `twiddle`", FutureWarning, "somelib.py", 7,
                                   module="somelib.core")
            assert not deepspeed_logger.filter(logging.makeLogRecord(
                {"msg": "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."}))
            assert deepspeed_logger.filter(logging.makeLogRecord({"msg": "an unlisted DeepSpeed warning"}))
        finally:
            deepspeed_logger.filters[:] = filters
    out, err = capsys.readouterr()
    assert out == "warning: resuming with train.lr changed\n"  # rank 0 only, in the console's format
    assert "frobnicate" in err and "FutureWarning" in err  # an unlisted library warning still shows, on every rank
    assert "all_gather_into_tensor" not in err and "UserWarning" not in err


@pytest.mark.parametrize("broken", ["config", "mix"])
def test_malformed_yaml_is_one_line_with_file_line_and_column(
    broken: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)
    bad = tmp_path / "broken.yml"
    if broken == "config":
        bad.write_text("model:\n  num_layers: 2\n  hidden_size: [64\ntrain:\n  lr: 1\n")
        arguments, where = ["--config", str(bad)], f"{bad}:4:6: invalid YAML"
    else:
        bad.write_text("groups:\n  text:\n    weight: 0.75\n   sources: {a: 1}\n")
        arguments, where = [*CONFIG, "--set", f"data.mix={bad}"], f"{bad}:4:4: invalid YAML"
    assert load_script("tools/inspect_data.py").main(arguments) == EXIT_USER_ERROR
    err = capsys.readouterr().err  # without a data cache, a "preparing the data first" line comes first
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and where in errors[0] and "Traceback" not in err, err


def test_an_alias_bomb_in_a_config_is_one_short_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Today the error message printed the expanded value: 9**7 leaves here, memory exhausted at 9**9."""
    from test_config import alias_bomb

    monkeypatch.chdir(REPO)
    bomb = tmp_path / "bomb.yml"
    bomb.write_text(alias_bomb(7))
    assert load_script("tools/inspect_data.py").main(["--config", str(bomb)]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err == f"error: {bomb}:1:{alias_bomb(7).index('&l6') + 1}: refused: its aliases expand to more than " \
                  "1,000,000 YAML nodes (an alias bomb?)\n", err[:1000]
