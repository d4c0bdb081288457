"""Resident memory of a served build against what it must hold: its parameters and its KV cache.

    python -m benchmarks.memory_bench [ARTIFACTS_DIR ...] [--model FILE ...] [--quantize Q ...] [--pages 1024]
                                      [--json OUT]

Each `--model` (an HF directory or GGUF) is measured in the build `kiln serve --model FILE` makes
(built if needed), each `--quantize` in the bundled SmolLM2's as `kiln serve --quantize Q` builds it;
with none of these, the bundled SmolLM2's default. Each build is loaded in a fresh process
with no torch in it, as the server loads it (weights as `--parameter-memory auto` places them),
with a cache of `--pages` pages; it then answers a 512-token prompt (at most half the context) and
decodes 32 tokens at batch 1 and 4, so that every function has run once and the memory a call
takes has been taken. Reported per build: the parameter file's bytes, the cache's, the process's
resident memory (anonymous and file-backed) after load and after the calls, and resident memory
less the cache and the process's own before loading, against 1.15 x parameters + 300 MiB.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

MiB = 2**20


def resident() -> dict[str, float]:
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status if ":" in line)
    return {key: int(fields[key].split()[0]) / 1024 for key in ("VmRSS", "RssAnon", "RssFile")}


def measure(artifacts: Path, pages: int) -> dict:
    """In this process: load, run each kind of call, and read the memory."""
    import numpy as np
    from kiln.runtime import LLM, SamplingParams
    from kiln.runtime.contract import Artifacts

    before = resident()
    with LLM(artifacts, "cpu", prefix_sharing="none", page_count=pages) as llm:
        loaded = resident()
        service = llm.service
        cache_bytes = service.pool.buffer_pages * service.program.page_elems * service.program.cache_dtype.itemsize
        rng = np.random.default_rng(0)
        greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
        prompt = min(512, service.program.params.max_seq_len // 2)  # the tiny test model's context is 256
        llm.generate([list(rng.integers(300, service.vocab_size - 1, prompt))], greedy)
        for batch in (1, 4):
            llm.generate([list(rng.integers(300, service.vocab_size - 1, 64)) for _ in range(batch)], greedy)
        ran = resident()
    parameters = Artifacts.in_directory(artifacts).params.stat().st_size
    used = ran["VmRSS"] - before["VmRSS"] - cache_bytes / MiB
    return {"artifacts": str(artifacts), "parameters_mib": parameters / MiB, "kv_cache_mib": cache_bytes / MiB,
            "before_load": before, "after_load": loaded, "after_calls": ran,
            "resident_less_cache_mib": used, "target_mib": 1.15 * parameters / MiB + 300,
            "ratio_to_parameters": used / (parameters / MiB)}


def serve_build(model: Path | None = None, quantize: str = "auto") -> Path:
    """`kiln serve --quantize`'s build of `model` (None: the bundled one), in Kiln's keyed cache:
    built once."""
    from benchmarks.kiln_offline import build_in_child

    return build_in_child(f"default_build_options(quantize={quantize!r})", model=model)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", nargs="*", type=Path)
    parser.add_argument("--model", action="append", type=Path, default=[], help="a model file or directory")
    parser.add_argument("--quantize", action="append", default=[],
                        help="the bundled model as `kiln serve --quantize Q` builds it (bf16, int8, q8_0, none, ...)")
    parser.add_argument("--pages", type=int, default=1024, help="the KV cache's pages (default: the default build's)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # the child's job
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.pages)))
        return 0
    rows = []
    builds = [*args.artifacts, *map(serve_build, args.model),
              *(serve_build(None, quantize) for quantize in args.quantize)]
    for artifacts in builds or [serve_build()]:
        done = subprocess.run([sys.executable, "-m", "benchmarks.memory_bench", "--measure", str(artifacts),
                               "--pages", str(args.pages)], check=True, stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parent.parent)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print("| build | parameters | KV cache | resident after load | after calls | resident - cache | target |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {Path(row['artifacts']).name} | {row['parameters_mib']:,.0f} MiB | {row['kv_cache_mib']:,.0f} MiB "
              f"| {row['after_load']['VmRSS']:,.0f} MiB | {row['after_calls']['VmRSS']:,.0f} MiB "
              f"| {row['resident_less_cache_mib']:,.0f} MiB ({row['ratio_to_parameters']:.2f}x) "
              f"| {row['target_mib']:,.0f} MiB |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
