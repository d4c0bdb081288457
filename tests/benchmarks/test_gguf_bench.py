"""benchmarks/gguf_bench.py's reading of two engines' greedy tokens (no model needed)."""

from __future__ import annotations

from benchmarks.gguf_bench import compare, median_of_rounds, speed_ratios


def test_the_first_difference_and_kilns_margin_there():
    kiln = {"runs": [
        {"prompt_ids": [2, 5], "tokens": [7, 8, 9], "top2": [[-0.1, -3.0], [-0.5, -0.51], [-0.2, -2.0]]},
        {"prompt_ids": [2, 6], "tokens": [4, 4], "top2": [[-0.1, -2.0], [-0.3, -1.0]]},
    ]}
    rows = compare(kiln, [[7, 1, 9], [4, 4]])
    assert rows[0] | {"kiln": None, "llama.cpp": None} == {
        "prompt_ids": [2, 5], "agree": False, "kiln": None, "llama.cpp": None, "first_difference": 1,
        "kiln_margin_nats": 0.01, "near_tie": True}
    assert rows[1]["agree"] and "first_difference" not in rows[1]


def test_rounds_give_each_engines_medians_and_the_median_speed_ratio():
    rounds = []
    for kiln_ms, kiln_tok, theirs_ms, theirs_tok, rss in ((100.0, 30.0, 200.0, 60.0, 900.0),
                                                         (120.0, 33.0, 180.0, 50.0, 950.0),
                                                         (110.0, 36.0, 220.0, 40.0, 920.0)):
        kiln = {"prefill_bs1_ms": kiln_ms, "decode_bs1_tok_s": kiln_tok, "peak_rss_mib": rss}
        theirs = {"prefill_bs1_ms": theirs_ms, "decode_bs1_tok_s": theirs_tok, "peak_rss_mib": 700.0}
        rounds.append({"kiln": kiln, "llama.cpp": theirs, "speed_ratios": speed_ratios(kiln, theirs)})
    # A time is inverted (Kiln's 100 ms against 200 ms is 2x as fast), a rate is not.
    assert rounds[0]["speed_ratios"] == {"prefill_bs1_ms": 2.0, "decode_bs1_tok_s": 0.5}
    summary = median_of_rounds(rounds)
    assert summary["kiln"] == {"prefill_bs1_ms": 110.0, "decode_bs1_tok_s": 33.0, "peak_rss_mib": 950.0}
    assert summary["llama.cpp"]["decode_bs1_tok_s"] == 50.0
    assert summary["speed_ratios"] == {"prefill_bs1_ms": 2.0, "decode_bs1_tok_s": 0.66}
    assert summary["rounds"] is rounds
