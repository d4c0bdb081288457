"""This machine's memory bandwidth, and the decode-speed floor it sets.

A decode step at small batch reads every weight once, so weight bytes / bandwidth
is the least time a step can take on this machine, whatever the engine. Measured
in the same run as the engines because the figure drifts on a shared machine.

    python -m benchmarks.membw
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time

import numpy as np

BUFFER_BYTES = 1 << 30  # far beyond any last-level cache


def _timed_threads(work, per_thread_args: list[tuple]) -> float:
    """Seconds for one thread per args tuple to run `work` (numpy drops the GIL), all
    released together."""
    barrier = threading.Barrier(len(per_thread_args) + 1)

    def run(*args):
        barrier.wait()
        work(*args)

    threads = [threading.Thread(target=run, args=args) for args in per_thread_args]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - started


def measure(threads: int | None = None, repeats: int = 5) -> dict:
    """Read and copy bandwidth in GB/s (10^9 bytes), best of `repeats`, one thread per core."""
    threads = threads or os.cpu_count() or 1
    data = np.ones(BUFFER_BYTES // 4, dtype=np.float32)
    target = np.empty_like(data)
    chunks = np.array_split(data, threads)
    target_chunks = np.array_split(target, threads)
    sums = [_timed_threads(np.add.reduce, [(c,) for c in chunks]) for _ in range(repeats)]
    # A matrix-vector product reads the matrix once with the BLAS's vector loads (and
    # threads): numpy's reduction can be compute-bound before memory is.
    matrix, ones = data.reshape(-1, 1024), np.ones(1024, np.float32)
    gemvs = [_timed_threads(np.dot, [(matrix, ones)]) for _ in range(repeats)]
    copies = [_timed_threads(np.copyto, list(zip(target_chunks, chunks))) for _ in range(repeats)]
    reads = sums + gemvs
    return {
        "threads": threads,
        "buffer_bytes": BUFFER_BYTES,
        "read_gb_s": BUFFER_BYTES / min(reads) / 1e9,
        "read_gb_s_median": BUFFER_BYTES / statistics.median(reads) / 1e9,
        "sum_gb_s": BUFFER_BYTES / min(sums) / 1e9,
        "gemv_gb_s": BUFFER_BYTES / min(gemvs) / 1e9,
        # A copy moves each byte twice: read once, written once.
        "copy_gb_s": 2 * BUFFER_BYTES / min(copies) / 1e9,
    }


def cpu_model() -> str:
    """This machine's CPU as /proc/cpuinfo names it, with its family and model numbers (a
    virtual machine may name only the vendor): results from different CPUs are not comparable."""
    fields = {}
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        return ""
    return f"{fields.get('model name', '')} (family {fields.get('cpu family', '?')}, model {fields.get('model', '?')})"


def decode_floor(weight_bytes: int, bandwidth_gb_s: float) -> dict:
    """The fastest a batch-1 decode step can be if it only has to stream the weights."""
    step_ms = weight_bytes / (bandwidth_gb_s * 1e9) * 1e3
    return {"weight_bytes": weight_bytes, "step_ms": step_ms, "tokens_per_s": 1e3 / step_ms}


if __name__ == "__main__":
    print(json.dumps(measure(), indent=2))
