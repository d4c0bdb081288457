"""A large model from file to served tokens, each step timed and its memory measured, beside llama.cpp
on the same file.

    python -m benchmarks.scale_bench --model FILE
    python -m benchmarks.scale_bench --synthetic llama-3.1-8b [--type Q4_0|Q8_0|BF16] [--dir DIR]
    python -m benchmarks.scale_bench --first-serve [--model FILE]

With `--synthetic`, the file is first written with that model's shapes and random weights
(benchmarks/synthetic_gguf.py); with `--type BF16`, a Hugging Face directory of bf16 safetensors
(benchmarks/synthetic_hf.py), which Kiln builds from, and for llama.cpp, which reads GGUFs only, a
BF16 GGUF of the same shapes and random values (written once Kiln's build is measured, its build
removed first if the disk lacks room for both). Then, each in a process of its own, one after the other:
- the export `kiln serve --model FILE` makes (its default build options), then its compile for this
  CPU: wall time and the peak resident memory of the process tree (and the anonymous part of it,
  the rest being the file's pages the system may drop), against 1.5 x the file;
- the built model loaded as the server loads it (no torch): load time, a 128-token prefill and 32
  greedy decode steps at batch 1, resident memory after them less the KV cache, against
  1.15 x the parameters + 300 MiB;
- `kiln serve --artifacts DIR`: seconds until /health answers 200, and its resident memory then;
- llama.cpp on the same file (llama-cpp-python, 2 threads): load, the same prefill and decode.
Figures go to results/scale-<file stem>-<date>.json.

`--first-serve` measures a new user's first `kiln serve [--model FILE]` instead (the bundled model
without --model), with a cache directory of its own and empty: seconds until /health answers 200,
the build included, and the peak resident memory of the server's process tree meanwhile (resident,
anonymous, proportional), and the proportional peak of the build's processes alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import date
from pathlib import Path

from benchmarks.peers import llamacpp
from benchmarks.peers.common import free_port, heavy_lock, log, wait_http

HERE = Path(__file__).resolve().parent.parent
MiB = 2**20
PROMPT, STEPS = 128, 32


def _tree(pid: int) -> list[int]:
    """`pid` and every process below it, whichever of its threads started each (a server builds
    from a thread of its own)."""
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += (task / "children").read_text().split()
        except OSError:
            pass
    return [pid, *(p for child in children for p in _tree(int(child)))]


def _resident(pid: int) -> tuple[float, float]:
    """(VmRSS, RssAnon) of one process in MiB; zeros once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            fields = dict(line.split(":", 1) for line in status if ":" in line)
        return int(fields["VmRSS"].split()[0]) / 1024, int(fields["RssAnon"].split()[0]) / 1024
    except (OSError, KeyError):
        return 0.0, 0.0


def _proportional(pid: int) -> float:
    """Pss of one process in MiB: each page it shares counted as its share (a forked tracing
    process shares its parent's pages, which summing resident sizes counts twice)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            fields = dict(line.split(":", 1) for line in rollup if ":" in line)
        return int(fields["Pss"].split()[0]) / 1024
    except (OSError, KeyError):
        return 0.0


def run_watched(argv: list[str]) -> dict:
    """Run `argv` to its end: its wall time, the peak resident memory of its process tree (all of it,
    the anonymous part, and the proportional sum: shared pages once), and what it printed last on stdout."""
    started = time.monotonic()
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=HERE)
    peak_rss = peak_anon = peak_pss = 0.0
    while process.poll() is None:
        tree = _tree(process.pid)
        figures = [_resident(pid) for pid in tree]
        peak_rss = max(peak_rss, sum(rss for rss, _ in figures))
        peak_anon = max(peak_anon, sum(anon for _, anon in figures))
        peak_pss = max(peak_pss, sum(_proportional(pid) for pid in tree))
        time.sleep(0.2)
    out = process.stdout.read()
    if process.returncode:
        raise RuntimeError(f"{argv[:4]} failed with {process.returncode}")
    return {"seconds": round(time.monotonic() - started, 1), "peak_rss_mib": round(peak_rss),
            "peak_anon_mib": round(peak_anon), "peak_pss_mib": round(peak_pss),
            "last_line": out.strip().splitlines()[-1] if out.strip() else ""}


def _bytes(path: Path) -> int:
    """A file's size, or a directory's files' sizes summed."""
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def export_step(model: Path, output: Path) -> dict:
    """`kiln serve --model`'s export of `model` (its default build options) into `output`."""
    code = ("import sys\nfrom pathlib import Path\nfrom kiln.export.build import build, default_build_options\n"
            f"build(Path({str(model)!r}), default_build_options(), [], output_dir=Path({str(output)!r}), "
            "log=lambda m: print(m, file=sys.stderr, flush=True))\n")
    return run_watched([sys.executable, "-c", code])


def compile_step(output: Path) -> dict:
    """The export in `output` compiled for this CPU, as `kiln serve` compiles it."""
    code = ("import sys\nfrom pathlib import Path\nfrom kiln.export.compile import compile_vmfb\n"
            "from kiln.runtime.contract import vmfb_file\n"
            f"out = Path({str(output)!r})\n"
            "compile_vmfb(out / 'model.mlir', out / vmfb_file('cpu'), 'cpu', None, None, "
            "log=lambda m: print(m, file=sys.stderr, flush=True))\n")
    return run_watched([sys.executable, "-c", code])


def measure(artifacts: Path) -> dict:
    """In this process (no torch): load the build as the server does, then time a prefill and decode
    steps at batch 1, reading resident memory after each."""
    import numpy as np

    from benchmarks.memory_bench import resident
    from kiln.runtime import LLM, SamplingParams
    from kiln.runtime.contract import Artifacts

    before = resident()
    started = time.perf_counter()
    with LLM(artifacts, "cpu", prefix_sharing="none") as llm:
        load_s = time.perf_counter() - started
        loaded = resident()
        program = llm.service.program
        cache_mib = llm.service.pool.buffer_pages * program.page_elems * program.cache_dtype.itemsize / MiB
        rng = np.random.default_rng(0)
        prompt = rng.integers(300, min(llm.service.vocab_size, 32000), PROMPT).tolist()

        def timed(ids, tokens) -> float:
            start = time.perf_counter()
            llm.generate([ids], SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
            return time.perf_counter() - start

        timed(prompt[:16], 2)  # every function's first call
        prefill = timed(prompt, 1)
        decode = timed(prompt, STEPS + 1) - prefill
        ran = resident()
    parameters = Artifacts.in_directory(artifacts).params.stat().st_size / MiB
    used = ran["VmRSS"] - before["VmRSS"] - cache_mib
    return {"load_s": round(load_s, 2), f"prefill_{PROMPT}_ms": round(prefill * 1e3, 1),
            "decode_bs1_tok_s": round(STEPS / decode, 3), "parameters_mib": round(parameters),
            "kv_cache_mib": round(cache_mib), "after_load": loaded, "after_calls": ran,
            "resident_less_cache_mib": round(used), "target_mib": round(1.15 * parameters + 300)}


def serve_ready(artifacts: Path) -> dict:
    """`kiln serve --artifacts`: seconds until /health answers 200, and its resident memory then."""
    port = free_port()
    started = time.monotonic()
    server = subprocess.Popen([sys.executable, "-m", "kiln.cli.main", "serve", "--artifacts", str(artifacts),
                               "--port", str(port)], cwd=HERE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 900, server)
        ready = time.monotonic() - started
        rss, anon = _resident(server.pid)
    finally:
        server.terminate()
        server.wait(60)
    return {"health_s": round(ready, 1), "rss_mib": round(rss), "anon_mib": round(anon)}


def first_serve(model: Path | None) -> dict:
    """`kiln serve [--model FILE]` over an empty cache: seconds to /health 200 and the tree's peak memory."""
    port = free_port()
    argv = [sys.executable, "-m", "kiln.cli.main", "serve", "--port", str(port), *(["--model", str(model)] if model else [])]
    with tempfile.TemporaryDirectory(prefix="kiln-first-serve-") as cache:
        with open(Path(cache) / "serve.log", "w") as server_log:
            started = time.monotonic()
            server = subprocess.Popen(argv, cwd=HERE, env=os.environ | {"KILN_CACHE_DIR": cache},
                                      stdout=server_log, stderr=subprocess.STDOUT)
            peak_rss = peak_anon = peak_pss = build_pss = 0.0
            polled = 0.0
            try:
                while True:
                    if server.poll() is not None:
                        raise RuntimeError(f"kiln serve exited with {server.returncode}: "
                                           + (Path(cache) / "serve.log").read_text()[-2000:])
                    tree = _tree(server.pid)
                    figures = [_resident(pid) for pid in tree]
                    peak_rss = max(peak_rss, sum(rss for rss, _ in figures))
                    peak_anon = max(peak_anon, sum(anon for _, anon in figures))
                    shares = [_proportional(pid) for pid in tree]
                    peak_pss = max(peak_pss, sum(shares))
                    build_pss = max(build_pss, sum(shares[1:]))  # the build's processes, the server's own aside
                    if time.monotonic() - polled > 1:
                        polled = time.monotonic()
                        try:
                            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as answer:
                                if answer.status == 200:
                                    break
                        except OSError:
                            pass
                    time.sleep(0.2)
                ready = time.monotonic() - started
            finally:
                server.terminate()
                server.wait(60)
        steps = [line.strip() for line in (Path(cache) / "serve.log").read_text().splitlines()
                 if " in " in line and ("wrote" in line or "compiled" in line or "built" in line)]
    return {"model": str(model) if model else "bundled SmolLM2-135M-Instruct", "health_s": round(ready, 1),
            "peak_rss_mib": round(peak_rss), "peak_anon_mib": round(peak_anon), "peak_pss_mib": round(peak_pss),
            "build_peak_pss_mib": round(build_pss), "steps": steps}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", type=Path, help="a GGUF file")
    source.add_argument("--synthetic", help="write a GGUF of these shapes first (benchmarks/synthetic_gguf.py)")
    parser.add_argument("--type", default="Q4_0", choices=("Q4_0", "Q8_0", "BF16"),
                        help="the synthetic file's weight type (BF16: a Hugging Face directory)")
    parser.add_argument("--dir", type=Path, default=Path("."), help="where the synthetic file goes")
    parser.add_argument("--build-dir", type=Path, help="where the build goes (default: <file stem>-kiln beside it)")
    parser.add_argument("--no-llama-cpp", action="store_true", help="Kiln alone")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--first-serve", action="store_true", help="time a first `kiln serve` (the build included)")
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # the child's part
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return 0
    if args.first_serve:
        if args.synthetic:
            parser.error("--first-serve takes --model FILE or nothing (the bundled model)")
        with heavy_lock():
            result = {"date": date.today().isoformat(), "cpus": os.cpu_count(),
                      "first_serve": first_serve(args.model.resolve() if args.model else None)}
        stem = args.model.stem.lower() if args.model else "smollm2-135m-instruct"
        output = args.output or HERE / "benchmarks" / "results" / f"first-serve-{stem}-{result['date']}.json"
        output.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
        return 0
    if not (args.model or args.synthetic):
        parser.error("--model or --synthetic is required")

    result: dict = {"date": date.today().isoformat(), "cpus": os.cpu_count()}
    with heavy_lock():
        if args.synthetic:
            from benchmarks import synthetic_gguf, synthetic_hf

            shapes = synthetic_gguf.SHAPES[args.synthetic]
            if args.type == "BF16":
                model = args.dir / f"{args.synthetic}-synthetic-bf16"
            else:
                model = args.dir / f"{args.synthetic}-synthetic-{args.type.lower()}.gguf"
            if not model.exists():
                started = time.monotonic()
                if args.type == "BF16":
                    synthetic_hf.write(model, shapes, log=log)
                else:
                    synthetic_gguf.write(model, shapes, args.type, log=log)
                result["write_s"] = round(time.monotonic() - started, 1)
        else:
            model = args.model
        model = model.resolve()
        file_mib = _bytes(model) / MiB
        result |= {"model": str(model), "file_mib": round(file_mib), "build_target_mib": round(1.5 * file_mib)}
        stem = model.name if model.is_dir() else model.stem
        artifacts = args.build_dir or model.with_name(f"{stem}-kiln")
        log(f"exporting {model.name} into {artifacts}")
        result["export"] = export_step(model, artifacts)
        result["export"].pop("last_line")
        log(f"export: {result['export']}")
        result["compile"] = compile_step(artifacts)
        result["compile"].pop("last_line")
        log(f"compile: {result['compile']}")
        done = run_watched([sys.executable, "-m", "benchmarks.scale_bench", "--measure", str(artifacts)])
        result["kiln"] = json.loads(done.pop("last_line")) | {"peak_rss_mib": done["peak_rss_mib"]}
        log(f"kiln: {result['kiln']}")
        result["serve"] = serve_ready(artifacts)
        log(f"serve: {result['serve']}")
        if not args.no_llama_cpp:
            gguf = model
            if model.is_dir():  # llama.cpp reads GGUFs: the same shapes and values as a BF16 GGUF
                gguf = model.with_name(model.name + ".gguf")
                if not gguf.exists():
                    if shutil.disk_usage(model.parent).free < _bytes(model) + 2**30:
                        log(f"removing {artifacts} to make room for {gguf.name}")
                        shutil.rmtree(artifacts)
                    synthetic_gguf.write(gguf, shapes, "BF16", log=log)
            done = run_watched([str(llamacpp.python()), str(llamacpp.BENCH_SCRIPT), "scale", str(gguf)])
            result["llama.cpp"] = json.loads(done.pop("last_line")) | {"peak_rss_mib": done["peak_rss_mib"],
                                                                      "llama_cpp_python": llamacpp.VERSION}
            log(f"llama.cpp: {result['llama.cpp']}")
    output = args.output or HERE / "benchmarks" / "results" / f"scale-{stem.lower()}-{result['date']}.json"
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
