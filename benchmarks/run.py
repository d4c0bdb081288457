"""Every figure of the performance issue in one run: Kiln beside its peers, same machine,
same model (SmolLM2-135M-Instruct), same moment.

    python -m benchmarks.run                       # everything (peers set up on first use)
    python -m benchmarks.run --steps offline       # a part: membw, offline, precision, fixed, serving, paired, prefix, runtimes
    python -m benchmarks.run --engines kiln        # Kiln only (no peers)

Writes benchmarks/results/<date>.json, PNG plots beside it (stable names, so the links in
benchmarks/README.md always show the latest run) and that page's tables between its bench markers.
Ratios are what to quote: absolute times drift on a shared machine. Never run by CI.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

from benchmarks import fixed_decode_bench, kiln_offline, membw, precision_bench, report
from benchmarks.peers.common import free_port, heavy_lock, log, stop_process, wait_http

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent
ALL_STEPS = ("membw", "offline", "precision", "fixed", "serving", "paired", "prefix", "runtimes")
ALL_ENGINES = ("kiln", "llama.cpp", "transformers", "shortfin")
SLOW_ENGINES = ("shortfin",)
PAIRED_CONCURRENCY = 16  # the serving target's load
# The paired step's default: each weight precision beside llama.cpp's server on the matching
# GGUF (Kiln's bf16 weights beside llama.cpp's BF16; q4_1 is the bundled file, as `kiln serve`
# runs it with no flags).
DEFAULT_PAIRS = "kiln f32,llama.cpp f32;kiln bf16w,llama.cpp bf16;kiln q8_0,llama.cpp q8_0;kiln q4_1,llama.cpp q4_1"


# -- servers ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _serving(proc: subprocess.Popen, port: int, backend: str):
    """Wait for a started server's /health, yield (backend, base_url), always stop it."""
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 300, proc)
        yield backend, f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc)


def kiln_server(dtype: str = "float32", prefix_sharing: str = "trie", quantize: str = "none",
                artifacts: Path | None = None):
    """`kiln serve` on the artifacts `kiln serve --dtype --quantize` builds by default (or on
    `artifacts`, another model's build)."""
    artifacts = artifacts or kiln_offline.build_artifacts(dtype, quantize)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln.cli.main", "serve", "--artifacts", str(artifacts), "--port", str(port),
         "--no-access-log", "--log-level", "warning", "--prefix-sharing", prefix_sharing],
        cwd=REPO,
    )
    return _serving(proc, port, "openai")


def llamacpp_server(dtype: str = "f32", parallel: int = 16, model: Path | None = None):
    """llama-server on the bundled model's GGUF of `dtype` (or on the GGUF file `model`)."""
    from benchmarks.peers import llamacpp

    port = free_port()
    return _serving(llamacpp.start_server(dtype, port, parallel=parallel, model=model), port, "openai")


def shortfin_server():
    from benchmarks.peers import shortfin

    peer = shortfin.setup()
    port = free_port()
    return _serving(shortfin.start_server(peer, port), port, "shortfin")


SERVERS = {
    "kiln f32": lambda: kiln_server("float32"),
    "kiln f16": lambda: kiln_server("float16"),
    "kiln bf16w": lambda: kiln_server("float32", quantize="bf16"),
    "kiln int8": lambda: kiln_server("float32", quantize="int8"),
    "kiln q8_0": lambda: kiln_server("float32", quantize="q8_0"),
    "kiln q4_1": lambda: kiln_server("float32", quantize="auto"),  # `kiln serve` with no flags
    "llama.cpp f32": lambda: llamacpp_server("f32"),
    "llama.cpp f16": lambda: llamacpp_server("f16"),
    "llama.cpp bf16": lambda: llamacpp_server("bf16"),
    "llama.cpp q8_0": lambda: llamacpp_server("q8_0"),
    "llama.cpp q4_1": lambda: llamacpp_server("q4_1"),  # the bundled file
    "shortfin f32": shortfin_server,
}
# The serving step's default: each engine at its float widths (the narrow weights' servers are
# compared in the paired step, e.g. --paired "kiln q8_0,llama.cpp q8_0").
DEFAULT_SERVERS = ("kiln f32", "kiln f16", "llama.cpp f32", "llama.cpp f16", "shortfin f32")


# -- steps --------------------------------------------------------------------------------------


def step_membw(results: dict, args) -> None:
    results["membw"] = membw.measure()
    log(f"memory bandwidth: read {results['membw']['read_gb_s']:.1f} GB/s")


def step_offline(results: dict, args) -> None:
    rows = results.setdefault("offline", [])
    jobs = []
    if "kiln" in args.engines:
        jobs += [("kiln f32", lambda: kiln_offline.run("float32")), ("kiln f16", lambda: kiln_offline.run("float16")),
                 ("kiln bf16w", lambda: kiln_offline.run("float32", "bf16")),
                 ("kiln int8", lambda: kiln_offline.run("float32", "int8")),
                 ("kiln q8_0", lambda: kiln_offline.run("float32", "q8_0")),
                 ("kiln q4_1", lambda: kiln_offline.run("float32", "auto"))]
    if "llama.cpp" in args.engines:
        from benchmarks.peers import llamacpp

        jobs += [(f"llama.cpp {dtype}", lambda dtype=dtype: llamacpp.offline(dtype)) for dtype in ("f32", "f16", "bf16", "q8_0", "q4_1")]
    if "transformers" in args.engines:
        from benchmarks.peers import transformers_peer

        jobs += [("transformers f32", transformers_peer.offline)]
    # Rounds alternate the order (forward, backward, ...) and each figure keeps its best
    # round, so a slow spell of the shared machine cannot land on one engine only.
    measured: dict[str, list[dict]] = {name: [] for name, _ in jobs}
    for round_index in range(args.offline_rounds):
        for name, job in jobs if round_index % 2 == 0 else jobs[::-1]:
            log(f"offline: {name} (round {round_index + 1} of {args.offline_rounds})")
            measured[name].append(_guarded(name, job))
    for name, _ in jobs:
        row = best_of_rounds(measured[name])
        # A re-run on the same day replaces that engine's row.
        rows[:] = [r for r in rows if f"{r.get('engine')} {r.get('dtype')}" != name] + [row]
    if "membw" in results:
        weights = _weight_bytes()
        results["floor"] = {
            dtype: membw.decode_floor(n, results["membw"]["read_gb_s"]) for dtype, n in weights.items()
        }


def step_precision(results: dict, args) -> None:
    """Each weight precision's compiled calls in paired rounds, beside llama.cpp's
    llama-batched-bench on the matching GGUF when llama.cpp takes part
    (benchmarks/precision_bench.py): the decode and prefill targets at every precision."""
    if "kiln" not in args.engines or args.precision_rounds < 1:
        return
    artifacts = {}
    for name in args.precisions:
        log(f"precision: building SmolLM2 with {name} weights")
        artifacts[name] = precision_bench.build(**precision_bench.PRECISIONS[name])
    results["precision"] = precision_bench.measure(artifacts, args.precision_rounds, "llama.cpp" in args.engines)


def step_fixed(results: dict, args) -> None:
    """Each decode through its fixed-shape function against decode_bs<N>, in alternating pairs in
    one program (benchmarks/fixed_decode_bench.py): what recording the command buffer once is worth."""
    if "kiln" not in args.engines or args.fixed_pairs < 1:
        return
    results["fixed_decode"] = fixed_decode_bench.measure(fixed_decode_bench.DEFAULT_PRECISIONS, args.fixed_pairs)


def best_of_rounds(rounds: list[dict]) -> dict:
    """One row from several rounds of one engine: the highest tokens/s, the lowest ms."""
    good = [r for r in rounds if "error" not in r]
    if not good:
        return rounds[-1]
    row = dict(good[-1])
    for key in row:
        values = [r[key] for r in good if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
        if values and key.endswith("_tok_s"):
            row[key] = max(values)
        elif values and key.endswith("_ms"):
            row[key] = min(values)
    row["rounds"] = len(good)
    # Every round's figures, so the spread the best hides stays on record.
    row["round_figures"] = [
        {key: value for key, value in r.items() if key.endswith(("_tok_s", "_ms")) and isinstance(value, (int, float))}
        for r in good
    ]
    return row


def _weight_bytes() -> dict[str, int]:
    """Bytes a batch-1 decode step must read: every parameter once (a tied embedding is read
    whole by the output projection), at 4 bytes (f32), 2 (f16, bf16), or 1 and a scale per 32
    (Q8_0, Kiln's and llama.cpp's; Kiln's int8 has one per row, about 1 byte)."""
    from kiln.runtime.config import ModelParams  # noqa: F401  (the runtime's view of the export)
    from benchmarks.peers import weights

    config = json.loads((weights.hf_dir() / "config.json").read_text())
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    layers, heads, kv = config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]
    d = h // heads
    per_layer = h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * i + 2 * h
    params = layers * per_layer + v * h + h
    return {"f32": params * 4, "f16": params * 2, "bf16": params * 2, "q8_0": params * 34 // 32}


def step_serving(results: dict, args) -> None:
    from benchmarks import guidellm_runner, loadgen

    out = results.setdefault("serving", {})
    for name in args.servers:
        engine = name.split()[0]
        if engine not in args.engines:
            continue
        log(f"serving: {name}")
        runs = []
        try:
            with SERVERS[name]() as (backend, url):
                tokenizer = _tokenizer_for_loadgen()
                # shortfin serves ~5 tokens/s here: one request per slot per concurrency,
                # and no rate sweep (24 requests per rate would take ~10 minutes each).
                slow = engine in SLOW_ENGINES
                for concurrency in args.concurrency:
                    count = max(4, concurrency) if slow else int(max(8, 2 * concurrency) * args.scale)
                    workload = loadgen.make_workload("random", tokenizer, num_requests=count, seed=concurrency)
                    runs.append(loadgen.run(backend, url, workload, concurrency=concurrency))
                    _say(name, runs[-1])
                for index, rate in enumerate([] if slow else args.rates):
                    # A seed of its own per run: a server's prefix cache must not carry a
                    # previous run's prompts into this one.
                    workload = loadgen.make_workload("random", tokenizer, num_requests=int(24 * args.scale),
                                                     seed=100 + index)
                    runs.append(loadgen.run(backend, url, workload, rate=rate))
                    _say(name, runs[-1])
                if args.guidellm and backend == "openai":
                    # The well-kept load generator, as a cross-check of our client at
                    # the headline load (it keeps no per-gap ITL, so it is not the main series).
                    workload = loadgen.make_workload("random", tokenizer, num_requests=int(32 * args.scale), seed=200)
                    check = guidellm_runner.run(url, workload, concurrency=16)
                    results.setdefault("guidellm_check", {})[name] = check
                    _say(f"{name} (guidellm)", check)
        except Exception:  # one engine failing must not lose the others' figures
            runs.append({"error": traceback.format_exc(limit=3)})
            log(f"serving {name} failed:\n{runs[-1]['error']}")
        out[name] = runs


def step_paired(results: dict, args) -> None:
    """Each pair of servers at concurrency 16 in alternating rounds (A B, B A, ...), each round
    on the same fresh prompts, so a ratio pairs runs minutes apart rather than a sweep apart:
    the shared machine's speed drifts more than the gap being measured. A pair measured again
    replaces its earlier figures in the results file; the other pairs stay."""
    measured = []
    for pair in args.paired:
        names = [name for name in pair if name.split()[0] in args.engines]
        if len(names) == 2 and args.paired_rounds >= 1:
            measured.append(paired_summary(names, _paired_rounds(names, args)))
    if measured:
        kept = [p for p in report.paired_summaries(results) if p["engines"] not in [m["engines"] for m in measured]]
        results["paired"] = kept + measured


def _paired_rounds(names: list[str], args) -> list[dict]:
    return paired_rounds({name: SERVERS[name] for name in names}, args.paired_rounds, _tokenizer_for_loadgen(),
                         int(32 * args.scale))


def paired_rounds(servers: dict, rounds_wanted: int, tokenizer: Path, requests: int,
                  concurrency: int = PAIRED_CONCURRENCY) -> list[dict]:
    """`servers` (name: a function starting one, two of them) in alternating rounds on the
    `random` workload of `requests` requests at `concurrency`, each round's prompts new."""
    from benchmarks import loadgen

    names = list(servers)
    rounds = []
    for index in range(rounds_wanted):
        order = names if index % 2 == 0 else names[::-1]
        # A seed per round: each server process is new, but the prompts must not repeat.
        workload = loadgen.make_workload("random", tokenizer, num_requests=requests, seed=300 + index)
        figures = {}
        for name in order:
            log(f"paired c={concurrency}: {name} (round {index + 1} of {rounds_wanted})")
            try:
                with servers[name]() as (backend, url):
                    figures[name] = loadgen.run(backend, url, workload, concurrency=concurrency)
                _say(name, figures[name])
            except Exception:  # one engine failing must not lose the other's figures
                figures[name] = {"error": traceback.format_exc(limit=3)}
                log(f"paired {name} failed:\n{figures[name]['error']}")
        rounds.append({"order": order, "runs": figures})
    return rounds


def paired_summary(names: list[str], rounds: list[dict], concurrency: int = PAIRED_CONCURRENCY) -> dict:
    """Per-round figures and the ratio of the first engine to the second in each round
    where both completed requests; the median ratio is the one to quote."""
    ratios = []
    for entry in rounds:
        a, b = (entry["runs"].get(name, {}) for name in names)
        ok = all("error" not in r and r.get("completed") and r.get("output_throughput") for r in (a, b))
        entry["ratio"] = a["output_throughput"] / b["output_throughput"] if ok else None
        if ok:
            ratios.append(entry["ratio"])
    return {"engines": names, "concurrency": concurrency, "rounds": rounds,
            "median_ratio": statistics.median(ratios) if ratios else None, "paired_rounds": len(ratios)}


def step_prefix(results: dict, args) -> None:
    from benchmarks import loadgen

    out = results.setdefault("prefix", {})
    tokenizer = _tokenizer_for_loadgen()
    workload = loadgen.make_workload("shared_prefix", tokenizer, num_requests=32, seed=7)
    for sharing in ("trie", "none"):
        log(f"shared prefix: kiln --prefix-sharing {sharing}")
        with kiln_server("float32", sharing) as (backend, url):
            out[sharing] = loadgen.run(backend, url, workload, concurrency=4)
            _say(f"kiln {sharing}", out[sharing])


def _tokenizer_for_loadgen() -> Path:
    return kiln_offline.build_artifacts("float32") / "tokenizer.json"


def _say(name: str, metrics: dict) -> None:
    load = f"c={metrics['max_concurrency']}" if metrics.get("max_concurrency") else f"rate={metrics.get('request_rate')}"
    log(f"  {name} {load}: {metrics['output_throughput']:.1f} out tok/s, TTFT p50 "
        f"{(metrics.get('p50_ttft_ms') or 0):.0f} ms, failed {metrics['failed']}")


def _guarded(name: str, job) -> dict:
    started = time.monotonic()
    try:
        row = job()
    except Exception:
        row = {"engine": name.split()[0], "dtype": name.split()[1], "error": traceback.format_exc(limit=3)}
        log(f"{name} failed:\n{row['error']}")
    row["seconds"] = time.monotonic() - started
    return row


def step_runtimes(results: dict, args) -> None:
    """Same artifact, two runtimes: shortfin's own VMFB served by Kiln (IREE runtime 3.13,
    and Kiln's code over runtime 3.9, the VMFB's version), one greedy request each."""
    if "shortfin" not in args.engines:
        return
    from benchmarks.peers import shortfin

    log("same artifact, two runtimes: kiln serve on shortfin's VMFB")
    try:
        results["kiln_on_shortfin_vmfb"] = shortfin.kiln_on_shortfin_vmfb()
    except Exception:  # the peer failing must not lose the other figures
        results["kiln_on_shortfin_vmfb"] = {"error": traceback.format_exc(limit=3)}


STEPS = {"membw": step_membw, "offline": step_offline, "precision": step_precision, "fixed": step_fixed,
         "serving": step_serving, "paired": step_paired, "prefix": step_prefix, "runtimes": step_runtimes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default=",".join(ALL_STEPS))
    parser.add_argument("--engines", default=",".join(ALL_ENGINES))
    parser.add_argument("--servers", default=",".join(DEFAULT_SERVERS),
                        help=f"serving runs, e.g. 'kiln f32,shortfin f32'; any of: {', '.join(SERVERS)}")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--rates", default="0.5,1,2,4", help="Poisson request rates (req/s)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the request counts")
    parser.add_argument("--no-guidellm", dest="guidellm", action="store_false",
                        help="skip the guidellm cross-check at concurrency 16")
    parser.add_argument("--offline-rounds", type=int, default=2, help="offline rounds, in alternating order (best kept)")
    parser.add_argument("--precisions", default=",".join(precision_bench.DEFAULT_PRECISIONS),
                        help=f"the 'precision' step's weights, f32 among them; any of {', '.join(precision_bench.PRECISIONS)}")
    parser.add_argument("--precision-rounds", type=int, default=4, help="rounds of the 'precision' step")
    parser.add_argument("--fixed-pairs", type=int, default=300,
                        help="alternating pairs of the 'fixed' step, per precision and batch size")
    parser.add_argument("--paired", default=DEFAULT_PAIRS,
                        help="the 'paired' step's pairs of servers, alternated at concurrency 16: "
                        "'A,B' for one pair, pairs separated by ';'")
    parser.add_argument("--paired-rounds", type=int, default=3, help="rounds of the 'paired' step, per pair")
    parser.add_argument("--output", type=Path, help="results JSON (default: results/<date>.json)")
    args = parser.parse_args(argv)
    args.steps = [s for s in args.steps.split(",") if s]
    args.engines = [e for e in args.engines.split(",") if e]
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.rates = [float(r) for r in args.rates.split(",") if r]
    args.paired = [[s.strip() for s in pair.split(",") if s.strip()] for pair in args.paired.split(";") if pair.strip()]
    if any(len(pair) != 2 for pair in args.paired):
        parser.error("--paired takes pairs of two servers ('A,B', pairs separated by ';')")
    args.precisions = [p for p in args.precisions.split(",") if p]
    if "f32" not in args.precisions or not set(args.precisions) <= set(precision_bench.PRECISIONS):
        parser.error(f"--precisions takes f32 and any of {', '.join(precision_bench.PRECISIONS)}")
    paired_servers = [name for pair in args.paired for name in pair]
    unknown = [s for s in args.steps if s not in STEPS] + [s for s in args.servers + paired_servers if s not in SERVERS]
    if unknown:
        parser.error(f"unknown step/server: {', '.join(unknown)}")

    today = datetime.date.today().isoformat()
    output = args.output or RESULTS_DIR / f"{today}.json"
    results = json.loads(output.read_text()) if output.exists() else {}
    results.update({
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version()},
        "model": "SmolLM2-135M-Instruct (bundled Q4_1 GGUF, dequantized; the same weights for every engine)",
    })
    with heavy_lock():
        for step in args.steps:
            STEPS[step](results, args)
            output.parent.mkdir(parents=True, exist_ok=True)
            output.write_text(json.dumps(results, indent=2) + "\n")  # keep what is done so far
    report.write_all(results, RESULTS_DIR, report.README)
    print(report.tables(results))
    log(f"saved {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
