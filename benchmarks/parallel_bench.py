"""Tensor and pipeline parallelism on SmolLM2-135M (float32) over local-task devices in one process.

    python -m benchmarks.parallel_bench

SmolLM2 is exported three ways: one device, TP = 3 (its 9 heads and 3 K/V heads, three ranks),
PP = 2 (layers 0-14 and 15-29). For each: the parameter bytes each device loads (read off the
module's placement), the KV bytes of one page on each device, and the time of one call: a
256-token prefill (batch 1) and a decode step (batch 4, 256 tokens of context), median of
repeated calls. Greedy tokens are checked equal across the three.

All devices here share one CPU socket (two cores on the development machine), so no speed-up
is expected: the devices take turns on the same cores, and TP adds a reduce per layer; IREE 3.13
also compiles these modules without CPU data tiling, and the TP one with its cache copied per
call (docs/parallelism.md, "Tensor and pipeline parallelism"). The figures are for the record and for a first
multi-GPU run. The JSON goes to
benchmarks/results/parallel-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
from pathlib import Path

import numpy as np

from benchmarks.kiln_offline import build_in_child, median_ms
from benchmarks.peers.common import heavy_lock, log

RESULTS_DIR = Path(__file__).parent / "results"
LAYOUTS = {"one device": (1, 1), "TP=3": (3, 1), "PP=2": (1, 2)}
PROMPT_TOKENS, DECODE_BATCH, PAGES = 256, 4, 128


def build(tensor_parallel: int, pipeline_parallel: int) -> Path:
    """SmolLM2 exported for this layout and compiled for the CPU (Kiln's keyed cache: built once)."""
    return build_in_child(f"ExportOptions(prefill_batch_sizes=(1,), decode_batch_sizes=({DECODE_BATCH},), "
                          f"max_seq_len=1024, device_block_count={PAGES}, tensor_parallel={tensor_parallel}, "
                          f"pipeline_parallel={pipeline_parallel})")


def measure(artifacts: Path, repeats: int) -> dict:
    from kiln.export.placement import parameter_bytes_by_device
    from kiln.runtime.contract import Artifacts
    from kiln.runtime.program import Program

    program = Program(Artifacts.in_directory(artifacts))
    p = program.params
    widths = program.layout.page_elems(p.transformer_block_count, p.paged_kv_cache.attention_head_count_kv,
                                       p.block_seq_stride, p.attn_head_dim)
    cache = program.allocate_cache(PAGES)
    stride = p.block_seq_stride
    blocks = PROMPT_TOKENS // stride
    rng = np.random.default_rng(0)
    prompts = rng.integers(300, 40000, (DECODE_BATCH, PROMPT_TOKENS))
    tables = np.arange(1, 1 + DECODE_BATCH * (blocks + 1)).reshape(DECODE_BATCH, blocks + 1)

    def prefill(row: int) -> np.ndarray:
        return program.invoke("prefill_last_bs1", prompts[row:row + 1], np.zeros(1, np.int64),
                              np.array([PROMPT_TOKENS]), tables[row:row + 1, :blocks], cache)[0]

    first = [int(prefill(row)[0, -1].argmax()) for row in range(DECODE_BATCH)]
    positions = np.full(DECODE_BATCH, PROMPT_TOKENS)

    def decode() -> np.ndarray:
        return program.invoke(f"decode_bs{DECODE_BATCH}", np.array(first).reshape(-1, 1), positions + 1, positions,
                              tables, cache)[0]

    module = (artifacts / "model.mlir").read_text()
    return {
        "devices": program.layout.device_count,
        "parameter_mib_per_device": [round(b / 2**20, 1) for _, b in sorted(parameter_bytes_by_device(module).items())],
        "kv_kib_per_page_per_device": [round(w * program.cache_dtype.itemsize / 1024, 1) for w in widths],
        "prefill_ms": round(median_ms(lambda: prefill(0), repeats), 1),
        "decode_ms": round(median_ms(decode, repeats * 3), 2),
        "greedy": first + [int(t) for t in decode()[:, 0].argmax(-1)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    results = {}
    with heavy_lock():
        for name, (tp, pp) in LAYOUTS.items():
            log(f"building SmolLM2 for {name}")
            try:
                artifacts = build(tp, pp)
            except subprocess.CalledProcessError:
                results[name] = {"devices": tp * pp, "error": "the build failed (its log is above)"}
                continue
            log(f"measuring {name}")
            results[name] = measure(artifacts, args.repeats)
    same = len({tuple(r["greedy"]) for r in results.values() if "greedy" in r}) == 1
    print(f"{'layout':<11} {'devices':>7} {'params MiB/device':>22} {'KV KiB/page/device':>22} "
          f"{'prefill 256 ms':>15} {'decode bs4 ms':>14}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<11} {r['devices']:>7}  {r['error']}")
            continue
        print(f"{name:<11} {r['devices']:>7} {str(r['parameter_mib_per_device']):>22} "
              f"{str(r['kv_kib_per_page_per_device']):>22} {r['prefill_ms']:>15} {r['decode_ms']:>14}")
    print(f"greedy tokens identical across layouts: {same}")
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"parallel-{datetime.date.today()}.json"
    path.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                                "results": results, "greedy_identical": same}, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
