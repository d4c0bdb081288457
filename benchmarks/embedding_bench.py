"""Embeddings in Kiln beside llama.cpp's server on the same GGUF: throughput and agreement.

    python -m benchmarks.embedding_bench [--model default|PATH] [--inputs 128] [--batch 16] [--rounds 3]

Both serve `/v1/embeddings` over HTTP on 127.0.0.1, last-token pooled and normalised: Kiln as
`kiln serve --embeddings` builds the file (the bundled SmolLM2's Q4_1 by default), llama.cpp's
`llama-server --embeddings --pooling last` on the same file with 2 threads. The same inputs (texts
of 10 to 120 words, fixed) go to each as requests of --batch inputs, two clients at once; rounds
alternate the engines, and Kiln's prefix cache is emptied before each of its rounds, so every
round computes every input. Figures: inputs and tokens per second per engine and their ratio per
round, and how far the two engines' vectors agree (the cosine of each input's two embeddings).
Results go to results/embeddings-<the file's stem>-<date>.json unless --output says otherwise.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

import httpx
import numpy as np

from benchmarks.kiln_offline import build_in_child
from benchmarks.peers import llamacpp
from benchmarks.peers.common import free_port, heavy_lock, log, stop_process, wait_http

WORDS = ("the quick brown fox jumps over a lazy dog while seven old fishermen mend their nets by the grey "
         "harbour wall and children count ships sailing past the lighthouse towards distant islands where "
         "markets sell bread cheese apples and warm soup to travellers who arrive tired after long journeys").split()
CLIENTS = 2


def inputs(count: int, seed: int = 0) -> list[str]:
    """`count` texts of 10 to 120 words, the same for every run."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 120))).capitalize() + "." for _ in range(count)]


def embed_all(url: str, model: str, texts: list[str], batch: int) -> tuple[list[np.ndarray], int, float]:
    """Every text's embedding, sent as requests of `batch` texts by CLIENTS clients at once; the
    prompt tokens the server counted, and the wall time."""
    chunks = [texts[i:i + batch] for i in range(0, len(texts), batch)]

    def send(chunk: list[str]) -> tuple[list[np.ndarray], int]:
        answer = httpx.post(url + "/v1/embeddings", json={"model": model, "input": chunk}, timeout=600)
        answer.raise_for_status()
        body = answer.json()
        rows = sorted(body["data"], key=lambda row: row["index"])
        return [np.asarray(row["embedding"], np.float64) for row in rows], body["usage"]["prompt_tokens"]

    started = time.monotonic()
    with ThreadPoolExecutor(CLIENTS) as pool:
        answers = list(pool.map(send, chunks))
    elapsed = time.monotonic() - started
    return [vector for vectors, _ in answers for vector in vectors], sum(tokens for _, tokens in answers), elapsed


def start_kiln(artifacts: Path, port: int, log_file: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kiln.cli.main", "serve", "--artifacts", str(artifacts),
                             "--port", str(port), "--served-model-name", "model", "--no-access-log"],
                            stdout=open(log_file, "ab"), stderr=subprocess.STDOUT)


def start_llamacpp(path: Path, port: int, log_file: Path) -> subprocess.Popen:
    """llama-server with embeddings on, last-token pooling (what Kiln does for a plain LM), 2
    threads, 4 slots of 512 tokens, and a batch that holds a whole input (embeddings need it)."""
    llamacpp.setup()
    return subprocess.Popen([str(llamacpp.binary("llama-server")), "-m", str(path), "--host", "127.0.0.1",
                             "--port", str(port), "-t", "2", "-tb", "2", "--parallel", "4", "-c", "2048",
                             "-b", "512", "-ub", "512", "--embeddings", "--pooling", "last", "--no-webui",
                             "--alias", "model"], stdout=open(log_file, "ab"), stderr=subprocess.STDOUT)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="a GGUF file, or `default` (the bundled SmolLM2)")
    parser.add_argument("--artifacts", type=Path, help="its `--embeddings` build, not built here")
    parser.add_argument("--inputs", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="inputs per request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()

    from kiln.models.default_model import default_model_path

    bundled = args.model == "default"
    path = default_model_path() if bundled else Path(args.model).resolve()
    output = args.output or (Path(__file__).parent / "results" /
                             f"embeddings-{path.stem.lower()}-{date.today().isoformat()}.json")
    artifacts = args.artifacts or build_in_child("replace(default_build_options(), embedding_functions=True)",
                                                 model=None if bundled else path)
    texts = inputs(args.inputs)
    logs = Path(tempfile.mkstemp(prefix="embedding-bench-", suffix=".log")[1])  # both servers' output
    kiln_port, llama_port = free_port(), free_port()
    kiln_url, llama_url = f"http://127.0.0.1:{kiln_port}", f"http://127.0.0.1:{llama_port}"
    servers = [start_kiln(artifacts, kiln_port, logs), start_llamacpp(path, llama_port, logs)]
    rounds = []
    try:
        wait_http(kiln_url + "/health", 600, servers[0])
        wait_http(llama_url + "/health", 600, servers[1])
        for url in (kiln_url, llama_url):  # warm: each engine's first calls load and plan
            embed_all(url, "model", texts[:args.batch], args.batch)
        with heavy_lock():
            for index in range(args.rounds):
                row = {}
                order = [("kiln", kiln_url), ("llama.cpp", llama_url)]
                for name, url in order if index % 2 == 0 else order[::-1]:
                    if name == "kiln":
                        httpx.post(url + "/reset_prefix_cache", timeout=60).raise_for_status()
                    vectors, tokens, elapsed = embed_all(url, "model", texts, args.batch)
                    row[name] = {"seconds": round(elapsed, 3), "inputs_per_s": round(len(texts) / elapsed, 2),
                                 "tokens_per_s": round(tokens / elapsed, 1), "prompt_tokens": tokens}
                    row[f"{name}_vectors"] = vectors
                row["ratio"] = round(row["kiln"]["inputs_per_s"] / row["llama.cpp"]["inputs_per_s"], 3)
                rounds.append(row)
                log(f"round {index + 1}: kiln {row['kiln']['inputs_per_s']} inputs/s, "
                    f"llama.cpp {row['llama.cpp']['inputs_per_s']} inputs/s, ratio {row['ratio']}")
    finally:
        for server in servers:
            stop_process(server)
    agreement = [float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
                 for a, b in zip(rounds[0]["kiln_vectors"], rounds[0]["llama.cpp_vectors"])]
    result = {
        "model": str(path), "inputs": len(texts), "batch": args.batch, "clients": CLIENTS,
        "rounds": [{k: v for k, v in row.items() if not k.endswith("_vectors")} for row in rounds],
        "median_ratio": statistics.median(row["ratio"] for row in rounds),
        "cosine_kiln_vs_llamacpp": {"mean": round(statistics.fmean(agreement), 5), "min": round(min(agreement), 5)},
        "llama_cpp_python": llamacpp.VERSION,
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
