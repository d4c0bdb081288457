"""Where one compiled call's time goes, from IREE's own tools: iree-benchmark-module times the
call, runs it again with the device's profiling on, and iree-profile's statistics give each
dispatch's time. Prints the call's wall time, how many dispatches it runs, their sum (the rest of
the wall time is the driver between them) and the dispatches that take the most, grouped by what
they compute (the same matmul in every layer is one line).

    python -m benchmarks.profile_step [--precision q8_0 | --artifacts DIR] [--function decode_bs1]
        [--context 128] [--tokens 512] [--calls 10] [--top 20] [--json OUT]

A decode call reads `--context` tokens of context in each row, every row its own pages in shuffled
order; a prefill call writes `--tokens` new tokens from position 0. The KV cache holds random
values (they do not change the time). One-device exports only.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

from kiln.runtime.config import ModelParams, load_model_config
from kiln.runtime.contract import Artifacts, FunctionKind, fixed_decode_context, parse_function_name

# "decode_bs1$async_dispatch_37_batch_matmul_1x1x576x1536_f32" -> "batch_matmul_1x1x576x1536_f32",
# "_encoding_29_encode_576xf32_to_576xf32" -> "encode_576xf32_to_576xf32"
_DISPATCH_PREFIX = re.compile(r"^(dispatch|_encoding)_\d+_")


def tool(name: str) -> str:
    """An IREE runtime tool, from this Python's environment (iree-base-runtime installs them)."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        raise SystemExit(f"{name} not found: it comes with iree-base-runtime (pip install -e '.[test]')")
    return found


def call_inputs(params: ModelParams, function: str, context: int, tokens: int) -> list[np.ndarray]:
    """The arguments of `function` (the ABI's order, runtime/contract.py), cache last."""
    parsed = parse_function_name(function)
    if parsed is None or parsed[0] in (FunctionKind.DENOISE, FunctionKind.DENOISE_TOP):
        raise SystemExit(f"--function must be a prefill, prefill_last or decode function, got {function!r}")
    kind, rows = parsed
    stride = params.block_seq_stride
    decode = kind is FunctionKind.DECODE
    exported = params.decode_batch_sizes if decode else params.prefill_batch_sizes
    if rows not in exported:
        raise SystemExit(f"this export has no {function}: its {kind.value} batch sizes are {list(exported)}")
    length = context + 1 if decode else tokens
    if length > params.max_seq_len:
        raise SystemExit(f"{length} tokens of context do not fit the export's {params.max_seq_len}")
    if not decode and tokens % stride:
        raise SystemExit(f"--tokens must be a multiple of the page size, {stride}")
    if params.paged_kv_cache.kv_cache_dtype == "bfloat16":
        raise SystemExit("a bfloat16 KV cache has no .npy form that iree-benchmark-module reads")
    blocks = -(-length // stride)
    # A fixed-shape decode takes a table as wide as its bucket and a cache of the export's page count.
    bucket = fixed_decode_context(function)
    if bucket is not None and length > bucket:
        raise SystemExit(f"{length} tokens of context do not fit {function}")
    page_count = params.paged_kv_cache.device_block_count if bucket else rows * blocks + 1
    if page_count < rows * blocks + 1:
        raise SystemExit(f"{function} takes a cache of {page_count} pages: too few for {rows} rows of {length} tokens")
    pages = np.random.default_rng(1).permutation(rows * blocks) + 1  # page 0 stays the padding page
    table = np.zeros((rows, bucket // stride if bucket else blocks), np.int64)
    table[:, :blocks] = pages.reshape(rows, blocks)
    dtype = np.dtype(params.paged_kv_cache.kv_cache_dtype)
    cache = (np.random.default_rng(0).standard_normal((page_count, params.page_elems)) * 0.1).astype(dtype)
    if decode:
        return [np.full((rows, 1), 100, np.int64), np.full(rows, context + 1, np.int64),
                np.full(rows, context, np.int64), table, cache]
    prompt = np.random.default_rng(2).integers(300, 1000, (rows, tokens)).astype(np.int64)
    seq_lens = np.full(rows, tokens, np.int64)
    positions = [np.zeros(rows, np.int64)] if params.has_prefill_position else []
    return [prompt, *positions, seq_lens, table, cache]


def dispatch_times(rows: list[dict], calls: int) -> dict:
    """Per call: the dispatch count, their summed time (ms), and each kind's time and count, most
    first. A dispatch is named after the first function that uses its code (IREE keeps one copy
    of identical code), so a decode call's rows may carry a prefill's name: every row counts, as
    the profile holds the timed calls only (the module's loading is not in it)."""
    kinds: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for row in rows:
        if row.get("row_type") != "host_execution_function":
            continue
        kind = _DISPATCH_PREFIX.sub("", row["function_name"].split("$async_", 1)[-1])
        kinds[kind][0] += row["total_duration_ns"] / 1e6 / calls
        kinds[kind][1] += row["sample_count"] / calls
    ordered = sorted(kinds.items(), key=lambda item: -item[1][0])
    return {"dispatches": sum(count for _, count in kinds.values()),
            "dispatch_ms": sum(ms for ms, _ in kinds.values()),
            "kinds": [{"kind": kind, "ms": ms, "count": count} for kind, (ms, count) in ordered]}


def profile(artifacts: Path, function: str, context: int = 128, tokens: int = 512, calls: int = 10,
            repetitions: int = 3) -> dict:
    """The call's wall time (median of `repetitions` runs of `calls` calls) and its dispatches."""
    files = Artifacts.in_directory(artifacts)
    params, kiln = load_model_config(files.config)
    if kiln is not None and kiln.tensor_parallel * kiln.pipeline_parallel > 1:
        raise SystemExit("profile_step takes one-device exports only")
    with tempfile.TemporaryDirectory(prefix="kiln-profile-") as scratch:
        scratch = Path(scratch)
        flags = [f"--module={files.vmfb}", f"--parameters=model={files.params}", "--device=local-task",
                 f"--function={function}"]
        for index, value in enumerate(call_inputs(params, function, context, tokens)):
            np.save(scratch / f"arg{index}.npy", value)
            flags.append(f"--input=@{scratch / f'arg{index}.npy'}")
        timed = _run([tool("iree-benchmark-module"), *flags, f"--benchmark_min_time={calls}x",
                      f"--benchmark_repetitions={repetitions}", "--benchmark_format=json"])
        runs = [b for b in json.loads(timed)["benchmarks"] if b.get("run_type") == "iteration"]
        wall_ms = statistics.median(_ms(b["real_time"], b["time_unit"]) for b in runs)
        capture = scratch / "call.ireeprof"
        _run([tool("iree-benchmark-module"), *flags, f"--benchmark_min_time={calls}x",
              "--device_profiling_mode=host-execution,queue-events", f"--device_profiling_output={capture}"])
        stats = _run([tool("iree-profile"), "statistics", "--format=jsonl", str(capture)])
    rows = [json.loads(line) for line in stats.splitlines() if line.strip()]
    return {"artifacts": str(artifacts), "function": function, "context": context, "tokens": tokens,
            "wall_ms": wall_ms, **dispatch_times(rows, calls)}


def _ms(value: float, unit: str) -> float:
    return value * {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[unit]


def _run(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{Path(command[0]).name} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return done.stdout


def report(result: dict, top: int) -> str:
    gap = result["wall_ms"] - result["dispatch_ms"]
    lines = [f"{result['function']} of {result['artifacts']}",
             f"wall {result['wall_ms']:.2f} ms per call; {result['dispatches']:.0f} dispatches, "
             f"{result['dispatch_ms']:.2f} ms in them, {gap:.2f} ms between them",
             f"{'ms':>8} {'count':>7}  dispatch"]
    for kind in result["kinds"][:top]:
        lines.append(f"{kind['ms']:8.3f} {kind['count']:7.0f}  {kind['kind']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from benchmarks import precision_bench

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--precision", choices=list(precision_bench.PRECISIONS), default="f32",
                        help="the bundled SmolLM2 as precision_bench builds it (built once, then cached)")
    source.add_argument("--artifacts", type=Path, help="a directory of compiled artifacts instead")
    parser.add_argument("--function", default="decode_bs1")
    parser.add_argument("--context", type=int, default=128, help="decode: tokens of context per row")
    parser.add_argument("--tokens", type=int, default=512, help="prefill: new tokens per row")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if min(args.context, args.tokens, args.calls, args.top) < 1:
        parser.error("--context, --tokens, --calls and --top must be positive")
    artifacts = args.artifacts or precision_bench.build(**precision_bench.PRECISIONS[args.precision])
    if not Artifacts.in_directory(artifacts).vmfb.is_file():
        parser.error(f"{artifacts} holds no compiled CPU module")
    result = profile(artifacts, args.function, args.context, args.tokens, args.calls)
    print(report(result, args.top))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
