"""benchmarks/gguf_serving.py's summary of paired serving rounds (no server needed)."""

from __future__ import annotations

from benchmarks.gguf_serving import medians


def run(throughput: float, ttft: float) -> dict:
    return {"output_throughput": throughput, "p50_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft, "p50_itl_ms": 50.0,
            "p99_itl_ms": 90.0, "completed": 32}


def test_each_engines_medians_leave_out_a_failed_run():
    rounds = [{"runs": {"kiln": run(100.0, 300.0), "llama.cpp": run(80.0, 200.0)}},
              {"runs": {"kiln": run(120.0, 320.0), "llama.cpp": {"error": "Traceback ..."}}},
              {"runs": {"kiln": run(110.0, 310.0), "llama.cpp": run(90.0, 220.0)}}]
    assert medians(rounds, "kiln") == {"output_throughput": 110.0, "p50_ttft_ms": 310.0, "p99_ttft_ms": 620.0,
                                       "p50_itl_ms": 50.0, "p99_itl_ms": 90.0, "completed": 32}
    assert medians(rounds, "llama.cpp")["output_throughput"] == 85.0
    assert medians([{"runs": {"kiln": {"error": "x"}}}], "kiln") == {}
