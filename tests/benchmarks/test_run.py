"""The benchmark command's bookkeeping (no engine is run here)."""

from __future__ import annotations

from benchmarks.run import best_of_rounds


def test_best_of_rounds_keeps_each_figures_best_round():
    rounds = [
        {"engine": "kiln", "dtype": "f32", "decode_bs1_tok_s": 60.0, "prefill_512_ms": 480.0, "seconds": 20.0},
        {"engine": "kiln", "dtype": "f32", "decode_bs1_tok_s": 66.0, "prefill_512_ms": 500.0, "seconds": 21.0},
    ]
    row = best_of_rounds(rounds)
    assert row["decode_bs1_tok_s"] == 66.0 and row["prefill_512_ms"] == 480.0
    assert row["rounds"] == 2 and row["engine"] == "kiln"
    assert [r["decode_bs1_tok_s"] for r in row["round_figures"]] == [60.0, 66.0]


def test_best_of_rounds_skips_failed_rounds():
    failed = {"engine": "kiln", "dtype": "f32", "error": "boom"}
    ok = {"engine": "kiln", "dtype": "f32", "decode_bs1_tok_s": 50.0}
    assert best_of_rounds([failed, ok])["decode_bs1_tok_s"] == 50.0
    assert best_of_rounds([failed]) is failed
