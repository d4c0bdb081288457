"""A GGUF file served by Kiln and by llama.cpp's server, in paired rounds under the same load.

    python -m benchmarks.gguf_serving --model FILE [--rounds 3] [--concurrency 16] [--requests 32]

Kiln serves the file as `kiln serve --model FILE` builds it (built once, in a child process, into
Kiln's cache); llama-server (llama-cpp-python's build, 2 threads, a slot per concurrent request,
continuous batching) serves the same file. Each round starts both servers in turn, the order
alternating (A B, B A, ...), and sends each the same new prompts (benchmarks.loadgen's `random`
workload, 256 tokens in and 128 out, made with the file's own tokenizer) at the same concurrency,
so a ratio pairs runs minutes apart rather than a sweep apart. Results go to
results/serving-<the file's stem>-<date>.json: every round's figures (output tokens/s, TTFT,
ITL) and the median ratio of Kiln's output tokens/s to llama.cpp's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import date
from pathlib import Path

from benchmarks.kiln_offline import build_in_child
from benchmarks.peers.common import heavy_lock, log
from benchmarks.run import kiln_server, llamacpp_server, paired_rounds, paired_summary

KILN, LLAMA_CPP = "kiln", "llama.cpp"


def medians(rounds: list[dict], name: str) -> dict:
    """The median over the rounds of one engine's headline figures."""
    runs = [r["runs"][name] for r in rounds if "error" not in r["runs"].get(name, {"error": True})]
    keys = ("output_throughput", "p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms", "completed")
    return {key: round(statistics.median(run[key] for run in runs), 2) for key in keys
            if runs and all(run.get(key) is not None for run in runs)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a GGUF file, or a packaged model's name")
    parser.add_argument("--rounds", type=int, default=3, help="paired rounds (default: 3)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight (default: 16)")
    parser.add_argument("--requests", type=int, default=32, help="requests a run (default: 32)")
    parser.add_argument("--artifacts", type=Path, help="the file's build (`kiln build --output-dir`), not built here")
    parser.add_argument("--output", type=Path, help="where the results go")
    args = parser.parse_args(argv)

    from kiln.models.packaged import resolve_model_path

    path = Path(resolve_model_path(args.model)).resolve()
    output = args.output or (Path(__file__).parent / "results" /
                             f"serving-{path.stem.lower()}-{date.today().isoformat()}.json")
    artifacts = args.artifacts or build_in_child("default_build_options()", model=path)
    servers = {KILN: lambda: kiln_server(artifacts=artifacts),
               LLAMA_CPP: lambda: llamacpp_server(parallel=args.concurrency, model=path)}
    with heavy_lock():
        rounds = paired_rounds(servers, args.rounds, artifacts / "tokenizer.json", args.requests, args.concurrency)
    summary = paired_summary([KILN, LLAMA_CPP], rounds, args.concurrency)
    result = {"model": str(path), "file_mib": round(path.stat().st_size / 2**20, 1), "artifacts": str(artifacts),
              "requests": args.requests, **summary,
              "medians": {name: medians(rounds, name) for name in (KILN, LLAMA_CPP)}}
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    log(f"saved {output}")
    print(json.dumps({k: result[k] for k in ("model", "concurrency", "median_ratio", "paired_rounds", "medians")},
                     indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
