"""Speculative decoding and structured output on SmolLM2-135M, each beside plain decoding.

    python -m benchmarks.decoding_bench [--repeats 3] [--quantize auto]

Speculative decoding (prompt lookup, k = 4 and 8): decode tokens/s on a workload that
repeats its input (a ~500-token paragraph to be written out again with its typos fixed)
and on random prompts (nothing to look up: the cost of trying), at 1 and 4 concurrent
requests, with the acceptance rate and tokens gained per verify call. Structured output:
milliseconds per token of a JSON-schema-constrained generation beside the same prompt
unconstrained. Greedy throughout; every run's tokens are checked against plain decoding's.
Figures, not asserts: ratios against plain decoding in the same run are what to quote.

    python -m benchmarks.decoding_bench --llamacpp

instead times one request at a time through Kiln (plain, lookup k=4 and 8) and through
llama.cpp's llama-server (the peer setup's build) plain and with its `ngram-simple` drafting.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.kiln_offline import _random_prompts, build_artifacts
from benchmarks.peers.common import heavy_lock

RESULTS_DIR = Path(__file__).parent / "results"
EDIT_TOKENS, RANDOM_TOKENS, RANDOM_PROMPT = 256, 128, 512
CONCURRENCY = (1, 2, 4)
LOOKUP_K = (4, 8)
PARAGRAPH = (
    "The old lighthouse stood at the edge of the cliff for more than a century, and in that time it had "
    "seen storms that tore the roofs from the houses in the village below and summers so calm that the sea "
    "looked like a sheet of glass. The keeper, a quiet man named Thomas, climbed the narrow stairs every "
    "evening to light the lamp, and every morning he wrote in his logbook what the weather had done during "
    "the night. He recorded the ships that passed, the direction of the wind, the height of the waves, and "
    "sometimes a few words about the birds that nested in the rocks. When the village children asked him "
    "why he wrote so much, he told them that the sea forgets everything, so someone has to remember. Over "
    "the years the logbooks filled a whole shelf, then a second one, and finally a cupboard in the room at "
    "the bottom of the tower. After Thomas retired, a historian from the university came to read them. She "
    "found that the notes described not only the weather but also the changes in the village: the new "
    "harbour wall, the first motor boats, the closing of the fish market, and the arrival of tourists who "
    "came to photograph the lighthouse itself. She spent two winters copying the pages, and the book she "
    "wrote about them became a small success. Visitors now come to see the tower and the cupboard full of "
    "logbooks, and the village has opened a museum in the old fish market. The lamp no longer needs a "
    "keeper, because it is switched on by a computer in a city far away, but the people of the village "
    "still say that the light looks different since Thomas stopped climbing the stairs. Some of them claim "
    "that on stormy nights they can see a figure standing at the window at the top of the tower, watching "
    "the ships and writing in a book that nobody has ever found."
)
EDIT_PROMPT = ("Here is a paragraph with a few typos.\n\n" + PARAGRAPH +
               "\n\nThe same paragraph, copied out again word for word with the typos fixed:\n\n")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "hobbies", "employed"],
}
STRUCTURED_PROMPT = "Describe a fictional person as a JSON object with their name, age, city, hobbies and job.\n"
STRUCTURED_TOKENS = 96


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def timed(llm, prompts, params, repeats: int) -> tuple[float, list[list[int]]]:
    """Median seconds of generating for `prompts` together, and the tokens generated."""
    llm.generate(prompts[:1], params)  # warm: first calls of each function
    times, outputs = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        results = llm.generate(prompts, params)
        times.append(time.perf_counter() - started)
        outputs = [r.completions[0].token_ids for r in results]
    return statistics.median(times), outputs


def speculative_figures(artifacts: Path, repeats: int) -> list[dict]:
    from kiln.runtime import LLM, SamplingParams, SpeculativeConfig

    rows = []
    with LLM(artifacts) as probe:
        vocab = probe.service.vocab_size
        edit_ids = probe.service.encode(EDIT_PROMPT)
    random_prompts = _random_prompts(max(CONCURRENCY), RANDOM_PROMPT, vocab, np.random.default_rng(0))
    workloads = {"edit (repeats its input)": ([edit_ids] * max(CONCURRENCY), EDIT_TOKENS),
                 "random prompts": (random_prompts, RANDOM_TOKENS)}
    # Drafting at every batch width (the server's default stops at 1 row): where it pays is the figure.
    configs = {"plain": None, **{f"prompt lookup k={k}": SpeculativeConfig("ngram", k, disable_by_batch_size=0)
                                 for k in LOOKUP_K}}
    plain: dict = {}
    for label, spec in configs.items():
        with LLM(artifacts, speculative=spec, prefix_sharing="none") as llm:
            for workload, (prompts, max_tokens) in workloads.items():
                params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
                for concurrency in CONCURRENCY:
                    before = _counters(llm)
                    seconds, outputs = timed(llm, prompts[:concurrency], params, repeats)
                    after = _counters(llm)
                    key = (workload, concurrency)
                    if spec is None:
                        plain[key] = (seconds, outputs)
                    drafted, accepted, drafts = (a - b for a, b in zip(after, before))
                    row = {"config": label, "workload": workload, "concurrency": concurrency,
                           "tokens_per_s": concurrency * max_tokens / seconds,
                           "speedup": plain[key][0] / seconds, "same_tokens": outputs == plain[key][1],
                           "acceptance": accepted / drafted if drafted else None,
                           "tokens_per_verify": 1 + accepted / drafts if drafts else None}
                    rows.append(row)
                    log(json.dumps(row))
    return rows


LLAMACPP_CONFIGS = {  # llama-server's own drafting: none, then its n-gram lookup (ngram-simple)
    "llama.cpp plain": [],
    "llama.cpp ngram-simple (defaults: n=12, m=48)": ["--spec-type", "ngram-simple"],
    "llama.cpp ngram-simple n=3, m=8": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                                        "--spec-ngram-simple-size-m", "8"],
}


def llamacpp_figures(artifacts: Path, repeats: int) -> list[dict]:
    """The same workloads, one request at a time, through llama.cpp's own server with and
    without its n-gram drafting (the same token ids in, greedy, prompt cache off)."""
    import subprocess

    import httpx

    from benchmarks.peers import llamacpp
    from benchmarks.peers.common import free_port
    from kiln.runtime import LLM

    with LLM(artifacts) as probe:
        vocab, edit_ids = probe.service.vocab_size, probe.service.encode(EDIT_PROMPT)
    workloads = {"edit (repeats its input)": (edit_ids, EDIT_TOKENS),
                 "random prompts": (_random_prompts(1, RANDOM_PROMPT, vocab, np.random.default_rng(0))[0],
                                    RANDOM_TOKENS)}
    if not llamacpp.binary("llama-server").exists():
        llamacpp.TARGETS[:] = ["llama-server"]  # only the server is needed here
        llamacpp._build_binaries()
    model = llamacpp.gguf("f32")
    rows, plain = [], {}
    for label, extra in LLAMACPP_CONFIGS.items():
        port = free_port()
        server = subprocess.Popen([str(llamacpp.binary("llama-server")), "-m", str(model), "--host", "127.0.0.1",
                                   "--port", str(port), "-t", "2", "-tb", "2", "--parallel", "1", "-c", "2048",
                                   "--no-webui", *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}"
            for _ in range(600):
                try:
                    if httpx.get(url + "/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            for workload, (ids, max_tokens) in workloads.items():
                body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0, "cache_prompt": False,
                        "ignore_eos": True}
                httpx.post(url + "/completion", json=body, timeout=600)  # warm
                times, tokens = [], None
                for _ in range(repeats):
                    started = time.perf_counter()
                    answer = httpx.post(url + "/completion", json=body, timeout=600).json()
                    times.append(time.perf_counter() - started)
                    tokens = answer.get("tokens") or answer["content"]
                seconds = statistics.median(times)
                key = workload
                if not extra:
                    plain[key] = (seconds, tokens)
                row = {"config": label, "workload": workload, "concurrency": 1,
                       "tokens_per_s": max_tokens / seconds, "speedup": plain[key][0] / seconds,
                       "same_tokens": tokens == plain[key][1]}
                rows.append(row)
                log(json.dumps(row))
        finally:
            server.terminate()
            server.wait(30)
    return rows


def _counters(llm) -> tuple[int, int, int]:
    counters = llm.service.stats().speculation
    return (0, 0, 0) if counters is None else (counters.draft_tokens, counters.accepted_tokens, counters.drafts)


def structured_figures(artifacts: Path, repeats: int) -> dict:
    from kiln.runtime import LLM, SamplingParams
    from kiln.runtime.grammar import Constraint

    with LLM(artifacts) as llm:
        prompt = [llm.service.encode(STRUCTURED_PROMPT)]
        constrained = SamplingParams(max_tokens=STRUCTURED_TOKENS, temperature=0,
                                     constraint=Constraint.of("json", SCHEMA, "response_format"))
        seconds, outputs = timed(llm, prompt, constrained, repeats)
        tokens = len(outputs[0])
        # The same number of tokens without the grammar: the per-token cost is what differs.
        free = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        free_seconds, _ = timed(llm, prompt, free, repeats)
        text = llm.service.decode(outputs[0])
    row = {"tokens": tokens, "constrained_ms_per_token": 1000 * seconds / tokens,
           "unconstrained_ms_per_token": 1000 * free_seconds / tokens, "overhead": seconds / free_seconds,
           "output_parses": _parses(text)}
    log(json.dumps(row))
    return row


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quantize", default="none",
                        help="the weights, as `kiln serve --quantize` takes them (default: none, float32; auto: the "
                        "bundled file's own Q4_1 blocks, what `kiln serve` runs with no flags)")
    parser.add_argument("--llamacpp", action="store_true",
                        help="instead: one request at a time, Kiln's prompt lookup beside llama.cpp's server with "
                        "and without its n-gram drafting (llama-server built and the GGUF converted first)")
    args = parser.parse_args()
    if args.llamacpp:
        global CONCURRENCY
        CONCURRENCY = (1,)
        with heavy_lock():
            artifacts = build_artifacts("float32", args.quantize)
            rows = speculative_figures(artifacts, args.repeats) + llamacpp_figures(artifacts, args.repeats)
        out = RESULTS_DIR / f"decoding-llamacpp-{datetime.date.today().isoformat()}.json"
        out.write_text(json.dumps({"model": "SmolLM2-135M-Instruct float32 (Kiln) and f32 GGUF (llama.cpp), CPU, "
                                   "2 threads", "rows": rows}, indent=1) + "\n")
        log(f"wrote {out}")
        return 0
    with heavy_lock():
        artifacts = build_artifacts("float32", args.quantize)
        result = {
            "date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
            "model": f"SmolLM2-135M-Instruct float32 (--quantize {args.quantize}), CPU", "repeats": args.repeats,
            "speculative": speculative_figures(artifacts, args.repeats),
            "structured": structured_figures(artifacts, args.repeats),
        }
    RESULTS_DIR.mkdir(exist_ok=True)
    out = RESULTS_DIR / f"decoding-{result['date']}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
