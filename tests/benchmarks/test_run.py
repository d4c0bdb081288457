"""The benchmark command's bookkeeping (no engine is run here)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from benchmarks import run
from benchmarks.run import best_of_rounds, main, paired_summary


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


def test_paired_summary_ratios_each_round_and_quotes_the_median():
    def run(out):
        return {"output_throughput": out, "completed": 32}

    names = ["kiln f32", "llama.cpp f32"]
    rounds = [
        {"order": names, "runs": {"kiln f32": run(200.0), "llama.cpp f32": run(160.0)}},
        {"order": names[::-1], "runs": {"llama.cpp f32": run(200.0), "kiln f32": run(220.0)}},
        {"order": names, "runs": {"kiln f32": {"error": "boom"}, "llama.cpp f32": run(100.0)}},
        {"order": names[::-1], "runs": {"llama.cpp f32": run(100.0), "kiln f32": run(130.0)}},
    ]
    summary = paired_summary(names, rounds)
    assert [r["ratio"] for r in summary["rounds"]] == [1.25, 1.1, None, 1.3]
    assert summary["median_ratio"] == 1.25 and summary["paired_rounds"] == 3
    assert summary["concurrency"] == 16


def test_paired_needs_pairs_of_known_servers():
    for value in ("kiln f32", "kiln f32,llama.cpp f32,shortfin f32", "kiln f32,vllm f32",
                  "kiln f32,llama.cpp f32;kiln q8_0"):
        with pytest.raises(SystemExit):
            main(["--steps", "paired", "--paired", value])


def test_precisions_must_include_float32_and_be_known():
    for value in ("q8_0,q4_1", "f32,fp8"):
        with pytest.raises(SystemExit):
            main(["--steps", "precision", "--precisions", value])


def test_the_precision_step_measures_each_chosen_precision_beside_llama_cpp(tmp_path, monkeypatch):
    built, measured = [], {}
    monkeypatch.setattr(run, "heavy_lock", contextlib.nullcontext)
    monkeypatch.setattr(run.report, "write_all", lambda *args: None)
    monkeypatch.setattr(run.precision_bench, "build",
                        lambda quantize, **changed: built.append((quantize, changed)) or Path(quantize))
    monkeypatch.setattr(run.precision_bench, "measure", lambda artifacts, rounds, llama_cpp: measured.update(
        artifacts=artifacts, rounds=rounds, llama_cpp=llama_cpp) or {"membw": {"read_gb_s": 30.0}, "results": {}})
    output = tmp_path / "results.json"
    assert main(["--steps", "precision", "--precisions", "f32,q4_1", "--precision-rounds", "2",
                 "--engines", "kiln,llama.cpp", "--output", str(output)]) == 0
    assert built == [("none", {}), ("q4_1", {})]  # as `kiln serve` builds them: build's defaults
    assert measured == {"artifacts": {"f32": Path("none"), "q4_1": Path("q4_1")}, "rounds": 2, "llama_cpp": True}
    assert json.loads(output.read_text())["precision"] == {"membw": {"read_gb_s": 30.0}, "results": {}}


def test_main_writes_the_tables_into_benchmarks_readme(tmp_path, monkeypatch):
    written = {}
    monkeypatch.setattr(run, "heavy_lock", contextlib.nullcontext)
    monkeypatch.setattr(run.report, "write_all",
                        lambda results, directory, readme: written.update(directory=directory, readme=readme))
    # 'paired' with Kiln the only engine has no pair to serve: no build, no server.
    output = tmp_path / "results.json"
    assert main(["--steps", "paired", "--engines", "kiln", "--output", str(output)]) == 0
    benchmarks_dir = Path(run.__file__).resolve().parent
    assert written == {"directory": benchmarks_dir / "results", "readme": benchmarks_dir / "README.md"}
    assert json.loads(output.read_text())["machine"]["cpus"]


def test_a_pair_measured_again_replaces_its_figures_and_keeps_the_others(tmp_path, monkeypatch):
    monkeypatch.setattr(run, "heavy_lock", contextlib.nullcontext)
    monkeypatch.setattr(run.report, "write_all", lambda *args: None)
    monkeypatch.setattr(run, "_paired_rounds", lambda names, args: [
        {"order": names, "runs": {name: {"output_throughput": 100.0, "completed": 32} for name in names}}])
    output = tmp_path / "results.json"
    earlier = {"engines": ["kiln q8_0", "llama.cpp q8_0"], "rounds": [], "median_ratio": 1.4, "paired_rounds": 3}
    stale = {"engines": ["kiln f32", "llama.cpp f32"], "rounds": [], "median_ratio": 0.9, "paired_rounds": 3}
    output.write_text(json.dumps({"paired": [earlier, stale]}))
    assert main(["--steps", "paired", "--paired", "kiln f32,llama.cpp f32", "--engines", "kiln,llama.cpp",
                 "--output", str(output)]) == 0
    paired = json.loads(output.read_text())["paired"]
    assert [p["engines"] for p in paired] == [["kiln q8_0", "llama.cpp q8_0"], ["kiln f32", "llama.cpp f32"]]
    assert paired[0]["median_ratio"] == 1.4 and paired[1]["median_ratio"] == 1.0
