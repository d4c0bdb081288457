"""Byte KV caches (`--kv-cache-dtype int8` and `fp8_e4m3`) through export → compile → iree.runtime:
their bytes, and their logits against the eager model writing and reading the same byte cache (the
arithmetic the export traced) and against the float cache's. Two builds of each: the CPU kernel
reading the pages in place for decode, and the gathered, dequantizing form every target compiles
(a GPU's)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kiln.export import cpu_kernels
from kiln.models.llama import PagedLlama
from kiln.runtime.contract import Artifacts
from kiln.runtime.program import Program
from tests.conftest import TINY_EXPORT_ARGS, _export_and_compile, run_kiln
from tests.eager_paged import EagerSequence
from tests.paged_driver import PagedDriver, relative_error

pytestmark = pytest.mark.e2e
FORMATS = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
# Compiled against eager, both rounding the same K/V to bytes: a value on a rounding boundary may
# land one step apart, a few 1e-4 of the logits' scale.
SAME_ARITHMETIC = 2e-3
# Against the float cache: what 8 bits of K and V cost the tiny random model (e4m3 keeps 3 bits of
# mantissa where int8 keeps 7 bits below a vector's largest value).
FLOAT_CACHE = {"int8": 2e-2, "fp8_e4m3": 4e-2}
PROMPTS = [list(range(5, 45)), list(range(100, 117)), [7, 3, 9], list(range(200, 263))]


@pytest.fixture(scope="module")
def builds(tiny_hf_dir, tmp_path_factory, tiny_int8_kv_artifacts, tiny_fp8_kv_artifacts):
    """build(format, form): the tiny model with a byte cache, decode through the CPU kernel
    ("kernel") or with prefill and decode gathering and dequantizing the pages ("gathered")."""
    made = {("int8", "kernel"): tiny_int8_kv_artifacts, ("fp8_e4m3", "kernel"): tiny_fp8_kv_artifacts}

    def build(fmt: str, form: str):
        if (fmt, form) not in made:
            args = [*TINY_EXPORT_ARGS, "--kv-cache-dtype", fmt, *(["--cpu-kernels"] if form == "kernel" else [])]
            made[fmt, form] = _export_and_compile(tiny_hf_dir, tmp_path_factory.mktemp(f"tiny-{fmt}-kv-{form}"), args)
        return made[fmt, form]

    return build


@pytest.fixture(scope="module")
def eager(tiny_checkpoint):
    return PagedLlama(tiny_checkpoint.config, block_seq_stride=16).load_tensors(tiny_checkpoint.tensors).eval()


def _generate(program: Program, prompts, steps: int) -> tuple[list[np.ndarray], list[list[int]]]:
    """Prefill `prompts` as one batch of 4, then decode greedily `steps` tokens; each row's logits
    [len(prompt) + steps, V] and its tokens."""
    driver = PagedDriver(program)
    seqs = driver.new_sequences(len(prompts), max(len(p) for p in prompts) + steps)
    logits = driver.prefill(seqs, prompts, 4)
    rows = [[logits[r, :len(p)]] for r, p in enumerate(prompts)]
    tokens = [list(p) + [int(logits[r, len(p) - 1].argmax())] for r, p in enumerate(prompts)]
    for _ in range(steps):
        step = driver.decode(seqs, [t[-1] for t in tokens], [len(t) - 1 for t in tokens], 4)
        for r, seq in enumerate(tokens):
            rows[r].append(step[r])
            seq.append(int(step[r, 0].argmax()))
    return [np.concatenate(r) for r in rows], tokens


def _eager_logits(model, tokens: list[int], prompt_len: int, cache_dtype) -> np.ndarray:
    """The eager paged model's logits over `tokens`, the prompt in one call and then one token a
    call, as the compiled functions ran them."""
    sequence = EagerSequence(model, pages=8, cache_dtype=cache_dtype)
    rows = [sequence.run(tokens[:prompt_len])]
    rows += [sequence.run([token]) for token in tokens[prompt_len:-1]]
    return np.concatenate(rows)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("form", ["kernel", "gathered"])
def test_a_byte_cache_runs_as_the_eager_model_and_near_the_float_cache(fmt, form, builds, eager):
    if form == "kernel" and cpu_kernels.support_problem():
        pytest.skip(cpu_kernels.support_problem())
    program = Program(Artifacts.in_directory(builds(fmt, form)))
    # Its buffer crosses the ABI as float16 (runtime/config.py's KV_STORAGE_DTYPES).
    assert program.params.paged_kv_cache.kv_cache_dtype == fmt and program.cache_dtype == np.float16
    logits, tokens = _generate(program, PROMPTS, steps=6)
    for row, prompt in enumerate(PROMPTS):
        same = _eager_logits(eager, tokens[row], len(prompt), FORMATS[fmt])
        assert relative_error(logits[row], same) < SAME_ARITHMETIC
        float_cache = _eager_logits(eager, tokens[row], len(prompt), torch.float32)
        assert relative_error(logits[row], float_cache) < FLOAT_CACHE[fmt]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_byte_cache_stores_about_a_quarter_of_float32s_bytes(fmt, builds, tiny_artifacts):
    def page_bytes(artifacts):
        program = Program(Artifacts.in_directory(artifacts))
        return program.params.page_elems * program.cache_dtype.itemsize

    config = json.loads((builds(fmt, "gathered") / "model.json").read_text())
    assert config["paged_kv_cache"]["kv_cache_dtype"] == fmt
    # The tiny model's 8 K and V blocks of 16 x 16 and one block of their scales: 9 / (8 x 4).
    # SmolLM2's 180 blocks of 64 x 16 take 6 of scales: 0.258.
    assert page_bytes(builds(fmt, "gathered")) / page_bytes(tiny_artifacts) == 9 / 32


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("target,arch", [("cuda", "sm_80"), ("rocm", "gfx942")])
def test_gpu_targets_compile_a_byte_cache(fmt, builds, tmp_path, target, arch):
    """The gathered form is what a GPU runs: pages widened as read (e4m3 by integer arithmetic:
    IREE 3.13 converts no 8-bit float on CUDA, nor OCP's e4m3 on gfx942), their scales on the
    scores and weights."""
    out = tmp_path / f"model_{target}.vmfb"
    result = run_kiln("compile-vmfb", str(builds(fmt, "gathered") / "model.mlir"), "--target", target,
                      "--arch", arch, "-o", str(out))
    assert "marked 6 cache argument(s)" in result.stderr and out.stat().st_size > 10_000
