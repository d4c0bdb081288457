"""benchmarks/gguf_bench.py's reading of two engines' greedy tokens (no model needed)."""

from __future__ import annotations

from benchmarks.gguf_bench import compare


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
