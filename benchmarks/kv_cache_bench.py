"""What the byte KV caches (`--kv-cache-dtype int8`, `fp8_e4m3`) cost and save against the float32
cache, on the bundled SmolLM2 as `kiln serve` builds it (Q4_1 weights, Kiln's CPU kernels):

    python -m benchmarks.kv_cache_bench [--rounds 2] [--caches int8,fp8_e4m3] [--output FILE]

- cache bytes per token, from each build's page size;
- mean log-probability of 2,048 tokens of English prose (this repository's docs, the prompt's own
  tokens scored as the model reads them, prefilled in the server's chunks so later chunks read
  the earlier ones' cached K and V), and the relative change;
- decode tokens/s at 4,000 tokens of context, batch 1 and 4 (64 tokens each, greedy), counted
  from the moment every row has its first token, in rounds whose order alternates; the ratios are
  what to quote.

Each build is measured in its own process (no torch in it). Results go to
results/kv-cache-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

from benchmarks.kiln_offline import build_in_child

# Each cache's `--kv-cache-dtype` ("": the model's own float32, the build the tests share); every
# run measures the float32 cache beside the byte caches it is asked for.
CACHES = {"float32": "", "int8": "int8", "fp8_e4m3": "fp8_e4m3"}
SCORED_TOKENS, CONTEXT, TOKENS, BATCHES = 2048, 4000, 64, (1, 4)
HERE = Path(__file__).resolve().parent.parent


def prose() -> str:
    """English text for the log-probability: the repository's own docs, in a fixed order."""
    return "\n\n".join(path.read_text() for path in sorted((HERE / "docs").glob("*.md")))


def mean_logprob(llm, tokens: int = SCORED_TOKENS) -> float:
    """The mean log-probability the model gives each of the first `tokens` of prose() after the first."""
    from kiln.runtime import SamplingParams

    ids = llm.service.encode(prose(), False)[:tokens]
    if len(ids) < tokens:
        raise SystemExit(f"the docs hold {len(ids)} tokens, fewer than {tokens}")
    [first] = list(llm.stream(ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)))[:1]
    scored = [entry.logprob for entry in first.prompt_logprobs if entry is not None]
    return float(np.mean(scored))


def decode_tok_s(llm, batch: int, context: int = CONTEXT, tokens: int = TOKENS, vocab: int = 30000) -> float:
    """Tokens/s of `batch` rows of random ids below `vocab` decoding `tokens` each together at
    `context` tokens of context: the tokens that arrive after every row's first one, over the
    time they take (no prefill in the window)."""
    import asyncio

    from kiln.runtime import SamplingParams

    rng = np.random.default_rng(batch)
    prompts = [rng.integers(4, vocab, context).tolist() for _ in range(batch)]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)

    async def arrivals(ids: list[int]) -> list[float]:
        return [time.perf_counter() async for event in llm.service.generate(ids, params) if event.token_ids]

    async def run() -> list[list[float]]:
        return list(await asyncio.gather(*(arrivals(ids) for ids in prompts)))

    llm._call(run())  # warm-up
    times = llm._call(run())
    start = max(row[0] for row in times)
    later = [t for row in times for t in row if t > start]
    return len(later) / (max(later) - start)


def measure(artifacts: Path, what: str) -> float:
    """One figure of one build, in this process: "logprob" or "decode<batch>"."""
    from kiln.runtime import LLM

    # The build's 1,024 pages hold 4 rows of 4,064 tokens; no prefix reuse between timed calls.
    with LLM(artifacts, prefix_sharing="none") as llm:
        return mean_logprob(llm) if what == "logprob" else decode_tok_s(llm, int(what.removeprefix("decode")))


def page_bytes(artifacts: Path) -> int:
    from kiln.runtime.config import load_model_config

    return load_model_config(artifacts / "model.json")[0].page_bytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--caches", default="int8,fp8_e4m3", help="the byte caches to measure, comma-separated")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)  # artifacts, what: a child's part
    args = parser.parse_args()
    if args.measure:
        print(json.dumps({"value": measure(Path(args.measure[0]), args.measure[1])}))
        return 0
    caches = ["float32", *args.caches.split(",")]
    if unknown := set(caches) - set(CACHES):
        parser.error(f"unknown caches {sorted(unknown)}: choose from {', '.join(list(CACHES)[1:])}")
    builds = {cache: build_in_child(f"replace(default_build_options(), kv_cache_dtype={CACHES[cache]!r})")
              for cache in caches}
    byte_caches = caches[1:]

    def child(cache: str, what: str) -> float:
        done = subprocess.run([sys.executable, "-m", "benchmarks.kv_cache_bench", "--measure", str(builds[cache]),
                               what], check=True, stdout=subprocess.PIPE, text=True, cwd=HERE)
        return json.loads(done.stdout.strip().splitlines()[-1])["value"]

    stride = 16
    result: dict = {"context": CONTEXT, "tokens": TOKENS, "scored_tokens": SCORED_TOKENS,
                    "bytes_per_token": {cache: page_bytes(builds[cache]) / stride for cache in caches}}
    per_token = result["bytes_per_token"]
    result["bytes_ratio"] = {cache: round(per_token[cache] / per_token["float32"], 4) for cache in byte_caches}
    logprobs = {cache: child(cache, "logprob") for cache in caches}
    result["mean_logprob"] = {cache: round(value, 5) for cache, value in logprobs.items()}
    result["mean_logprob_change"] = {cache: round(abs(logprobs[cache] / logprobs["float32"] - 1), 5)
                                     for cache in byte_caches}
    decode: dict[str, dict[str, list[float]]] = {f"batch {b}": {cache: [] for cache in caches} for b in BATCHES}
    for index in range(args.rounds):
        for batch in BATCHES:
            for cache in (caches if index % 2 == 0 else caches[::-1]):
                decode[f"batch {batch}"][cache].append(round(child(cache, f"decode{batch}"), 1))
    result["decode_tok_s"] = decode
    result["decode_ratio_to_float32"] = {
        cache: {key: round(statistics.median(v[cache]) / statistics.median(v["float32"]), 3) for key, v in decode.items()}
        for cache in byte_caches}
    output = args.output or HERE / "benchmarks" / "results" / f"kv-cache-{date.today().isoformat()}.json"
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
