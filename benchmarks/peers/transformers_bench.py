"""Timings and greedy tokens through Hugging Face transformers (eager PyTorch, CPU or GPU).
Runs inside the transformers venv; prints one JSON object on stdout.

    python transformers_bench.py offline HF_DIR
    python transformers_bench.py offline HF_DIR --device cuda --dtype bfloat16 --random-weights
    python transformers_bench.py offline HF_DIR --device cuda --dtype bfloat16 --random-weights --compile
    python transformers_bench.py greedy HF_DIR 'prompt text' N

--random-weights builds the model from HF_DIR's config.json alone (random initial weights):
the timings of a model of those shapes, where its weights are not at hand.

Same definitions as every peer: prefill_N_ms = median time of one forward over an N-token
random prompt with a fresh cache (batch 1, last-position logits only, as generate does);
decode_bsB_tok_s = B * 128 / (time of generate(129 new tokens) - time of the prefill it
starts with), i.e. the 128 one-token decode steps after a 128-token prompt.

--compile measures decode the fastest way transformers offers on one GPU: a static KV cache and
the decoding steps compiled by torch.compile in "reduce-overhead" mode (CUDA graphs), which
generate does itself given a CompileConfig; only the decode figures are reported then, each
after a warm-up that compiles its shapes. transformers compiles on CUDA devices only: elsewhere
--compile stops with an error rather than report eager figures as compiled.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

THREADS = 2
PROMPT, GENERATED = 128, 128
REPEATS_PREFILL, REPEATS_DECODE = 5, 3


def load(directory: str, device: str = "cpu", dtype: str = "float32", random_weights: bool = False):
    torch.set_num_threads(THREADS)
    if random_weights:
        torch.manual_seed(0)
        config = AutoConfig.from_pretrained(directory)
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    else:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype))
    return model.to(device).eval()


def _synchronize() -> None:
    # GPU kernels run after the Python call returns; a timing ends when they have finished.
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _median(fn, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` runs after one warm-up."""
    fn()
    _synchronize()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


@torch.inference_mode()
def prefill_s(model, ids: torch.Tensor) -> float:
    return _median(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1), REPEATS_PREFILL)


def compiled_decoding() -> dict:
    """generate's arguments for a static KV cache whose decoding steps transformers compiles with
    torch.compile in "reduce-overhead" mode (CUDA graphs): transformers' own path to them.
    Compiling the forward by hand left the graphs unused: each step's cache update is a mutated
    input to them (transformers 5.17, torch 2.11 on an H200: "skipping cudagraphs due to mutated
    inputs"). This path has not run on a GPU here yet: offline refuses to report its figures if
    nothing was compiled."""
    from transformers import CompileConfig

    return {"cache_implementation": "static", "compile_config": CompileConfig(fullgraph=True, mode="reduce-overhead")}


@torch.inference_mode()
def decode_tok_s(model, ids: torch.Tensor, compiled: bool = False) -> float:
    """Aggregate decode tokens/s for the rows of `ids` generated together."""
    pad = model.generation_config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad
    extra = compiled_decoding() if compiled else {}

    def generate(n: int):
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                       max_new_tokens=n, min_new_tokens=n, pad_token_id=pad, **extra)

    # The first new token comes out of the prefill. Compiled, that prefill is timed as generate's
    # own (one new token) through the same static cache, whose shapes are compiled already.
    total = _median(lambda: generate(GENERATED + 1), REPEATS_DECODE)
    first = _median(lambda: generate(1), REPEATS_DECODE) if compiled else prefill_s(model, ids)
    return ids.shape[0] * GENERATED / (total - first)


def offline(directory: str, device: str = "cpu", dtype: str = "float32", random_weights: bool = False,
            compiled: bool = False) -> dict:
    model = load(directory, device, dtype, random_weights)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    def ids(*shape):
        return torch.randint(100, vocab - 100, shape, generator=gen).to(device)

    if compiled:
        from torch._dynamo.utils import counters

        started = time.perf_counter()
        figures = {"decode_bs1_tok_s": round(decode_tok_s(model, ids(1, PROMPT), compiled=True), 2),
                   "decode_bs8_tok_s": round(decode_tok_s(model, ids(8, PROMPT), compiled=True), 2)}
        if not counters["stats"]["unique_graphs"]:  # transformers compiles on CUDA devices only
            raise SystemExit(f"transformers compiled no decoding step on {device}: these are not compiled figures")
        return {**figures, "decode_source": "generate, static cache, torch.compile mode=reduce-overhead",
                "compiled_graphs": counters["stats"]["unique_graphs"],
                "compile_and_measure_s": round(time.perf_counter() - started, 1),
                "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
                "torch_dtype": dtype, "torch": torch.__version__}
    return {
        "prefill_128_ms": round(prefill_s(model, ids(1, 128)) * 1e3, 2),
        "prefill_512_ms": round(prefill_s(model, ids(1, 512)) * 1e3, 2),
        "decode_bs1_tok_s": round(decode_tok_s(model, ids(1, PROMPT)), 2),
        "decode_bs8_tok_s": round(decode_tok_s(model, ids(8, PROMPT)), 2),
        "decode_bs8_source": "model.generate on a batch of 8",
        "threads": THREADS,
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "torch_dtype": dtype,
        "attn_implementation": model.config._attn_implementation,
        "torch": torch.__version__,
    }


@torch.inference_mode()
def greedy(directory: str, text: str, n: int) -> dict:
    model = load(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    ids = tokenizer(text, return_tensors="pt").input_ids
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=n, min_new_tokens=n, pad_token_id=tokenizer.eos_token_id)
    return {"prompt_ids": ids[0].tolist(), "tokens": out[0, ids.shape[1]:].tolist()}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(usage=__doc__)
    parser.add_argument("mode", choices=("offline", "greedy"))
    parser.add_argument("directory")
    parser.add_argument("text", nargs="?")
    parser.add_argument("tokens", nargs="?", type=int)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--compile", action="store_true", help="offline: decode through torch.compile's CUDA graphs")
    args = parser.parse_args(argv)
    if args.mode == "greedy" and (args.text is None or args.tokens is None):
        parser.error("greedy takes HF_DIR, the prompt text and the number of tokens")
    if args.mode == "offline":
        result = offline(args.directory, args.device, args.dtype, args.random_weights, args.compile)
    else:
        result = greedy(args.directory, args.text, args.tokens)
    import transformers

    print(json.dumps({**result, "transformers": transformers.__version__}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
