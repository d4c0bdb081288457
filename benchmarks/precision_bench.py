"""SmolLM2-135M with float32, bf16, int8, Q8_0 and the bundled file's own Q4_1 weights (`--quantize`):
the raw compiled calls side by side, in paired rounds, with the memory-bandwidth floor each
precision's weight bytes set.

    python -m benchmarks.precision_bench [--rounds 5] [--llama-cpp] [--precisions f32,q4_1]

Each precision is exported with the serving path's functions (prefill_last at batch 1, decode at
batch 1 and 8) and compiled for this CPU. Then, in one process with no torch in it, every round
times each precision's calls in turn, the order alternating from round to round: a decode step at
128 tokens of context (median of 30 calls) at batch 1 and 8, and a 512-token prefill (median of
3). Ratios are taken within a round (float32's time over the other's) and their median quoted, so
a slow spell of this shared machine cannot land on one precision only. The floor is the step time
if the step only had to stream the parameters once at the bandwidth measured in the same run.
Writes benchmarks/results/precision-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks import membw
from benchmarks.kiln_offline import build_in_child, median_ms
from benchmarks.peers.common import heavy_lock, log

RESULTS_DIR = Path(__file__).parent / "results"
# Each precision's `--quantize` on the bundled Q4_1 file (q4_1 serves its own blocks), built as
# `kiln serve` builds it on a CPU that runs Kiln's hand-written kernels (export/cpu_kernels.py:
# float32, bf16, int8 and the block types, decode attention reading the KV pages in place, and a
# fixed-shape decode whose command buffer is recorded once). Each variant changes one of those, to
# measure what it is worth: "-iree" leaves every matmul to IREE's own kernels, "-gather" gathers
# the pages for attention, "-dynamic" calls the decode whose shapes are dynamic.
QUANTIZE = {"f32": "none", "bf16w": "bf16", "int8": "int8", "q8_0": "q8_0", "q4_1": "q4_1"}
VARIANTS = {"": {}, "-iree": {"cpu_kernels": False}, "-gather": {"attention_in_place": False},
            "-dynamic": {"decode_buckets": ()}}
PRECISIONS = {name + suffix: {"quantize": quantize, **changed}
              for suffix, changed in VARIANTS.items() for name, quantize in QUANTIZE.items()}
DEFAULT_PRECISIONS = ("f32", "bf16w", "int8", "q8_0", "q4_1")
CONTEXT, PREFILL_TOKENS, PAGES, GENERATED = 128, 512, 160, 128
DECODE_BATCHES = (1, 8)
# The GGUF each precision is paired with in llama.cpp (`--llama-cpp`): its own bf16, and Q8_0
# (int8 in 32-weight blocks with a float16 scale each) for Kiln's int8 and Q8_0. Kiln's Q8_0
# blocks are those of llama.cpp's file: both quantize the same float32 weights by ggml's rule.
# Q4_1 is the bundled file, as both engines run it.
# A variant row ("-iree", "-gather", "-dynamic") is paired with its precision's GGUF.
LLAMA_CPP_TYPES = {"f32": "f32", "bf16w": "bf16", "int8": "q8_0", "q8_0": "q8_0", "q4_1": "q4_1"}


def llama_cpp_type(name: str) -> str:
    return LLAMA_CPP_TYPES[name.split("-")[0]]


def build(quantize: str, cpu_kernels: bool = True, attention_in_place: bool = True,
          decode_buckets: tuple[int, ...] | None = None) -> Path:
    """SmolLM2 exported with these weights and compiled for the CPU (Kiln's keyed cache: built once);
    `cpu_kernels` where this machine can build them, the rest as ExportOptions takes them."""
    from kiln.export.cpu_kernels import support_problem

    cpu_kernels = cpu_kernels and support_problem() is None
    return build_in_child(f"ExportOptions(prefill_batch_sizes=(1,), decode_batch_sizes={DECODE_BATCHES}, "
                          f"max_seq_len=1024, device_block_count={PAGES}, quantize={quantize!r}, "
                          f"cpu_kernels={cpu_kernels}, attention_in_place={attention_in_place}, "
                          f"decode_buckets={decode_buckets!r})")


def resident_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


class Calls:
    """One precision's compiled program and the calls a round times."""

    def __init__(self, artifacts: Path, device: str = "local-task", pages: int = PAGES):
        """`pages`: the cache's size; a fixed-shape decode is called only where it is the
        export's page count (precision_bench's builds are exported for PAGES)."""
        from kiln.runtime.contract import Artifacts, device_target
        from kiln.runtime.program import Program

        before = resident_mib()
        self.program = Program(Artifacts.in_directory(artifacts, device_target(device)), device)
        self.pages = pages
        self.cache = self.program.allocate_cache(pages)
        stride = self.program.params.block_seq_stride
        rng = np.random.default_rng(0)
        self.prompt = rng.integers(300, 40000, (1, PREFILL_TOKENS))
        self.prefill_table = np.arange(1, 1 + PREFILL_TOKENS // stride).reshape(1, -1)
        blocks = CONTEXT // stride + 1
        largest = max(DECODE_BATCHES)
        self.tables = np.arange(1, 1 + largest * blocks).reshape(largest, blocks)
        self.first = self.prefill(CONTEXT)  # each row's context is the same 128 tokens: real pages to read
        self.greedy = [int(self.decode(1)[0, 0].argmax())]
        self.resident_mib = resident_mib() - before

    def prefill(self, tokens: int = PREFILL_TOKENS) -> int:
        stride = self.program.params.block_seq_stride
        logits = self.program.invoke("prefill_last_bs1", self.prompt[:, :tokens], np.zeros(1, np.int64),
                                     np.array([tokens]), self.prefill_table[:, :tokens // stride], self.cache)[0]
        return int(logits[0, -1].argmax())

    def decode_call(self, batch: int, context: int, tables: np.ndarray) -> tuple[str, np.ndarray]:
        """The decode the server would call for rows of `context` tokens, and `tables` cut or
        padded to the width it takes."""
        name, blocks = self.program.capabilities.decode_function(batch, context, self.pages)
        wide = np.zeros((batch, max(blocks, tables.shape[1])), np.int64)
        wide[:, :tables.shape[1]] = tables[:batch]
        return name, wide[:, :blocks]

    def decode(self, batch: int) -> np.ndarray:
        positions = np.full(batch, CONTEXT)
        name, tables = self.decode_call(batch, CONTEXT + 1, self.tables)
        return self.program.invoke(name, np.full((batch, 1), self.first), positions + 1, positions, tables,
                                   self.cache)[0]

    def generation_tok_s(self, rows: int, steps: int = GENERATED) -> float:
        """llama-batched-bench's decode figure: `rows` sequences' tokens/s over `steps` decode steps
        from CONTEXT tokens on (the context grows as it goes; no sampling), in the smallest decode
        function that holds them, as the server runs them."""
        stride = self.program.params.block_seq_stride
        batch = min(b for b in DECODE_BATCHES if b >= rows)
        blocks = (CONTEXT + steps) // stride + 1
        tables = np.zeros((batch, blocks), np.int64)
        tables[:rows] = np.arange(1, 1 + rows * blocks).reshape(rows, blocks)
        tokens = np.full((batch, 1), self.first)
        calls = [self.decode_call(batch, CONTEXT + step + 1, tables) for step in range(steps)]
        started = time.perf_counter()
        for step, (name, step_tables) in enumerate(calls):
            positions = np.full(batch, CONTEXT + step)
            self.program.invoke(name, tokens, positions + 1, positions, step_tables, self.cache)
        return rows * steps / (time.perf_counter() - started)


def measure(artifacts: dict[str, Path], rounds: int, llama_cpp: bool) -> dict:
    from kiln.export.placement import parameter_bytes_by_device

    calls = {name: Calls(path) for name, path in artifacts.items()}
    bandwidth = membw.measure()
    names = list(calls)
    times: dict[str, list[dict]] = {name: [] for name in names}
    peers: dict[str, list[dict]] = {name: [] for name in names}
    for round_index in range(rounds):
        for name in names if round_index % 2 == 0 else names[::-1]:
            c = calls[name]

            def kiln(c=c, name=name):
                figures = {f"decode_bs{b}_ms": median_ms(lambda b=b: c.decode(b), 30) for b in DECODE_BATCHES}
                figures["prefill_512_ms"] = median_ms(c.prefill, 3)
                figures.update({f"generate_bs{rows}_tok_s": c.generation_tok_s(rows) for rows in (1, 8)})
                times[name].append(figures)

            def peer(name=name):
                from benchmarks.peers import llamacpp

                figures = llamacpp.batched_bench(llama_cpp_type(name), npp=CONTEXT, ntg=GENERATED, npl="1,8")
                prefill = llamacpp.batched_bench(llama_cpp_type(name), npp=PREFILL_TOKENS, ntg=1, npl="1")
                peers[name].append({**figures, "prefill_512_ms": prefill["prefill_bs1_ms"]})

            jobs = (kiln, peer) if llama_cpp else (kiln,)
            for job in jobs if round_index % 2 == 0 else jobs[::-1]:
                job()
            figures = times[name][-1]
            log(f"round {round_index + 1}: {name} " + ", ".join(f"{k} {v:.1f}" for k, v in figures.items())
                + (f"; llama.cpp {llama_cpp_type(name)} {peers[name][-1]}" if llama_cpp else ""))
    results = {}
    for name in names:
        parameter_bytes = sum(parameter_bytes_by_device((artifacts[name] / "model.mlir").read_text()).values())
        floor = membw.decode_floor(parameter_bytes, bandwidth["read_gb_s"])
        row = {key: round(statistics.median(r[key] for r in times[name]), 2) for key in times[name][0]}
        row.update({
            "parameter_mib": round(parameter_bytes / 2**20, 1),
            "resident_mib": round(calls[name].resident_mib, 1),
            "floor_step_ms": round(floor["step_ms"], 2),
            "of_floor": round(floor["step_ms"] / row["decode_bs1_ms"], 2),
            "greedy_after_prompt": [calls[name].first, *calls[name].greedy],
            "rounds": times[name],
        })
        if llama_cpp:
            ratio = {f"decode_bs{rows}": round(statistics.median(
                k[f"generate_bs{rows}_tok_s"] / p[f"decode_bs{rows}_tok_s"] for k, p in zip(times[name], peers[name])), 2)
                for rows in (1, 8)}
            # Prefill as a time ratio, Kiln's over llama.cpp's: below 1 is Kiln ahead.
            ratio["prefill_512_time"] = round(statistics.median(
                k["prefill_512_ms"] / p["prefill_512_ms"] for k, p in zip(times[name], peers[name])), 2)
            row["llama_cpp"] = {"type": llama_cpp_type(name), "rounds": peers[name], "ratio": ratio}
        if name != "f32":
            # Times divide float32's by this precision's, rates this one's by float32's: above 1 is faster.
            row["speedup_vs_f32"] = {key: round(statistics.median(
                (o[key] / f[key]) if key.endswith("_tok_s") else (f[key] / o[key])
                for f, o in zip(times["f32"], times[name])), 2) for key in times[name][0]}
        results[name] = row
    return {"membw": bandwidth, "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--precisions", default=",".join(DEFAULT_PRECISIONS),
                        help=f"which to measure, comma-separated, f32 among them: any of {', '.join(PRECISIONS)} "
                        f"(default: {', '.join(DEFAULT_PRECISIONS)})")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="also run llama.cpp's llama-batched-bench on the matching GGUF in every round (its peer "
                        "setup builds it on first use, about 20 minutes here)")
    args = parser.parse_args()
    chosen = args.precisions.split(",")
    if "f32" not in chosen or not set(chosen) <= set(PRECISIONS):
        parser.error(f"--precisions takes f32 and any of {', '.join(PRECISIONS)}, got {args.precisions!r}")
    with heavy_lock():
        artifacts = {}
        for name in chosen:
            log(f"building SmolLM2 with {name} weights")
            artifacts[name] = build(**PRECISIONS[name])
        log("measuring")
        report = measure(artifacts, args.rounds, args.llama_cpp)
    print(f"memory read bandwidth {report['membw']['read_gb_s']:.1f} GB/s")
    print(f"{'weights':<8} {'params MiB':>10} {'resident MiB':>12} {'decode bs1 ms':>13} {'bs8 ms':>7} "
          f"{'prefill 512 ms':>14} {'floor ms':>8} {'of floor':>8}  speed-up vs f32 (bs1 / bs8 / prefill)")
    for name, r in report["results"].items():
        up = r.get("speedup_vs_f32")
        ups = " / ".join(f"{up[k]:.2f}x" for k in ("decode_bs1_ms", "decode_bs8_ms", "prefill_512_ms")) if up else "-"
        print(f"{name:<8} {r['parameter_mib']:>10} {r['resident_mib']:>12} {r['decode_bs1_ms']:>13} "
              f"{r['decode_bs8_ms']:>7} {r['prefill_512_ms']:>14} {r['floor_step_ms']:>8} {r['of_floor']:>8}  {ups}")
    if args.llama_cpp:
        print(f"{'weights':<8} {'llama.cpp':>9} {'Kiln / llama.cpp decode tok/s, batch 1':>40} {'batch 8':>8} "
              f"{'prefill 512 time':>17}")
        for name, r in report["results"].items():
            peer = r["llama_cpp"]
            print(f"{name:<8} {peer['type']:>9} {peer['ratio']['decode_bs1']:>39.2f}x {peer['ratio']['decode_bs8']:>7.2f}x "
                  f"{peer['ratio']['prefill_512_time']:>16.2f}x")
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"precision-{datetime.date.today()}.json"
    path.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "cpu": membw.cpu_model(),
                                "cpus": os.cpu_count(), **report}, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
