"""Attention diagnostics (megatron_lite/eval/diagnostics.py, tools/attention_diagnostics.py): known angles
and anomalous fractions on a hand-set layer, CoCA strict's collinearity, zero pairs excluded and counted,
the exact angle decomposition of every rotary scheme's score, captured probabilities reproducing the
layer's own output, and the tool end to end on tiny saved checkpoints."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from megatron_lite.config import AttentionConfig, RopeScalingConfig
from megatron_lite.eval import diagnostics
from megatron_lite.model import build_model
from megatron_lite.model.context import build_context
from megatron_lite.model.gqa import repeat_kv
from megatron_lite.model.position import CoCASlack, CoCAStrict, RoPE
from megatron_lite.model.rope import RotaryEmbedding
from megatron_lite.weights import save_consolidated
from script_loading import load_script
import test_eval_support
from test_eval_support import make_tokenizer, tiny_eval_config, write_books

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
single_thread = test_eval_support.single_thread  # autouse: tiny models run fastest on one thread
ROW_KEYS = {"layer", "head", "length", "anomalous_fraction", "entropy", "sink_mass", "mass_by_distance",
            "theta_above_pi_fraction", "tau_median", "pairs_counted", "pairs_zero_excluded", "theta_histogram"}


def hand_set_layer(length: int = 8):
    """One head, head dim 4 (rotary pairs (0, 2) and (1, 3), theta = 1 and 0.01 rad), the same q and k at
    every position: pair 0 q = (1, 0), k = (0, 1): Theta = 3 pi / 2; pair 1 q = (0, 1), k = (1, 0): pi / 2."""
    scheme = RoPE(RotaryEmbedding(4, 10000.0, RopeScalingConfig(), length))
    ctx = build_context(scheme, AttentionConfig(), torch.zeros(1, length, dtype=torch.long))
    q_BHTD, k_BKTD = torch.zeros(1, 1, length, 4), torch.zeros(1, 1, length, 4)
    q_BHTD[..., 0], q_BHTD[..., 3] = 1.0, 1.0
    k_BKTD[..., 2], k_BKTD[..., 1] = 1.0, 1.0
    return scheme, ctx, q_BHTD, k_BKTD


def test_hand_set_layer_gives_the_known_angles_and_anomalous_fraction() -> None:
    scheme, ctx, q_BHTD, k_BKTD = hand_set_layer()
    q_pairs = diagnostics.unrotated_pairs(scheme, q_BHTD.double(), ctx.tables, query=True)
    k_pairs = diagnostics.unrotated_pairs(scheme, k_BKTD.double(), ctx.tables, query=False)
    theta = diagnostics.initial_angles(diagnostics.pair_polar(*q_pairs)[0], diagnostics.pair_polar(*k_pairs)[0])
    assert torch.allclose(theta[0, 0], torch.tensor([3 * math.pi / 2, math.pi / 2], dtype=torch.float64).expand(8, 2))

    # 36 visible (m, n) per pair (m = 0..7, n <= m). Pair 0: tau = (2 pi - 3 pi / 2) / 1 = pi / 2, so the
    # anomalous triples are m - n in {0, 1}: 8 + 7 = 15. Pair 1 (Theta < pi) is never anomalous.
    stats = diagnostics.angle_statistics(q_BHTD, k_BKTD, scheme, ctx, torch.arange(8))
    assert (stats.counted_H.item(), stats.above_pi_H.item(), stats.anomalous_H.item()) == (72, 36, 15)
    assert stats.zero_excluded_H.item() == 0
    assert stats.theta_hist_HA[0, 27].item() == stats.theta_hist_HA[0, 9].item() == 36  # 270 and 90 degrees
    assert diagnostics.tau_median(stats.tau_hist_HT[0]) == pytest.approx(math.pi / 2, rel=0.05)

    row = diagnostics.head_row(diagnostics.layer_statistics(q_BHTD, k_BKTD, scheme, ctx, torch.arange(8), 0.5),
                               layer=0, head=0, length=8)
    assert row["anomalous_fraction"] == pytest.approx(15 / 72) and row["theta_above_pi_fraction"] == 0.5
    assert row["anomalous_fraction_weighted"] == pytest.approx(15 / 72)  # every |q_j||k_j| is 1


def test_zero_vectors_are_excluded_and_counted() -> None:
    scheme, ctx, q_BHTD, k_BKTD = hand_set_layer()
    k_BKTD[:, :, :4, 1] = 0.0  # pair 1 of the keys at positions 0..3 is the zero vector
    q_BHTD[:, :, 7, 0] = 0.0  # pair 0 of the query at position 7 too
    stats = diagnostics.angle_statistics(q_BHTD, k_BKTD, scheme, ctx, torch.arange(8))
    zero_keys = sum(min(m + 1, 4) for m in range(8))  # 26 visible (m, n) with a zero key pair 1
    assert stats.zero_excluded_H.item() == zero_keys + 8  # + row 7's 8 keys in pair 0
    assert stats.counted_H.item() == 72 - zero_keys - 8
    assert stats.anomalous_H.item() == 15 - 2  # row 7 lost its distances 0 and 1 in pair 0


@pytest.mark.parametrize("scheme_class", [RoPE, CoCASlack, CoCAStrict])
def test_the_angles_decompose_each_rotary_score_exactly(scheme_class: type) -> None:
    """sum_j |q_j| |k_j| cos(Theta_j + (m - n) theta_j) is the kernel's q'_m . k'_n: the vectors the
    diagnostics measure are the ones the model dots (for slack: q = R_m^-1 (q * R_m q), k = t)."""
    length, head_dim = 6, 8
    rotary = RotaryEmbedding(head_dim, 100.0, RopeScalingConfig(), length)
    scheme = scheme_class(rotary)
    tables = rotary.tables(torch.arange(length), length, torch.float64)
    q_BHTD, k_BHTD = torch.randn(1, 2, length, head_dim, dtype=torch.float64), torch.randn(1, 2, length, head_dim,
                                                                                          dtype=torch.float64)
    scores = scheme.transform_query(q_BHTD, tables) @ scheme.transform_key(k_BHTD, tables).transpose(-1, -2)
    q_angle, q_norm = diagnostics.pair_polar(*diagnostics.unrotated_pairs(scheme, q_BHTD, tables, query=True))
    k_angle, k_norm = diagnostics.pair_polar(*diagnostics.unrotated_pairs(scheme, k_BHTD, tables, query=False))
    theta = diagnostics.initial_angles(q_angle[:, :, :, None], k_angle[:, :, None])  # (B, H, T, S, P)
    distance = (torch.arange(length)[:, None] - torch.arange(length)[None, :]).double()
    inv_freq = rotary.inv_freq(length)[0]
    rebuilt = (q_norm[:, :, :, None] * k_norm[:, :, None] * torch.cos(theta + distance[..., None] * inv_freq)).sum(-1)
    assert torch.allclose(rebuilt, scores, atol=1e-10)


def test_coca_strict_keys_are_collinear_with_their_queries() -> None:
    model = build_model(tiny_config("coca", "strict")).eval()
    captured: list = []
    with torch.no_grad(), diagnostics.capture_attention(model, lambda *args: captured.append(args)):
        model(torch.randint(0, 250, (1, 24)))
    assert len(captured) == 2
    for _, _, q_BHTD, k_BKTD, _, scheme, ctx, _ in captured:
        tables = scheme.rotary.tables(ctx.positions, ctx.rope_length, torch.float64)
        q_angle, q_norm = diagnostics.pair_polar(*diagnostics.unrotated_pairs(scheme, q_BHTD.double(), tables, True))
        k_angle, k_norm = diagnostics.pair_polar(*diagnostics.unrotated_pairs(scheme, k_BKTD.double(), tables, False))
        theta = diagnostics.initial_angles(q_angle[:, :, :, None], k_angle[:, :, None])
        nonzero = (q_norm[:, :, :, None] > 0) & (k_norm[:, :, None] > 0)
        assert nonzero.any() and (theta[nonzero] == 0).all()
        stats = diagnostics.angle_statistics(q_BHTD, k_BKTD, scheme, ctx, torch.arange(24))
        assert stats.above_pi_H.sum() == 0 and stats.anomalous_H.sum() == 0
        assert stats.zero_excluded_H.sum() > 0  # relu(t) zeroes some coefficients: left out, and counted
        assert (stats.counted_H + stats.zero_excluded_H == 24 * 25 // 2 * 8).all()  # visible (m, n) x 8 pairs


@pytest.mark.parametrize(("scheme", "overrides"), [("rope", {}), ("coca", {}), ("alibi", {}),
                                                   ("coca", {"architecture": "llama", "num_key_value_heads": 2,
                                                             "intermediate_size": 96})],
                         ids=["rope", "coca_slack", "alibi", "llama_gqa_coca"])
def test_probabilities_reproduce_the_layer_output_and_mass_rows_sum_to_one(scheme: str, overrides: dict) -> None:
    model = build_model(tiny_config(scheme, **overrides)).eval()
    captured: list = []
    with torch.no_grad(), diagnostics.capture_attention(model, lambda *args: captured.append(args)):
        model(torch.randint(0, 250, (2, 40)))
    assert [entry[0] for entry in captured] == [0, 1] and not any("attend" in vars(m) for m in model.modules())
    rows_R = diagnostics.sample_query_rows(40, 8)
    for _, kernel, q_BHTD, k_BKTD, v_BKTD, position, ctx, out_BHTD in captured:
        probs_BHRT = diagnostics.attention_probabilities(q_BHTD, k_BKTD, position, ctx, rows_R, kernel.scale)
        expected_BHRD = out_BHTD[:, :, rows_R]
        assert torch.allclose(probs_BHRT @ repeat_kv(v_BKTD, q_BHTD.shape[1]), expected_BHRD, atol=1e-5)
        mass = diagnostics.distance_mass(probs_BHRT, rows_R, diagnostics.num_distance_bins(40))
        assert mass.shape[-1] == 7 and torch.allclose(mass.sum(-1), torch.ones(mass.shape[:-1]), atol=1e-5)
        stats = diagnostics.layer_statistics(q_BHTD, k_BKTD, position, ctx, rows_R, kernel.scale, rows_per_block=3)
        assert stats.num_rows == 2 * rows_R.numel() and (stats.angles is None) == (scheme == "alibi")
        assert torch.allclose(stats.mass_HB.sum(-1), torch.full((4,), float(stats.num_rows), dtype=torch.float64))
        assert ((stats.entropy_H >= 0) & (stats.entropy_H / stats.num_rows <= math.log(40))).all()


def test_query_rows_and_distance_bins() -> None:
    rows = diagnostics.sample_query_rows(4096, 64)
    assert rows.numel() <= 64 and rows[-1] == 4095 and rows[0] >= 1 and (rows[1:] > rows[:-1]).all()
    assert (rows >= 3072).sum() >= 48 and rows[0] < 1024  # mostly long contexts, plus spread
    assert diagnostics.sample_query_rows(10, 64).tolist() == list(range(1, 10))
    distances = torch.tensor([0, 1, 2, 3, 4, 7, 8, 4095])
    assert diagnostics.distance_bins(distances, 13).tolist() == [0, 1, 2, 2, 3, 3, 4, 12]
    assert diagnostics.distance_bin_edges(6) == [[0, 0], [1, 1], [2, 3], [4, 5]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Untrained tiny checkpoints (the tool's plumbing, not the numbers, is under test) and books."""
    root = tmp_path_factory.mktemp("diagnostics")
    tokenizer = make_tokenizer(root)
    found = {"books": write_books(root / "books", [60, 70])}
    for name, scheme, constraint in (("rope", "rope", "slack"), ("alibi", "alibi", "slack")):
        config = tiny_eval_config(scheme, constraint, vocab_size=tokenizer.vocab_size)
        found[name] = save_consolidated(build_model(config).state_dict(), config, root / name, tokenizer.path)
    return found


def test_tool_writes_rows_and_plots(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    tool = load_script("tools/attention_diagnostics.py")
    out = tmp_path / "rope"
    assert tool.main([str(checkpoints["rope"]), "--docs", str(checkpoints["books"]), "--strip-gutenberg",
                      "--out", str(out), "--max-length", "128", "--queries", "6", "--max-docs", "2", "--quiet"]) == 0
    result = json.loads((out / "diagnostics.json").read_text())
    assert result["lengths"] == [32, 64, 128] and result["documents"]["used"] == 2  # 32 x 1, 2, 4 up to 128
    rows = result["rows"]
    assert [(r["length"], r["layer"], r["head"]) for r in rows] == \
        [(n, layer, head) for n in (32, 64, 128) for layer in range(2) for head in range(4)]
    for row in rows:
        assert set(row) >= ROW_KEYS and row["queries"] == 2 * 6
        assert 0 <= row["anomalous_fraction"] <= row["theta_above_pi_fraction"] <= 1
        assert sum(row["mass_by_distance"]) == pytest.approx(1.0, abs=1e-6)
        assert len(row["mass_by_distance"]) == len(result["distance_bins"][str(row["length"])])
        assert 0 <= row["sink_mass"] <= 1 and row["entropy"] >= 0
    for name in ("diagnostics.json", "anomalous_fraction_heatmap.png", "attention_mass_vs_distance.png",
                 "theta_histogram.png"):
        assert (out / name).is_file()
    assert (out / "anomalous_fraction_heatmap.png").read_bytes()[:8] == PNG_MAGIC

    out = tmp_path / "alibi"  # no rotary pairs: angle fields null, mass/entropy/sink still there
    assert tool.main([str(checkpoints["alibi"]), "--docs", str(checkpoints["books"]), "--out", str(out),
                      "--lengths", "16,48", "--queries", "4", "--quiet"]) == 0
    result = json.loads((out / "diagnostics.json").read_text())
    assert {r["length"] for r in result["rows"]} == {16, 48}
    assert all(r["anomalous_fraction"] is None and r["theta_histogram"] is None and r["sink_mass"] > 0
               for r in result["rows"])
    assert (out / "attention_mass_vs_distance.png").is_file() and not (out / "anomalous_fraction_heatmap.png").exists()


@pytest.mark.parametrize(("extra", "named"), [(["--queries", "0"], "--queries 0"),
                                              (["--lengths", "64,256", "--max-length", "128"], "--lengths 256"),
                                              (["--lengths", "64,x"], "--lengths"),
                                              (["--max-length", "16"], "--max-length 16")])
def test_bad_flags_are_one_line_errors(checkpoints: dict[str, Path], tmp_path: Path, extra: list[str], named: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    tool = load_script("tools/attention_diagnostics.py")
    assert tool.main([str(checkpoints["rope"]), "--docs", str(checkpoints["books"]), "--out", str(tmp_path),
                      "--quiet", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and named in err, err


def test_missing_documents_name_the_docs_flag(checkpoints: dict[str, Path], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    tool = load_script("tools/attention_diagnostics.py")
    missing = str(tmp_path / "nothing_here")
    assert tool.main([str(checkpoints["rope"]), "--docs", missing, "--out", str(tmp_path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --docs") and missing in err, err
