"""What bf16, int8, Q8_0 and Q4_1 weights cost in accuracy on the real SmolLM2-135M, in eager torch
with the arithmetic the compiled functions do, call for call (tests/export/test_quantized_export.py
and, for int8 as a build with the CPU kernels runs it, tests/export/test_cpu_kernels.py show the
compiled ones agree with it).

The float32 model is the bundled Q4_1 file dequantized. Q4_1 serves the file's own blocks, so its
weights are float32's exactly and only its decode steps' quantized activations differ.

Against float32: greedy tokens on reference prompts (a prefill, then decode steps) agree for
the first 16 tokens (bf16; int8 on the prompts where float32's path has no near tie; int8, Q8_0
and Q4_1 wherever float32's choice is not a near tie), and
the mean log-probability of each next token over a fixed English text (CPython's LICENSE.txt,
which every Python install ships) moves by less than 1% (bf16) and 2% (int8, Q8_0, Q4_1) on both
paths: 2,048 tokens as one prefill (weights widened to float32) and 128 tokens fed one decode
step at a time after a 64-token prefill (weights and, for the integer types, activations narrow).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from tokenizers import Tokenizer

from kiln.export.export_model import build_model
from kiln.export.options import ExportOptions
from tests.eager_paged import EagerSequence

pytestmark = pytest.mark.smollm2

# The SmolLM2 tests' reference prompt and two more.
PROMPTS = ["1, 2, 3, 4, 5,", "Once upon a time", "What is 2+2?"]
# int8 quantizes a decode step's activations per token and per 64 channels: it leaves float32's
# path at near ties on "Once upon a time" (its third token, float32's best two 0.50 apart),
# "def fibonacci(n):" (sixth, 0.23) and "The capital of France is" (sixth, 0.22), so its greedy
# check takes prompts that hold, and the near-tie check below covers it on all of them.
GREEDY_PROMPTS = {"bf16": PROMPTS, "int8": ["1, 2, 3, 4, 5,", "What is 2+2?", "Hello, my name is"]}
# int8 as a build with Kiln's CPU kernels runs it: a one-row product quantizes its input per 32
# channels there (export/cpu_kernels.py), several rows per 64 as above.
INT8_KERNELS = "int8-kernels"
GREEDY_PROMPTS[INT8_KERNELS] = GREEDY_PROMPTS["int8"]
# Q8_0 and Q4_1 quantize a decode step's activations per 32 channels, as llama.cpp does: their
# logits sit within ~1 of float32's, so they may take the other of two nearly tied tokens (Q8_0:
# "What is 2+2?" at its ninth token, 0.22 apart; "Hello, my name is" at its seventh, 0.02 apart;
# Q4_1: "What is 2+2?" at its fourteenth).
NEAR_TIE = 1.0
GREEDY_TOKENS = 16
PREFILL_TOKENS, DECODE_CONTEXT, DECODE_TOKENS = 2048, 64, 128
MAX_CHANGE = {"bf16": 0.01, "int8": 0.02, "q8_0": 0.02, "q4_1": 0.02, INT8_KERNELS: 0.02}


@pytest.fixture(scope="module")
def tokenizer(smollm2_checkpoint):
    return Tokenizer.from_str(smollm2_checkpoint.tokenizer_json)


@pytest.fixture(scope="module")
def models(smollm2_checkpoint):
    from kiln.export.cpu_kernels import support_problem

    built = {mode: build_model(smollm2_checkpoint, ExportOptions(quantize=mode).validate(4096))
             for mode in ("none", *MAX_CHANGE) if mode != INT8_KERNELS}
    if support_problem() is None:  # the kernels' arithmetic, run eagerly
        options = ExportOptions(quantize="int8", cpu_kernels=True).validate(4096)
        built[INT8_KERNELS] = build_model(smollm2_checkpoint, options)
    return built


@pytest.fixture(scope="module")
def text_ids(tokenizer) -> list[int]:
    text = open(os.path.join(sys.base_prefix, "lib", "python3.11", "LICENSE.txt"), encoding="utf-8").read()
    ids = tokenizer.encode(text, add_special_tokens=False).ids[:PREFILL_TOKENS]
    assert len(ids) == PREFILL_TOKENS
    return ids


def log_probability(logits: torch.Tensor, next_ids: list[int]) -> float:
    """Mean log-probability of next_ids under logits [T, V]."""
    return torch.log_softmax(logits.double(), dim=-1).gather(1, torch.tensor(next_ids).view(-1, 1)).mean().item()


def prefill_path(model, ids: list[int]) -> float:
    with torch.no_grad():
        return log_probability(model.forward_reference(torch.tensor([ids]))[0, :-1], ids[1:])


def decode_path(model, ids: list[int]) -> float:
    sequence = EagerSequence(model, pages=(DECODE_CONTEXT + DECODE_TOKENS) // 16 + 1)
    logits = [torch.from_numpy(sequence.run(ids[:DECODE_CONTEXT])[-1:])]
    for token in ids[DECODE_CONTEXT:DECODE_CONTEXT + DECODE_TOKENS - 1]:
        logits.append(torch.from_numpy(sequence.run([token])))
    return log_probability(torch.cat(logits), ids[DECODE_CONTEXT:DECODE_CONTEXT + DECODE_TOKENS])


def greedy(model, ids: list[int]) -> list[int]:
    sequence = EagerSequence(model)
    out = [int(sequence.run_last(ids).argmax())]
    while len(out) < GREEDY_TOKENS:
        out.append(int(sequence.run([out[-1]])[0].argmax()))
    return out


@pytest.mark.parametrize("mode", ["bf16", "int8", INT8_KERNELS])
def test_greedy_tokens_match_float32(models, tokenizer, mode):
    if mode not in models:
        pytest.skip("this machine does not run the CPU kernels")
    for prompt in GREEDY_PROMPTS[mode]:
        ids = tokenizer.encode(prompt, add_special_tokens=False).ids
        assert greedy(models[mode], ids) == greedy(models["none"], ids), prompt


@pytest.mark.parametrize("path", [prefill_path, decode_path], ids=["prefill", "decode"])
def test_mean_log_probability_over_a_fixed_text(models, text_ids, path):
    reference = path(models["none"], text_ids)
    for mode, limit in MAX_CHANGE.items():
        if mode not in models or (mode == INT8_KERNELS and path is prefill_path):  # its prefill is int8's
            continue
        change = abs(path(models[mode], text_ids) - reference) / abs(reference)
        assert change < limit, f"{mode}: mean log-probability {change:.2%} from float32's"


@pytest.mark.parametrize("mode", ["int8", INT8_KERNELS, "q8_0", "q4_1"])
def test_integer_types_pick_float32s_token_wherever_float32_is_not_near_a_tie(models, tokenizer, mode):
    """Along float32's greedy path (each step fed float32's token), int8's, Q8_0's and Q4_1's best
    token is float32's at every position where float32's two best logits are NEAR_TIE or more apart."""
    if mode not in models:
        pytest.skip("this machine does not run the CPU kernels")
    decided = 0
    for prompt in [*PROMPTS, "def fibonacci(n):", "Hello, my name is"]:
        ids = tokenizer.encode(prompt, add_special_tokens=False).ids
        path = greedy(models["none"], ids)
        sequences = {name: EagerSequence(models[name]) for name in ("none", mode)}
        steps = {name: [sequence.run_last(ids)] for name, sequence in sequences.items()}
        for token in path[:-1]:
            for name, sequence in sequences.items():
                steps[name].append(sequence.run([token])[0])
        for position, (want, got) in enumerate(zip(steps["none"], steps[mode])):
            best, second = torch.from_numpy(want).topk(2).values.tolist()
            if best - second >= NEAR_TIE:
                assert got.argmax() == want.argmax(), f"{prompt!r} token {position}"
                decided += 1
    assert decided >= 50  # most positions are decided ones
