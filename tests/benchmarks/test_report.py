"""The benchmark report: tables, target ratios and the README block, from a synthetic run."""

from __future__ import annotations

from pathlib import Path

from benchmarks import membw, report


def serving(concurrency=None, rate=None, out=100.0, ttft=200.0):
    return {"max_concurrency": concurrency, "request_rate": rate, "output_throughput": out,
            "request_throughput": out / 128, "p50_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft,
            "p50_tpot_ms": 20.0, "p50_itl_ms": 20.0, "p99_itl_ms": 40.0, "failed": 0, "mean_ttft_ms": ttft,
            "completed": 8}


RESULTS = {
    "date": "2026-11-22T08:00:00", "machine": {"cpus": 2}, "model": "SmolLM2",
    "membw": {"threads": 2, "read_gb_s": 40.0},
    "floor": {"f32": membw.decode_floor(540_000_000, 40.0)},
    "offline": [
        {"engine": "kiln", "dtype": "f32", "decode_bs1_tok_s": 60.0, "decode_bs8_tok_s": 200.0,
         "prefill_128_ms": 100.0, "prefill_512_ms": 500.0},
        {"engine": "kiln", "dtype": "f16", "decode_bs1_tok_s": 85.0, "decode_bs8_tok_s": 250.0,
         "prefill_128_ms": 150.0, "prefill_512_ms": 700.0},
        {"engine": "llama.cpp", "dtype": "f32", "decode_bs1_tok_s": 50.0, "decode_bs8_tok_s": 150.0,
         "prefill_128_ms": 90.0, "prefill_512_ms": 400.0},
        {"engine": "transformers", "dtype": "f32", "decode_bs1_tok_s": 20.0, "decode_bs8_tok_s": 80.0,
         "prefill_128_ms": 200.0, "prefill_512_ms": 900.0},
        {"engine": "shortfin", "dtype": "f32", "error": "Traceback ..."},
    ],
    "serving": {
        "kiln f32": [serving(1, out=50), serving(16, out=300, ttft=300), serving(rate=1.0, ttft=150)],
        "llama.cpp f32": [serving(16, out=200, ttft=400)],
        "shortfin f32": [{"error": "Traceback ..."}, {**serving(16, out=0.0), "completed": 0}],  # cut short
    },
    "prefix": {"trie": serving(4, ttft=100), "none": serving(4, ttft=450)},
}


def test_targets_are_ratios_of_one_run():
    targets = {name: (measured, met) for name, measured, met in report.targets(RESULTS)}
    assert targets["decode bs1: kiln f32 ≥ 1.0x llama.cpp f32"] == ("1.20x", True)
    assert targets["decode bs1: kiln f16 ≥ 1.8x llama.cpp f32"] == ("1.70x", False)
    assert targets["prefill 512: kiln f32 ≤ torch eager (transformers f32)"] == ("500 vs 900 ms", True)
    assert targets["serving c=16: kiln out tok/s ≥ 1.2x llama.cpp f32"] == ("1.50x", True)
    assert targets["serving c=16: kiln TTFT p50 below llama.cpp f32"] == ("300 vs 400 ms", True)
    assert targets["shared prefix: TTFT ≥ 3x better with the trie"] == ("4.50x", True)
    assert not any("shortfin" in name for name in targets)  # its run failed: no ratio invented


def test_tables_show_failures_and_the_floor():
    text = report.tables(RESULTS)
    assert "| kiln f32 | 60.0 | 200.0 | 100 | 500 |" in text
    assert "memory-bandwidth floor, f32 weights | 74.1" in text
    assert "| shortfin f32 | – | failed: see results JSON |" in text
    assert "shortfin f32 | error" not in text


def test_readme_block_is_replaced_in_place(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{report.BEGIN}\nold\n{report.END}\n\n## after\n")
    report.update_readme(readme, "new table")
    assert readme.read_text() == f"# x\n\n{report.BEGIN}\nnew table\n{report.END}\n\n## after\n"


def test_readme_without_markers_gets_a_results_section(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# Benchmarks\n")
    report.update_readme(readme, "table")
    assert readme.read_text() == f"# Benchmarks\n\n## Results\n\n{report.BEGIN}\ntable\n{report.END}\n"


def test_tables_live_in_benchmarks_readme():
    benchmarks_dir = Path(report.__file__).resolve().parent
    assert report.README == benchmarks_dir / "README.md"
    text = report.README.read_text()
    assert text.count(report.BEGIN) == 1 and text.count(report.END) == 1
    assert text.index(report.BEGIN) < text.index(report.END)
    # The top-level README keeps a summary only: no block for a run to rewrite.
    assert report.BEGIN not in (benchmarks_dir.parent / "README.md").read_text()


def test_plot_links_are_relative_to_the_page(tmp_path):
    page = tmp_path / "benchmarks" / "README.md"
    page.parent.mkdir()
    page.write_text(f"# Benchmarks\n\n{report.BEGIN}\nold\n{report.END}\n")
    report.write_all(RESULTS, page.parent / "results", page)
    text = page.read_text()
    assert "| kiln f32 | 60.0 | 200.0 | 100 | 500 |" in text and "old" not in text
    assert f"![serving-throughput](results/{report.PLOTS['throughput']})" in text
    assert f"![serving-ttft](results/{report.PLOTS['ttft']})" in text


def test_plots_are_written(tmp_path):
    written = report.plot(RESULTS, tmp_path)
    assert [p.name for p in written] == [report.PLOTS["throughput"], report.PLOTS["ttft"]]
    assert all(p.stat().st_size > 1000 and p.read_bytes()[:4] == b"\x89PNG" for p in written)


def test_runtimes_table_shows_each_runtime_and_its_failure():
    runs = {"kiln": {"ok": False, "iree_runtime": "3.13.0", "error": "bytecode version mismatch"},
            "kiln_iree39": {"ok": True, "iree_runtime": "3.9.0", "completion_tokens": 128,
                            "finish_reason": "length", "seconds": 6.4}}
    table = report.runtimes_table(runs)
    assert "| Kiln, its own environment | 3.13.0 | bytecode version mismatch | – |" in table
    assert "| Kiln's code, IREE runtime 3.9 | 3.9.0 | 128 tokens, length | 6.4 |" in table
    assert report.runtimes_table({"error": "Traceback\nRuntimeError: no venv\n"}) == "failed: RuntimeError: no venv"


def test_paired_rounds_give_the_c16_ratio_and_a_table():
    paired = {
        "engines": ["kiln f32", "llama.cpp f32"], "concurrency": 16, "median_ratio": 1.1, "paired_rounds": 2,
        "rounds": [
            {"order": ["kiln f32", "llama.cpp f32"], "ratio": 1.0,
             "runs": {"kiln f32": serving(16, out=200), "llama.cpp f32": serving(16, out=200)}},
            {"order": ["llama.cpp f32", "kiln f32"], "ratio": 1.2,
             "runs": {"llama.cpp f32": serving(16, out=150), "kiln f32": serving(16, out=180)}},
            {"order": ["kiln f32", "llama.cpp f32"], "ratio": None,
             "runs": {"kiln f32": {"error": "Traceback ..."}, "llama.cpp f32": serving(16, out=150)}},
        ],
    }
    results = {**RESULTS, "paired": paired}
    targets = {name: (measured, met) for name, measured, met in report.targets(results)}
    assert targets["serving c=16: kiln out tok/s ≥ 1.2x llama.cpp f32"] == ("1.10x (median of 2 paired rounds)", False)
    assert targets["serving c=16: kiln TTFT p50 below llama.cpp f32"] == ("300 vs 400 ms", True)  # from the sweep
    table = report.paired_table(paired)
    assert "| 2 | llama.cpp f32 → kiln f32 | 180.0 | 150.0 | 1.20x |" in table
    assert "| 3 | kiln f32 → llama.cpp f32 | failed | 150.0 | – |" in table
    assert "| median | | | | 1.10x | | |" in table
    assert "alternating rounds" in report.tables(results)


def test_decode_targets_add_the_median_of_per_round_ratios():
    def row(engine, dtype, figures):
        return {"engine": engine, "dtype": dtype, "decode_bs1_tok_s": max(figures), "rounds": len(figures),
                "round_figures": [{"decode_bs1_tok_s": f} for f in figures]}

    results = {"offline": [row("kiln", "f32", [55.0, 58.0, 60.0]), row("llama.cpp", "f32", [85.0, 60.0, 60.0])]}
    targets = {name: measured for name, measured, _ in report.targets(results)}
    # best 60 vs 85; per round 0.65, 0.97, 1.00
    assert targets["decode bs1: kiln f32 ≥ 1.0x llama.cpp f32"] == "0.71x (best of each; median of per-round ratios 0.97x)"


def precision_row(bs1_ms, of_floor, ratio=None, peer="q8_0", speedup=None):
    row = {"decode_bs1_ms": bs1_ms, "decode_bs8_ms": 2 * bs1_ms, "prefill_512_ms": 700.0, "floor_step_ms": 5.0,
           "of_floor": of_floor}
    if ratio:
        row["llama_cpp"] = {"type": peer, "ratio": dict(zip(("decode_bs1", "decode_bs8", "prefill_512_time"), ratio))}
    if speedup:
        row["speedup_vs_f32"] = dict(zip(("decode_bs1_ms", "decode_bs8_ms", "prefill_512_ms"), speedup))
    return row


PRECISION = {"membw": {"read_gb_s": 30.0}, "results": {
    "f32": precision_row(24.0, 0.74, (0.85, 1.1, 1.11), peer="f32"),
    "bf16w": precision_row(15.0, 0.56, (1.02, 1.38, 0.86), peer="bf16", speedup=(1.6, 1.4, 0.97)),
    "q4_1": precision_row(11.0, 0.48, (0.67, 1.35, 0.47), peer="q4_1", speedup=(2.1, 1.3, 0.94)),
}}


def test_precision_targets_compare_each_precision_with_llama_cpp_at_the_same_one():
    targets = {name: (measured, met) for name, measured, met in report.targets({"precision": PRECISION})}
    assert targets["decode bs1: kiln f32 ≥ 1.0x llama.cpp F32"] == ("0.85x", False)
    assert targets["decode bs1: kiln bf16 ≥ 1.0x llama.cpp BF16"] == ("1.02x", True)
    assert targets["decode bs8: kiln Q4_1 ≥ 1.3x llama.cpp Q4_1"] == ("1.35x", True)
    assert targets["prefill 512: kiln Q4_1 ≤ 0.8x llama.cpp Q4_1's time"] == ("0.47x", True)
    assert targets["prefill 512: kiln bf16 ≤ 0.8x llama.cpp BF16's time"] == ("0.86x", False)
    assert targets["decode bs1: kiln bf16 ≥ 1.6x kiln f32"] == ("1.60x", True)
    assert targets["decode bs1: kiln f32 ≥ 0.85 of its bandwidth floor"] == ("0.74", False)
    table = report.tables({"precision": PRECISION})
    assert "| bf16 | 15.0 | 30.0 | 700 | 5.0 | 0.56 | 1.60x / 1.40x / 0.97x | 1.02x / 1.38x (BF16) | 0.86x |" in table
    assert "| f32 | 24.0 | 48.0 | 700 | 5.0 | 0.74 | – | 0.85x / 1.10x (F32) | 1.11x |" in table
    assert "Offline" not in table  # no offline step in this run: no empty table


def test_each_paired_precision_gets_its_serving_targets():
    def pair(first, second, ratios, ttfts):
        rounds = [{"order": [first, second], "ratio": r,
                   "runs": {first: serving(16, out=100 * r, ttft=a), second: serving(16, out=100, ttft=b)}}
                  for r, (a, b) in zip(ratios, ttfts)]
        return {"engines": [first, second], "concurrency": 16, "rounds": rounds,
                "median_ratio": sorted(ratios)[len(ratios) // 2], "paired_rounds": len(ratios)}

    results = {"paired": [pair("kiln f32", "llama.cpp f32", [1.0, 1.1, 1.05], [(1, 2), (1, 2), (1, 2)]),
                          pair("kiln q8_0", "llama.cpp q8_0", [1.4, 1.5, 1.3], [(2300, 5000), (2400, 6000), (2200, 7000)])]}
    targets = {name: (measured, met) for name, measured, met in report.targets(results)}
    assert targets["serving c=16: kiln out tok/s ≥ 1.2x llama.cpp f32"] == ("1.05x (median of 3 paired rounds)", False)
    assert targets["serving c=16: kiln TTFT p50 below llama.cpp f32"] == ("1 vs 2 ms", True)  # no sweep: the pair's
    assert targets["serving c=16: kiln q8_0 out tok/s ≥ 1.2x llama.cpp q8_0"] == ("1.40x (median of 3 paired rounds)", True)
    assert targets["serving c=16: kiln q8_0 TTFT p50 below llama.cpp q8_0"] == ("2300 vs 6000 ms", True)
    text = report.tables(results)
    assert "kiln q8_0 and llama.cpp q8_0 in alternating rounds" in text and "kiln f32 and llama.cpp f32" in text
    # A results file written when the step took one pair holds it as a dict.
    assert report.paired_summaries({"paired": results["paired"][0]}) == [results["paired"][0]]


def test_fixed_decode_step_gets_its_table():
    fixed = {"context": 128, "pairs": 300, "results": {
        "q8_0": {"bs1": {"fixed": "decode_bs1_ctx1024", "fixed_ms": 6.5, "dynamic_ms": 7.0, "speedup": 1.07}}}}
    text = report.tables({"fixed_decode": fixed})
    assert "medians of 300 alternating pairs" in text
    assert "| Q8_0 | 1 | 6.50 | 7.00 | 1.07x |" in text
