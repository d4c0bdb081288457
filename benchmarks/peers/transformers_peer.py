"""Hugging Face transformers (eager PyTorch, CPU) as a benchmark peer: the reference
everyone knows, on the same weights as Kiln (the HF directory from weights.py).

    python -m benchmarks.peers.transformers_peer    # setup, then offline figures (f32)
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from . import weights
from .common import heavy_lock, log, make_venv, others_cpu, run_json

VENV = "transformers"
REQUIREMENTS = ["torch==2.13.0", "transformers==5.23.0", "safetensors==0.8.0"]
BENCH_SCRIPT = Path(__file__).with_name("transformers_bench.py")


def setup() -> Path:
    """The venv (made once); returns its python."""
    return make_venv(VENV, REQUIREMENTS)


def offline() -> dict:
    """Prefill 128/512 and decode bs1/bs8 figures with 2 torch threads, float32."""
    py = setup()
    directory = weights.hf_dir()
    with heavy_lock(), others_cpu({}) as load:
        result = run_json(py, [str(BENCH_SCRIPT), "offline", str(directory)])
    return {"engine": "transformers", "dtype": "f32", **result, **load}


def greedy(text: str, n: int) -> dict:
    """Greedy tokens for `text` (and its prompt ids): the reference for llamacpp.check_same_weights."""
    return run_json(setup(), [str(BENCH_SCRIPT), "greedy", str(weights.hf_dir()), text, str(n)])


def main() -> None:
    start = time.monotonic()
    setup()
    log(f"setup done in {time.monotonic() - start:.0f} s")
    print(json.dumps(offline()), flush=True)


if __name__ == "__main__":
    main()
