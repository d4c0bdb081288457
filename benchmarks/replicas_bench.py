"""Data-parallel serving on Ray Serve, on SmolLM2-135M (float32), this machine's cores.

    python -m benchmarks.replicas_bench [--concurrency 16,64] [--skip-load]

1. Load: random 256-token prompts, 128 output tokens (ignore_eos, streamed) at each
   concurrency, against one plain `kiln serve` (both cores), one Ray replica (both cores)
   and two Ray replicas (one core each): output tokens/s and TTFT, with benchmarks.loadgen.
2. Routing: 8 distinct 512-token prefixes × 6 follow-ups of 32 tokens each (32 output
   tokens), shuffled, 4 at a time, to two replicas whose KV caches hold four prefixes but
   not eight, once with round-robin and once with cache-aware routing: the prefix hit rate
   and the prompt tokens prefilled (from each response's usage), TTFT p50/p90.

Two replicas on a 2-core machine do not add compute: the load figures show the cost of the
front and of splitting the cores; the routing figures are what show the router working.
Figures, not asserts; the JSON goes to benchmarks/results/replicas-<date>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks import loadgen
from benchmarks.kiln_offline import build_artifacts
from benchmarks.peers.common import free_port, heavy_lock, log, stop_process, wait_http

RESULTS_DIR = Path(__file__).parent / "results"
PREFIXES, FOLLOW_UPS, PREFIX_TOKENS, SUFFIX_TOKENS, OUTPUT_TOKENS = 8, 6, 512, 32, 32
# Per replica: four prefixes (33 pages each, with their suffix and output) and room to run, not eight.
ROUTING_PAGES = 4 * 36


@contextlib.contextmanager
def kiln(artifacts: Path, *options: str, timeout: float = 600):
    """A `kiln serve` with these options; yields its base URL, stopped (drained) at the end."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli.main", "serve", "--artifacts", str(artifacts),
                             "--port", str(port), "--no-access-log", "--log-level", "warning", *options],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout, proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc, grace=60)


SERVERS = {
    "one server (2 cores)": (),
    "Ray, 1 replica (2 cores)": ("--data-parallel", "1", "--replica-cpus", "2"),
    "Ray, 2 replicas (1 core each)": ("--data-parallel", "2", "--replica-cpus", "1"),
}


def step_load(artifacts: Path, concurrencies: list[int]) -> dict:
    out = {}
    for name, options in SERVERS.items():
        log(f"load: {name}")
        with kiln(artifacts, *options) as url:
            for concurrency in concurrencies:
                workload = loadgen.make_workload("random", artifacts / "tokenizer.json",
                                                 num_requests=2 * concurrency, seed=concurrency)
                metrics = loadgen.run("openai", url, workload, concurrency=concurrency)
                out.setdefault(name, {})[str(concurrency)] = metrics
                log(f"  c={concurrency}: {metrics['output_throughput']:.1f} out tok/s, "
                    f"TTFT p50 {metrics['p50_ttft_ms']:.0f} ms, {metrics['failed']} failed")
    return out


def routing_prompts(tokenizer: Path) -> list[str]:
    prompts = []
    for seed in range(PREFIXES):
        workload = loadgen.shared_prefix_workload(tokenizer, num_requests=FOLLOW_UPS, prefix_len=PREFIX_TOKENS,
                                                  suffix_len=SUFFIX_TOKENS, output_len=OUTPUT_TOKENS,
                                                  seed=100 + seed)
        prompts += workload.prompts
    random.Random(7).shuffle(prompts)
    return prompts


async def stream_completions(url: str, prompts: list, concurrency: int, max_tokens: int = OUTPUT_TOKENS) -> list[dict]:
    """Each prompt (text or token ids) streamed from /v1/completions, `concurrency` at a time,
    greedy: its TTFT, prompt and cached tokens (the usage's), text and replica."""
    gate = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, prompt) -> dict:
        async with gate:
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            started, ttft, usage, text = time.perf_counter(), None, None, ""
            async with client.stream("POST", url + "/v1/completions", json=body) as reply:
                replica = reply.headers.get("x-kiln-replica")
                async for line in reply.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    piece = event["choices"][0].get("text", "") if event.get("choices") else ""
                    if ttft is None and piece:
                        ttft = time.perf_counter() - started
                    text += piece
                    usage = event.get("usage") or usage
            return {"ttft_ms": 1000 * (ttft or 0.0), "prompt_tokens": usage["prompt_tokens"],
                    "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"], "replica": replica,
                    "text": text}

    async with httpx.AsyncClient(timeout=600) as client:
        return await asyncio.gather(*(one(client, p) for p in prompts))


def usage_summary(results: list[dict]) -> dict:
    ttfts = sorted(r["ttft_ms"] for r in results)
    prompt = sum(r["prompt_tokens"] for r in results)
    cached = sum(r["cached_tokens"] for r in results)
    per_replica: dict[str, int] = {}
    for r in results:
        per_replica[r["replica"]] = per_replica.get(r["replica"], 0) + 1
    return {"requests": len(results), "prefix_hit_rate": cached / prompt, "prompt_tokens": prompt,
            "prefill_tokens_computed": prompt - cached, "ttft_p50_ms": statistics.median(ttfts),
            "ttft_p90_ms": ttfts[int(0.9 * (len(ttfts) - 1))], "requests_per_replica": sorted(per_replica.values())}


def step_routing(artifacts: Path) -> dict:
    prompts = routing_prompts(artifacts / "tokenizer.json")
    out = {}
    for routing in ("round_robin", "cache_aware"):
        log(f"routing: {routing}")
        with kiln(artifacts, "--data-parallel", "2", "--replica-cpus", "1", "--routing", routing,
                  "--kv-cache-pages", str(ROUTING_PAGES)) as url:
            out[routing] = usage_summary(asyncio.run(stream_completions(url, prompts, concurrency=4)))
        log(f"  hit rate {out[routing]['prefix_hit_rate']:.1%}, prefilled {out[routing]['prefill_tokens_computed']}"
            f" tokens, TTFT p50 {out[routing]['ttft_p50_ms']:.0f} ms, p90 {out[routing]['ttft_p90_ms']:.0f} ms")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="16,64", help="concurrencies of the load step")
    parser.add_argument("--skip-load", action="store_true", help="only the routing step")
    args = parser.parse_args(argv)
    artifacts = build_artifacts("float32")
    path = RESULTS_DIR / f"replicas-{datetime.date.today().isoformat()}.json"
    results = json.loads(path.read_text()) if path.is_file() else {}  # a step run alone replaces its own
    results.update({"measured": datetime.datetime.now().isoformat(timespec="seconds"), "machine": platform.machine(),
                    "cpus": os.cpu_count(), "model": "SmolLM2-135M-Instruct float32"})
    with heavy_lock():
        if not args.skip_load:
            results["load"] = step_load(artifacts, [int(c) for c in args.concurrency.split(",")])
        results["routing"] = step_routing(artifacts)
    RESULTS_DIR.mkdir(exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
