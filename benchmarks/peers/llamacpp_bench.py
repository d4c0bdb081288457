"""Timings and greedy tokens through llama-cpp-python's low-level API (llama_batch,
llama_decode). Runs inside the llamacpp venv; prints one JSON object on stdout.

    python llamacpp_bench.py offline MODEL.gguf
    python llamacpp_bench.py greedy MODEL.gguf '[ids...]' N
    python llamacpp_bench.py scale MODEL.gguf       # a model too big for `offline`'s repeats

The low-level API lets batch 8 be 8 sequence ids in one llama_batch, as a server's
continuous batching does, and lets us time llama_decode alone (no sampler, no detokenize).
Definitions shared by every peer: prefill_N_ms = median wall time to evaluate an N-token
random prompt from an empty cache (batch 1); decode_bsB_tok_s = B * 128 / time of the 128
one-token decode steps that follow a 128-token prompt per sequence (greedy argmax).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import llama_cpp as L
import numpy as np
from llama_cpp._logger import set_verbose

THREADS = 2
PROMPT, GENERATED = 128, 128
REPEATS_PREFILL, REPEATS_DECODE = 5, 3


class Engine:
    """One llama.cpp context over a model, with a reusable batch."""

    def __init__(self, path: str, n_ctx: int, n_seq_max: int = 1, n_batch: int = 512):
        params = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(path.encode(), params)
        if not self.model:
            raise RuntimeError(f"cannot load {path}")
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_batch, n_batch, n_seq_max
        cp.n_threads = cp.n_threads_batch = THREADS
        cp.no_perf = True
        self.flash_attn_type = cp.flash_attn_type
        self.kv_unified = bool(cp.kv_unified)
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("cannot create a llama.cpp context")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.memory = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(n_batch, 0, n_seq_max)

    def clear(self) -> None:
        L.llama_memory_clear(self.memory, True)

    def fill(self, tokens, positions, seqs, logits) -> None:
        """Stage a batch (outside any timing)."""
        b = self.batch
        for i, (t, p, s, lg) in enumerate(zip(tokens, positions, seqs, logits)):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = int(t), int(p), 1, int(lg)
            b.seq_id[i][0] = int(s)
        b.n_tokens = len(tokens)

    def run(self, n_out: int) -> np.ndarray:
        """llama_decode the staged batch; the logits rows that were asked for."""
        rc = L.llama_decode(self.ctx, self.batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        L.llama_synchronize(self.ctx)
        return np.ctypeslib.as_array(L.llama_get_logits(self.ctx), shape=(n_out, self.n_vocab))

    def prompt(self, ids, seq: int = 0) -> int:
        """Evaluate a prompt for `seq`; the greedy next token."""
        n = len(ids)
        self.fill(ids, range(n), [seq] * n, [0] * (n - 1) + [1])
        return int(self.run(1)[0].argmax())


def _median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 2)


def time_prefill(engine: Engine, ids: np.ndarray) -> float:
    """Median ms to evaluate `ids` from an empty cache (first run is a warm-up)."""
    n = len(ids)
    samples = []
    for _ in range(REPEATS_PREFILL + 1):
        engine.clear()
        engine.fill(ids, range(n), [0] * n, [0] * (n - 1) + [1])
        start = time.perf_counter()
        engine.run(1)
        samples.append(time.perf_counter() - start)
    return _median_ms(samples[1:])


def time_decode(engine: Engine, prompts: np.ndarray) -> float:
    """Aggregate tokens/s of GENERATED greedy steps for len(prompts) sequences together."""
    bs = len(prompts)
    rates = []
    for _ in range(REPEATS_DECODE + 1):
        engine.clear()
        nxt = np.array([engine.prompt(p, seq=s) for s, p in enumerate(prompts)])
        start = time.perf_counter()
        for step in range(GENERATED):
            engine.fill(nxt, [PROMPT + step] * bs, range(bs), [1] * bs)
            nxt = engine.run(bs).argmax(axis=1)
        rates.append(bs * GENERATED / (time.perf_counter() - start))
    return round(statistics.median(rates[1:]), 2)


def offline(path: str) -> dict:
    rng = np.random.default_rng(0)
    one = Engine(path, n_ctx=1024)
    ids = lambda n: rng.integers(100, one.n_vocab - 100, size=n)  # noqa: E731
    result = {
        "prefill_128_ms": time_prefill(one, ids(128)),
        "prefill_512_ms": time_prefill(one, ids(512)),
        "decode_bs1_tok_s": time_decode(one, ids(PROMPT)[None, :]),
    }
    eight = Engine(path, n_ctx=8 * 2 * (PROMPT + GENERATED), n_seq_max=8)
    result["decode_bs8_tok_s"] = time_decode(eight, rng.integers(100, one.n_vocab - 100, size=(8, PROMPT)))
    result["decode_bs8_source"] = "llama-cpp-python low-level llama_batch, 8 sequence ids"
    result |= {"threads": THREADS, "flash_attn_type": one.flash_attn_type, "kv_unified": eight.kv_unified}
    return result


def scale(path: str, prompt: int = 128, steps: int = 32) -> dict:
    """A large model's figures in minutes: its load, one timed `prompt`-token prefill after a warm-up,
    and `steps` decode steps at batch 1 after it."""
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    engine = Engine(path, n_ctx=2 * (prompt + steps))
    load_s = time.perf_counter() - start
    ids = rng.integers(100, engine.n_vocab - 100, size=prompt)
    engine.prompt(ids[:16])  # warm-up
    engine.clear()
    start = time.perf_counter()
    nxt = engine.prompt(ids)
    prefill_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    for step in range(steps):
        engine.fill([nxt], [prompt + step], [0], [1])
        nxt = int(engine.run(1)[0].argmax())
    decode = steps / (time.perf_counter() - start)
    return {"load_s": round(load_s, 2), f"prefill_{prompt}_ms": round(prefill_ms, 1),
            "decode_bs1_tok_s": round(decode, 3), "threads": THREADS}


def greedy(path: str, ids: list[int], n: int) -> dict:
    engine = Engine(path, n_ctx=len(ids) + n + 16)
    out = [engine.prompt(ids)]
    for step in range(n - 1):
        engine.fill([out[-1]], [len(ids) + step], [0], [1])
        out.append(int(engine.run(1)[0].argmax()))
    return {"tokens": out}


def main(argv: list[str]) -> None:
    set_verbose(False)
    L.llama_backend_init()
    if argv[0] == "offline":
        result = offline(argv[1])
    elif argv[0] == "scale":
        result = scale(argv[1])
    elif argv[0] == "greedy":
        result = greedy(argv[1], json.loads(argv[2]), int(argv[3]))
    else:
        raise SystemExit(__doc__)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
