"""tools/eval_long_context.py end to end on tiny trained checkpoints: results, tables and plots,
determinism under a seed, resume from cached windows, backend choice, out-of-memory advice and
flag errors (acceptance item 3)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from megatron_lite import config as config_lib
from megatron_lite.eval import long_context
from megatron_lite.eval.long_context import AttentionChoice, choose_attention, with_attention
from megatron_lite.eval.perplexity import sliding_window_perplexity
from megatron_lite.weights import load_model, save_consolidated
from test_eval_support import make_checkpoint, make_tokenizer, single_thread, write_books  # noqa: F401 (fixture)
from script_loading import load_script

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("long_context")
    tokenizer = make_tokenizer(root)
    return {"rope": make_checkpoint(root / "rope", tokenizer, "rope"),
            "alibi": make_checkpoint(root / "alibi", tokenizer, "alibi"),
            "books": write_books(root / "books", [40, 3, 45])}


def tool_args(workspace: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return ["--checkpoints", str(workspace["rope"]), f"alibi_model={workspace['alibi']}", "--out", str(out),
            "--ppl-docs", str(workspace["books"]), "--strip-gutenberg", "--windows", "32,64,128", "--stride", "32",
            "--max-doc-tokens", "128", "--passkey-lengths", "210,260", "--passkey-cases", "4",
            "--scaling", "none,dynamic:2", "--seed", "5", "--batch-size", "3", "--quiet", *extra]


def test_tool_writes_results_tables_and_plots_reproducibly(workspace: dict[str, Path], tmp_path: Path) -> None:
    tool = load_script("tools/eval_long_context.py")
    assert tool.main(tool_args(workspace, tmp_path / "a")) == 0
    assert tool.main(tool_args(workspace, tmp_path / "b")) == 0
    first = json.loads((tmp_path / "a" / "results.json").read_text())
    second = json.loads((tmp_path / "b" / "results.json").read_text())
    assert first["perplexity"] == second["perplexity"] and first["passkey"] == second["passkey"]
    for name in ("tables.md", "passkey_cases.json"):
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text()
    for name in ("perplexity_vs_window.png", "passkey_heatmap.png"):
        assert (tmp_path / "a" / name).read_bytes()[:8] == PNG_MAGIC

    # rope: 2 scalings x 3 windows; alibi: no rotary embedding, so only "none"
    keys = [(row["model"], row["scaling"], row["window"]) for row in first["perplexity"]]
    assert keys == [("rope", s, w) for s in ("none", "dynamic:2") for w in (32, 64, 128)] + \
        [("alibi_model", "none", w) for w in (32, 64, 128)]
    for row in first["perplexity"]:
        assert set(row) >= {"model", "scaling", "window", "ppl", "tokens"}
        assert row["tokens"] == 2 * 127 and row["documents_skipped"] == 1 and math.isfinite(row["ppl"])
    by_key = {(r["model"], r["scaling"], r["window"]): r["ppl"] for r in first["perplexity"]}
    assert by_key[("rope", "none", 32)] == by_key[("rope", "dynamic:2", 32)]  # window = training length
    assert by_key[("rope", "none", 128)] != by_key[("rope", "dynamic:2", 128)]
    assert [(r["model"], r["scaling"], r["length"], r["cases"]) for r in first["passkey"]] == \
        [("rope", s, n, 4) for s in ("none", "dynamic:2") for n in (210, 260)] + \
        [("alibi_model", "none", n, 4) for n in (210, 260)]
    for row in first["passkey"]:
        assert 0 <= row["accuracy"] <= 1 and row["cases_inside"] + row["cases_outside"] == 4
    assert first["models"]["rope"]["train_length"] == 32 and first["models"]["alibi_model"]["scheme"] == "alibi"

    tables = (tmp_path / "a" / "tables.md").read_text()
    assert "| model | scheme | train length | scaling | 32 | 64 | 128 |" in tables
    assert "| model | scheme | train length | scaling | 210 | 260 |" in tables
    assert f"| rope | rope | 32 | dynamic:2 | {by_key[('rope', 'dynamic:2', 32)]:.2f} |" in tables
    assert json.loads((tmp_path / "a" / "run_info.json").read_text())["peak_rss_mib"] > 0


def test_interrupted_runs_resume_from_cached_windows(workspace: dict[str, Path], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    tool = load_script("tools/eval_long_context.py")
    args = tool_args(workspace, tmp_path / "out")
    assert tool.main(args) == 0
    expected = json.loads((tmp_path / "out" / "results.json").read_text())

    calls: list[int] = []
    real = long_context.sliding_window_perplexity

    def counting(model, documents, window, *rest):  # type: ignore[no-untyped-def]
        calls.append(window)
        return real(model, documents, window, *rest)

    def no_passkey(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("passkey results are cached")

    monkeypatch.setattr(long_context, "sliding_window_perplexity", counting)
    monkeypatch.setattr(long_context, "run_passkey", no_passkey)
    (tmp_path / "out" / "cache" / "ppl" / "rope__dynamic-2__64.json").unlink()  # as if killed before this window
    (tmp_path / "out" / "results.json").unlink()
    assert tool.main(args) == 0
    assert calls == [64]
    assert json.loads((tmp_path / "out" / "results.json").read_text())["perplexity"] == expected["perplexity"]

    calls.clear()  # a different stride changes the numbers: cached windows are not reused
    settings = tool.settings_from_args(tool.parse_args(args))
    settings.stride, settings.passkey_lengths, settings.progress = 16, [], False
    long_context.run_long_context_eval(settings)
    assert sorted(calls) == [32] * 3 + [64] * 3 + [128] * 3


def test_attention_backend_choice(workspace: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    alibi, rope = load_model(workspace["alibi"]), load_model(workspace["rope"])
    assert choose_attention(alibi.config, "auto", 512, "cpu").backend == "chunked"
    assert choose_attention(rope.config, "auto", 512, "cpu").backend == "sdpa"
    assert choose_attention(rope.config, "chunked", 8, "cpu") == AttentionChoice("chunked", 8, "--attention-backend")
    chunked = with_attention(alibi, AttentionChoice("chunked", 8, "test"))
    assert chunked.layers[0].attention.backend == "chunked" and chunked.layers[0].attention.chunk_size == 8
    documents = [torch.randint(0, 300, (100,), generator=torch.Generator().manual_seed(1))]
    plain = sliding_window_perplexity(load_model(workspace["alibi"]).model, documents, 64, 16)
    blocked = sliding_window_perplexity(chunked, documents, 64, 16)
    assert math.isclose(plain.perplexity, blocked.perplexity, rel_tol=1e-5)

    tool = load_script("tools/eval_long_context.py")
    out = workspace["books"].parent / "backend_out"
    assert tool.main(["--checkpoints", str(workspace["alibi"]), "--out", str(out), "--passkey-lengths", "210",
                      "--passkey-cases", "1", "--chunk-size", "64"]) == 0
    assert "attention backend chunked, chunk size 64" in capsys.readouterr().err


def test_config_overrides_reach_every_checkpoint(workspace: dict[str, Path], tmp_path: Path) -> None:
    tool = load_script("tools/eval_long_context.py")
    assert tool.main(["--checkpoints", str(workspace["rope"]), "--out", str(tmp_path), "--passkey-lengths", "210",
                      "--passkey-cases", "1", "--set", "model.position.scheme=coca", "--quiet"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["models"]["rope"]["scheme"] == "coca slack" and results["settings"]["overrides"] == [
        "model.position.scheme=coca"]


@pytest.mark.parametrize("model,advice", [("rope", "--attention-backend chunked"), ("alibi", "--chunk-size")])
def test_out_of_memory_names_the_flag_to_change(workspace: dict[str, Path], tmp_path: Path, model: str, advice: str,
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    def out_of_memory(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 68719476736 bytes")

    monkeypatch.setattr(long_context, "sliding_window_perplexity", out_of_memory)
    tool = load_script("tools/eval_long_context.py")
    code = tool.main(["--checkpoints", str(workspace[model]), "--out", str(tmp_path), "--ppl-docs",
                      str(workspace["books"]), "--windows", "64", "--stride", "32", "--max-doc-tokens", "128",
                      "--batch-size", "2", "--quiet"])
    error = capsys.readouterr().err
    assert code == 1 and "out of memory evaluating" in error and advice in error and "--batch-size" in error


@pytest.mark.parametrize("extra,flag", [
    (["--stride", "64", "--windows", "32,64"], "--stride"),
    (["--windows", "32,256"], "--max-doc-tokens"),
    (["--scaling", "none,dynamc:2"], "--scaling"),
    (["--scaling", "linear:0.5"], "--scaling"),
    (["--windows", "32,x"], "--windows"),
    (["--passkey-lengths", "100"], "--passkey-lengths"),
    (["--set", "model.hiden_size=3"], "model.hiden_size"),
])
def test_flag_errors(workspace: dict[str, Path], tmp_path: Path, extra: list[str], flag: str,
                     capsys: pytest.CaptureFixture[str]) -> None:
    tool = load_script("tools/eval_long_context.py")
    base = ["--checkpoints", str(workspace["rope"]), "--out", str(tmp_path), "--ppl-docs", str(workspace["books"]),
            "--windows", "32", "--stride", "32", "--max-doc-tokens", "128", "--quiet"]
    assert tool.main(base + extra) == 2
    assert flag in capsys.readouterr().err


def test_a_flash_trained_checkpoint_loads_on_cpu_with_sdpa(workspace: dict[str, Path], tmp_path: Path) -> None:
    """The kernel is a run-time choice: weights saved by a flash-attn run must evaluate without flash-attn."""
    rope = load_model(workspace["rope"])
    flash_config = config_lib.with_overrides(rope.config, ["model.attention.backend=flash", "precision=bf16"])
    flash_dir = save_consolidated(rope.model.state_dict(), flash_config, tmp_path / "flash", rope.tokenizer_path)
    with pytest.warns(UserWarning, match=r"saved with model.attention.backend=flash.*cpu.*using sdpa"):
        loaded = load_model(flash_dir, "cpu")
    assert loaded.config.model.attention.backend == "sdpa"
    tokens = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded.model(tokens), rope.model(tokens))
    chunked = load_model(flash_dir, "cpu", overrides=["model.attention.backend=chunked"])  # an explicit choice wins
    assert chunked.config.model.attention.backend == "chunked"
