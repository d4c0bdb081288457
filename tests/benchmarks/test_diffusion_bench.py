"""The diffusion benchmark's pure parts: break-even, the reference's arguments, the table, the options."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from benchmarks import diffusion_bench
from benchmarks.diffusion_bench import break_even, page_table, parse_args, reference_kwargs, render_table
from kiln.runtime.diffusion.params import DiffusionParams


def e2e(seconds, passes):
    return {"seconds": seconds, "tokens": 64, "forward_passes": passes, "tokens_per_s": 64 / seconds}


RESULTS = {
    "date": "2026-11-25T10:00:00", "machine": {"cpus": 2}, "model": "SmolLM2 bidirectional",
    "mask_token": {"id": 16, "text": "<empty_output>"}, "repeats": 5,
    "denoise_top": True, "load_average": {"before": 0.5, "after": 2.0},
    "calls_ms": {"denoise_full": {"bs1": 300.0, "bs8": 2400.0}, "denoise_dual": {"bs1": 40.0, "bs8": 200.0},
                 "denoise_top_full": {"bs1": 250.0, "bs8": 2000.0}, "denoise_top_dual": {"bs1": 30.0, "bs8": 150.0},
                 "decode": {"bs1": 20.0, "bs8": 50.0}},
    "break_even": {"denoise_full": {"bs1": 15.0, "bs8": 48.0}, "denoise_dual": {"bs1": 2.0, "bs8": 4.0},
                   "denoise_top_full": {"bs1": 12.5, "bs8": 40.0}, "denoise_top_dual": {"bs1": 1.5, "bs8": 3.0}},
    "tokens_per_forward": {"LLaDA fixed schedule (steps = gen length)": {"tokens": 256, "forward_passes": 256},
                           "Fast-dLLM threshold 0.5, cache dual": {"tokens": 256, "forward_passes": 100}},
    "end_to_end": {"mode": "dual cache", "torch_eager": {"bs1": e2e(4.0, 70), "bs8": e2e(32.0, 560)},
                   "kiln": {"bs1": e2e(1.0, 70), "bs8": e2e(4.0, 561)}},
}


def test_break_even_is_the_ratio_of_calls_with_the_same_real_rows():
    assert break_even(300.0, 20.0) == 15.0  # a row must commit 15 tokens a forward to match AR
    assert break_even(10.0, 20.0) == 0.5


def test_reference_gets_what_kiln_plans():
    assert reference_kwargs(DiffusionParams(block_length=32, threshold=0.9, cache="dual"), 64) == dict(
        gen_length=64, block_length=32, steps=64, threshold=0.9, cache="dual")
    assert reference_kwargs(DiffusionParams(steps=6, block_length=16), 40)["gen_length"] == 48  # whole blocks
    fixed = diffusion_bench.MODES["LLaDA fixed schedule (steps = gen length)"]
    assert reference_kwargs(fixed, 64)["steps"] == 64 and fixed.threshold is None
    assert len(diffusion_bench.MODES) == 7


def test_end_to_end_figures_add_up_each_batch_of_requests():
    """timed_batches with a stand-in for generation: the same 8 prompts, the first 1 then all 8."""
    seen = []

    def run(prompts):
        seen.append(prompts)
        return [(64, 60)] * len(prompts)

    out = diffusion_bench.timed_batches(run, lambda r: r, repeats=2)
    assert [len(p) for p in seen] == [1, 1, 1, 8, 8] and seen[-1][0] == seen[0][0]
    assert all(len(p) == 64 for p in seen[-1]) and len({tuple(p) for p in seen[-1]}) == 8
    assert (out["bs1"]["tokens"], out["bs1"]["forward_passes"]) == (64, 60)
    assert (out["bs8"]["tokens"], out["bs8"]["forward_passes"]) == (512, 480)
    assert out["bs8"]["tokens_per_s"] == 512 / out["bs8"]["seconds"]


def test_page_table_gives_rows_their_own_pages_and_pads_with_page_zero():
    table = page_table(1, 33, 16, size=2)
    assert table.tolist() == [[1, 2, 3], [0, 0, 0]]
    assert np.unique(page_table(8, 320, 16)).size == 8 * 20


def test_table_shows_calls_break_even_tokens_per_forward_and_ratios():
    text = render_table(RESULTS)
    assert "| denoise, full canvas (T=320) | 300.0 | 2400.0 | 15.0 | 48.0 |" in text
    assert "| denoise_top, dual-cache block (T=32, keys 320) | 30.0 | 150.0 | 1.5 | 3.0 |" in text
    assert "| AR decode step (context 320) | 20.0 | 50.0 | | |" in text
    assert "| Fast-dLLM threshold 0.5, cache dual | 100 | 2.56 |" in text
    assert "| 1 | 4.00 | 16.0 | 1.00 | 64.0 | 4.00x | 70 / 70 |" in text
    assert "| 8 | 32.00 | 2.0 | 4.00 | 16.0 | 8.00x | 560 / 561 |" in text
    assert "random weights" in text and "load average 0.5 before, 2.0 after" in text
    assert "greedy: Kiln calls denoise_top;" in text
    assert "greedy: Kiln calls denoise;" in render_table({**RESULTS, "denoise_top": False})


def test_arguments(monkeypatch, tmp_path):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    args = parse_args([])
    assert (args.work_dir, args.repeats, args.e2e_repeats, args.denoise_top, args.child) == (
        tmp_path / "bench", 5, 2, False, None)
    args = parse_args(["--repeats", "3", "--output", "x.json", "--child", "torch", "2"])
    assert (args.repeats, args.output, args.child) == (3, Path("x.json"), ["torch", "2"])


def test_the_timing_process_loads_no_torch():
    """Torch runs in the children only: the module itself must not pull it in."""
    code = "import sys, benchmarks.diffusion_bench; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=Path(diffusion_bench.__file__).resolve().parent.parent)
    assert done.stdout.strip() == "False"
