"""Timings and greedy tokens through Hugging Face transformers (eager PyTorch on the CPU).
Runs inside the transformers venv; prints one JSON object on stdout.

    python transformers_bench.py offline HF_DIR
    python transformers_bench.py greedy HF_DIR 'prompt text' N

Same definitions as every peer: prefill_N_ms = median time of one forward over an N-token
random prompt with a fresh cache (batch 1, last-position logits only, as generate does);
decode_bsB_tok_s = B * 128 / (time of generate(129 new tokens) - time of the prefill it
starts with), i.e. the 128 one-token decode steps after a 128-token prompt.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

THREADS = 2
PROMPT, GENERATED = 128, 128
REPEATS_PREFILL, REPEATS_DECODE = 5, 3


def load(directory: str):
    torch.set_num_threads(THREADS)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return model.eval()


def _median(fn, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` runs after one warm-up."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


@torch.inference_mode()
def prefill_s(model, ids: torch.Tensor) -> float:
    return _median(lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1), REPEATS_PREFILL)


@torch.inference_mode()
def decode_tok_s(model, ids: torch.Tensor) -> float:
    """Aggregate decode tokens/s for the rows of `ids` generated together."""
    pad = model.generation_config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad
    n = GENERATED + 1  # the first new token comes out of the prefill

    def generate():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                       max_new_tokens=n, min_new_tokens=n, pad_token_id=pad)

    total = _median(generate, REPEATS_DECODE)
    return ids.shape[0] * GENERATED / (total - prefill_s(model, ids))


def offline(directory: str) -> dict:
    model = load(directory)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    def ids(*shape):
        return torch.randint(100, vocab - 100, shape, generator=gen)

    return {
        "prefill_128_ms": round(prefill_s(model, ids(1, 128)) * 1e3, 2),
        "prefill_512_ms": round(prefill_s(model, ids(1, 512)) * 1e3, 2),
        "decode_bs1_tok_s": round(decode_tok_s(model, ids(1, PROMPT)), 2),
        "decode_bs8_tok_s": round(decode_tok_s(model, ids(8, PROMPT)), 2),
        "decode_bs8_source": "model.generate on a batch of 8",
        "threads": THREADS,
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
    if argv[0] == "offline":
        result = offline(argv[1])
    elif argv[0] == "greedy":
        result = greedy(argv[1], argv[2], int(argv[3]))
    else:
        raise SystemExit(__doc__)
    import transformers

    print(json.dumps({**result, "transformers": transformers.__version__}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
