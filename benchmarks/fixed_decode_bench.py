"""A decode step through its fixed-shape function (its command buffer recorded once, at load)
against the same step through decode_bs<N> (recorded on every call), in one program.

    python -m benchmarks.fixed_decode_bench [--precisions f32,q8_0,q4_1] [--pairs 300]
    python -m benchmarks.run --steps fixed          # the same, in the benchmark command

Each precision is precision_bench's build (SmolLM2, the CPU kernels, decode at batch 1 and 8),
which holds both functions. The two are called in alternating pairs on the same arguments (a
step at 128 tokens of context), each pair's order flipped from the last, so the machine's drift
lands on both; the figure is the median of the per-pair ratios. Their logits must be equal, bit
for bit. Writes benchmarks/results/fixed-decode-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import numpy as np

from benchmarks import precision_bench
from benchmarks.peers.common import heavy_lock, log


def compare(calls: precision_bench.Calls, batch: int, pairs: int, exact: bool = True) -> dict:
    """Both decodes of one batch size, `pairs` alternating pairs: medians, the ratio and how far
    apart their logits are. `exact`: they must be equal bit for bit, as on the CPU, where both run
    the same kernels over the same rows; a GPU's kernels for the two shapes sum in other orders."""
    positions = np.full(batch, precision_bench.CONTEXT)
    tokens = np.full((batch, 1), calls.first)
    fixed = calls.decode_call(batch, precision_bench.CONTEXT + 1, calls.tables)
    dynamic = (f"decode_bs{batch}", calls.tables[:batch])
    if fixed[0] == dynamic[0]:
        raise SystemExit(f"this build has no fixed-shape decode at batch {batch}")
    seconds: dict[str, list[float]] = {fixed[0]: [], dynamic[0]: []}
    logits = {}
    for pair in range(pairs):
        for name, tables in (fixed, dynamic) if pair % 2 == 0 else (dynamic, fixed):
            started = time.perf_counter()
            logits[name] = calls.program.invoke(name, tokens, positions + 1, positions, tables, calls.cache)[0]
            seconds[name].append(time.perf_counter() - started)
    difference = float(np.max(np.abs(logits[fixed[0]].astype(np.float32) - logits[dynamic[0]].astype(np.float32))))
    if exact and difference != 0:
        raise SystemExit(f"{fixed[0]} and {dynamic[0]} returned different logits")
    return {
        "fixed": fixed[0],
        "max_abs_difference": difference,
        "fixed_ms": round(1e3 * statistics.median(seconds[fixed[0]]), 3),
        "dynamic_ms": round(1e3 * statistics.median(seconds[dynamic[0]]), 3),
        # Above 1: the fixed-shape decode is faster.
        "speedup": round(statistics.median(d / f for f, d in zip(seconds[fixed[0]], seconds[dynamic[0]])), 3),
    }


DEFAULT_PRECISIONS = ("f32", "q8_0", "q4_1")


def measure(precisions, pairs: int) -> dict:
    """Each precision's build, both decodes at every batch size of precision_bench, compared."""
    results = {}
    for name in precisions:
        log(f"fixed decode: building SmolLM2 with {name} weights")
        calls = precision_bench.Calls(precision_bench.build(**precision_bench.PRECISIONS[name]))
        results[name] = {f"bs{batch}": compare(calls, batch, pairs) for batch in precision_bench.DECODE_BATCHES}
        del calls  # one program's cache and parameters at a time
    return {"cpu": precision_bench.membw.cpu_model(), "pairs": pairs, "context": precision_bench.CONTEXT,
            "results": results}


def main() -> None:
    from benchmarks.report import fixed_decode_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precisions", default=",".join(DEFAULT_PRECISIONS),
                        help=f"comma-separated, any of {', '.join(precision_bench.QUANTIZE)} (default: %(default)s)")
    parser.add_argument("--pairs", type=int, default=300)
    args = parser.parse_args()
    chosen = args.precisions.split(",")
    if not set(chosen) <= set(precision_bench.QUANTIZE) or args.pairs < 1:
        parser.error(f"--precisions takes any of {', '.join(precision_bench.QUANTIZE)}, --pairs a positive count")
    with heavy_lock():
        measured = measure(chosen, args.pairs)
    print(fixed_decode_table(measured))
    precision_bench.RESULTS_DIR.mkdir(exist_ok=True)
    path = precision_bench.RESULTS_DIR / f"fixed-decode-{datetime.date.today()}.json"
    path.write_text(json.dumps(measured, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
