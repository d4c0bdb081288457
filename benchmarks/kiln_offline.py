"""Kiln's offline figures, measured through the runtime a user calls (`kiln.runtime.LLM`).

Same definitions as every peer (benchmarks/peers/*): prefill_N_ms is the median wall
time to answer an N-token prompt of random token ids with one token from a fresh
cache; decode_bsB_tok_s is B sequences' aggregate tokens/s over 128 generated tokens
after a 128-token prompt, prefill excluded (time for 128 tokens minus time for 1).

    python -m benchmarks.kiln_offline --dtype float32      # builds the model if needed
    python -m benchmarks.kiln_offline --quantize int8      # float32 activations, int8 weights

The build runs in a child process so the measuring process never loads torch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

DECODE_PROMPT = 128
DECODE_TOKENS = 128
PREFILL_LENGTHS = (128, 512)
SHORT_DTYPE = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
# How a row names a float32 model whose weight matmuls are quantized (`--quantize`).
QUANTIZED_LABEL = {"bf16": "bf16w", "int8": "int8", "q8_0": "q8_0", "q4_1": "q4_1"}


def label(dtype: str, quantize: str = "none") -> str:
    # "auto" on the bundled Q4_1 file keeps its Q4_1 blocks where the activations are float32.
    if quantize == "auto":
        quantize = "q4_1" if dtype == "float32" else "none"
    return QUANTIZED_LABEL.get(quantize) or SHORT_DTYPE[dtype]


def build_in_child(options: str, targets: tuple[str, ...] = ("cpu",), flags: tuple[str, ...] = (),
                   model: Path | None = None) -> Path:
    """`model` (None: the bundled one) exported with `options` (Python source building
    ExportOptions; it may call default_build_options and dataclasses' replace) and compiled for
    `targets` at their default archs with iree-compile's `flags` added, into Kiln's keyed cache
    (built once), in a child process, so the caller never loads torch."""
    code = (
        "import sys\n"
        "from dataclasses import replace\n"
        "from pathlib import Path\n"
        "from kiln.export.build import build, default_build_options\n"
        "from kiln.export.options import ExportOptions\n"
        f"out = build({None if model is None else f'Path({str(model)!r})'}, {options}, {list(targets)!r}, "
        f"extra_flags={list(flags)!r},\n"
        "            log=lambda m: print(m, file=sys.stderr))\n"
        "print(out)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.PIPE, text=True)
    return Path(done.stdout.strip().splitlines()[-1])


def build_artifacts(dtype: str, quantize: str = "none") -> Path:
    """The bundled model built as `kiln serve --dtype --quantize` builds it (one cache entry for
    both). "none" by default: the benchmarks' float rows; "auto" is what `kiln serve` runs with
    no flags (the file's own Q4_1 blocks)."""
    return build_in_child(f"default_build_options({dtype!r}, quantize={quantize!r})")


def median_ms(call, repeats: int) -> float:
    """The median wall time of `repeats` calls after one warm-up, in ms."""
    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def _random_prompts(count: int, length: int, vocab: int, rng) -> list[list[int]]:
    # Ids from the low part of the vocabulary: ordinary tokens, no special ones.
    return [rng.integers(100, min(vocab, 32000), length).tolist() for _ in range(count)]


def measure(artifacts: Path, repeats: int = 3, device: str = "local-task", device_sampling: bool = True) -> dict:
    """The figures of the artifacts' module for `device` (local-task: model_cpu.vmfb);
    `device_sampling` False: every token sampled on the host, sample_bs<N> or not."""
    from kiln.runtime import LLM, SamplingParams
    from kiln.runtime.contract import device_target

    rng = np.random.default_rng(0)
    with LLM(artifacts, device_target(device), device=device, prefix_sharing="none",
             device_sampling=device_sampling) as llm:
        vocab = llm.service.vocab_size

        def timed(prompts, max_tokens) -> float:
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            started = time.perf_counter()
            results = llm.generate(prompts, params)
            elapsed = time.perf_counter() - started
            assert all(len(r.completions[0].token_ids) == max_tokens for r in results)
            return elapsed

        timed(_random_prompts(1, 16, vocab, rng), 4)  # warm up every function once
        out = {}
        for length in PREFILL_LENGTHS:
            times = [timed(_random_prompts(1, length, vocab, rng), 1) for _ in range(repeats)]
            out[f"prefill_{length}_ms"] = statistics.median(times) * 1e3
        for batch in (1, 8):
            decode = []
            for _ in range(repeats):
                prompts = _random_prompts(batch, DECODE_PROMPT, vocab, rng)
                first = timed(prompts, 1)
                whole = timed(prompts, DECODE_TOKENS)
                decode.append(whole - first)
            out[f"decode_bs{batch}_tok_s"] = batch * (DECODE_TOKENS - 1) / statistics.median(decode)
    return out


def run(dtype: str, quantize: str = "none") -> dict:
    """Build if needed, then measure in a fresh process (no torch in it)."""
    artifacts = build_artifacts(dtype, quantize)
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.kiln_offline", "--measure", str(artifacts)],
        check=True, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent,
    )
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    return {"engine": "kiln", "dtype": label(dtype, quantize), "artifacts": str(artifacts), **figures}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=sorted(SHORT_DTYPE))
    parser.add_argument("--quantize", default="none", choices=["auto", "none", *QUANTIZED_LABEL])
    parser.add_argument("--measure", type=Path, help="measure these artifacts in this process")
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure)))
    else:
        print(json.dumps(run(args.dtype, args.quantize), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
