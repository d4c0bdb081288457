"""Export/compile benchmark: how long each step takes and how fast the compiled functions run.

    python benchmarks/export_bench.py [--model PATH] [--dtype float32] [--repeats 5]

Exports the model (default: bundled SmolLM2-135M-Instruct), compiles it for cpu,
cuda and rocm, then times prefill of 128 and 512 tokens and one decode step at
each exported batch size, through iree.runtime on the CPU, beside the same model
in eager torch. Prints a table and writes benchmarks/results/export-<date>.json.
Figures, not asserts: absolute times drift on a shared machine, ratios hold.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kiln.runtime.contract import vmfb_file
from kiln.export.compile import compile_vmfb
from kiln.export.export_model import build_model, export_model
from kiln.export.options import ExportOptions
from kiln.models.loader import load_checkpoint
from kiln.runtime.contract import Artifacts
from kiln.runtime.program import Program

RESULTS_DIR = Path(__file__).parent / "results"
PREFILL_LENGTHS = (128, 512)
DECODE_CONTEXT = 128


def median_ms(fn, repeats: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def iree_latencies(program: Program, options: ExportOptions, vocab: int, repeats: int) -> dict:
    stride = options.block_seq_stride
    rng = np.random.default_rng(0)
    out = {"prefill": {}, "decode": {}}
    for bs in options.prefill_batch_sizes:
        for length in PREFILL_LENGTHS:
            blocks = length // stride
            cache = program.allocate_cache(bs * blocks + 1)
            tokens = rng.integers(0, vocab, (bs, length))
            table = np.arange(1, bs * blocks + 1, dtype=np.int64).reshape(bs, blocks)
            args = [tokens, np.zeros(bs, np.int64), np.full(bs, length), table, cache]
            if not options.has_prefill_position:
                args.pop(1)
            out["prefill"][f"bs{bs}_len{length}"] = median_ms(lambda: program.invoke(f"prefill_bs{bs}", *args), repeats)
    for bs in options.decode_batch_sizes:
        blocks = DECODE_CONTEXT // stride + 1
        cache = program.allocate_cache(bs * blocks + 1)
        table = np.arange(1, bs * blocks + 1, dtype=np.int64).reshape(bs, blocks)
        args = (
            rng.integers(0, vocab, (bs, 1)),
            np.full(bs, DECODE_CONTEXT + 1),
            np.full(bs, DECODE_CONTEXT),
            table,
            cache,
        )
        out["decode"][f"bs{bs}"] = median_ms(lambda: program.invoke(f"decode_bs{bs}", *args), repeats * 4)
    return out


def torch_latencies(model, options: ExportOptions, vocab: int, repeats: int) -> dict:
    out = {"prefill": {}, "decode": {}}
    stride = options.block_seq_stride
    with torch.no_grad():
        for bs in options.prefill_batch_sizes:
            for length in PREFILL_LENGTHS:
                tokens = torch.randint(0, vocab, (bs, length))
                out["prefill"][f"bs{bs}_len{length}"] = median_ms(lambda: model.forward_reference(tokens), repeats)
        for bs in options.decode_batch_sizes:
            blocks = DECODE_CONTEXT // stride + 1
            cache = model.allocate_cache(bs * blocks + 1, dtype=next(model.parameters()).dtype)
            table = torch.arange(1, bs * blocks + 1).reshape(bs, blocks)
            tokens = torch.randint(0, vocab, (bs, 1))
            lens, starts = torch.full((bs,), DECODE_CONTEXT + 1), torch.full((bs,), DECODE_CONTEXT)

            def step():
                model.logits(model.forward_paged(tokens, starts, lens, table, cache))

            out["decode"][f"bs{bs}"] = median_ms(step, repeats * 4)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--targets", default="cpu,cuda,rocm")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    options = ExportOptions(prefill_batch_sizes=[1, 4], decode_batch_sizes=[1, 4, 8], dtype=args.dtype, max_seq_len=2048)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    results = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "model": str(args.model or "SmolLM2-135M-Instruct (bundled, Q4_1 dequantized)"),
        "dtype": args.dtype,
        "torch_threads": torch.get_num_threads(),
    }
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as scratch:
        scratch = Path(scratch)
        started = time.monotonic()
        checkpoint = load_checkpoint(args.model)
        results["load_s"] = time.monotonic() - started
        started = time.monotonic()
        export_model(checkpoint, options, scratch, log=log)
        results["export_s"] = time.monotonic() - started
        results["compile_s"], results["vmfb_bytes"] = {}, {}
        for target in args.targets.split(","):
            started = time.monotonic()
            compile_vmfb(scratch / "model.mlir", scratch / vmfb_file(target), target, log=log)
            results["compile_s"][target] = time.monotonic() - started
            results["vmfb_bytes"][target] = (scratch / vmfb_file(target)).stat().st_size
        results["irpa_bytes"] = (scratch / "model.irpa").stat().st_size

        vocab = checkpoint.config.vocab_size
        program = Program(Artifacts.in_directory(scratch))
        log("timing the compiled functions")
        results["iree_cpu_ms"] = iree_latencies(program, options, vocab, args.repeats)
        log("timing torch eager")
        reference = build_model(checkpoint, options)
        results["torch_eager_ms"] = torch_latencies(reference, options, vocab, args.repeats)

    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"export-{datetime.date.today().isoformat()}-{args.dtype}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(render_table(results))
    print(f"\nsaved {path}")
    return 0


def render_table(results: dict) -> str:
    lines = [
        f"Model: {results['model']}, {results['dtype']}; {results['machine']['cpus']} CPUs",
        "",
        f"Export {results['export_s']:.0f} s; compile " + ", ".join(
            f"{t} {s:.0f} s ({results['vmfb_bytes'][t] / 2**20:.2f} MiB)" for t, s in results["compile_s"].items()
        ) + f"; parameters {results['irpa_bytes'] / 2**20:.0f} MiB",
        "",
        "| function | IREE CPU (ms) | torch eager (ms) | IREE / torch |",
        "|---|---:|---:|---:|",
    ]
    for kind in ("prefill", "decode"):
        for key, iree_ms in results["iree_cpu_ms"][kind].items():
            torch_ms = results["torch_eager_ms"][kind][key]
            label = f"{kind} {key.replace('_len', ', ').replace('bs', 'bs ')}" + (" tokens" if kind == "prefill" else f" (context {DECODE_CONTEXT})")
            lines.append(f"| {label} | {iree_ms:.1f} | {torch_ms:.1f} | {iree_ms / torch_ms:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
