"""bf16, int8, Q8_0, Q4_1 and k-quant weights (`kiln export-model --quantize`; the block types from GGUFs
of those types as they come) on the tiny model, compiled and run through iree.runtime against
the same quantization in eager torch, call for call.

Tolerances: int8 and the block types are integer arithmetic up to the float32 scaling (and
Q4_1's float32 offset term), so they hold float32's 1e-4.
bf16 rounds each matmul input to bf16; the compiled code's rounding of an input that lies
near a bf16 tie can differ from torch's, and one such flip moves a logit by about bf16's unit
roundoff (2^-8 = 3.9e-3): the bf16 tolerance is that.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from kiln.export.export_model import build_model
from kiln.export.options import ExportOptions
from kiln.export.placement import parameter_bytes_by_device
from kiln.models.loader import load_checkpoint
from kiln.runtime import LLM, SamplingParams
from kiln.runtime.contract import Artifacts
from kiln.runtime.program import Program
from tests.conftest import _export_and_compile, run_kiln
from tests.eager_paged import EagerSequence, check_call_for_call
from tests.paged_driver import PagedDriver, relative_error
from tests.tiny_model import make_tiny_checkpoint, write_hf_directory

pytestmark = pytest.mark.e2e

TOLERANCE = {"bf16": 4e-3, "int8": 1e-4, "q8_0": 1e-4, "q4_1": 1e-4, "gguf": 1e-4}
# Each mode's GGUF, exported as it comes (`--quantize auto` takes its own blocks); "gguf" is a
# Q4_K_M-style mix of Q4_K and Q6_K.
GGUFS = {"q8_0": "tiny_q8_0", "q4_1": "tiny_q4_1", "gguf": "tiny_k_quant"}


@pytest.fixture(scope="module", params=["bf16", "int8", "q8_0", "q4_1", "gguf"])
def quantized(request, tiny_checkpoint):
    mode = request.param
    artifacts = request.getfixturevalue(f"{GGUFS.get(mode, 'tiny_' + mode)}_artifacts")
    if mode in GGUFS:
        checkpoint = load_checkpoint(request.getfixturevalue(f"{GGUFS[mode]}_gguf"))
        options = ExportOptions().validate(256, checkpoint.stored_quantization)
    else:
        checkpoint, options = tiny_checkpoint, ExportOptions(quantize=mode).validate(256)
    assert options.quantize == mode
    return mode, artifacts, Program(Artifacts.in_directory(artifacts)), build_model(checkpoint, options), checkpoint


def _amd_cpu() -> bool:
    try:
        return "AuthenticAMD" in open("/proc/cpuinfo").read()
    except OSError:
        return False


def test_every_function_matches_the_eager_quantized_model(quantized, request):
    """Prefill (batch 4 with a padded row, every position), greedy decode steps at batch 4 and 1,
    and prefill_last continuing a cached prefix at a start position."""
    mode, _, program, reference, _ = quantized
    if mode == "int8" and _amd_cpu():
        # A defect of the int8 build on this CPU, recorded rather than hidden: IREE 3.13's int8
        # decode step at batch 4, compiled for an AMD EPYC (Zen, AVX512-VNNI), differs from the
        # exact integer reference by ~1.2% in its logits (prefill matches; greedy tokens agree).
        request.applymarker(pytest.mark.xfail(reason="int8 decode at batch 4 differs ~1% from the reference on "
                                              "AMD Zen (IREE 3.13's int8 matmul)", strict=False))
    tolerance = TOLERANCE[mode]
    rng = np.random.default_rng(1)
    prompts = [rng.integers(4, 384, n).tolist() for n in (5, 16, 37)]
    driver = check_call_for_call(program, reference, prompts, tolerance)
    [lone] = driver.new_sequences(1, 16)
    assert relative_error(driver.decode([lone], [7], [0], batch=1)[0, 0], EagerSequence(reference).run([7])[0]) < tolerance
    [continued] = driver.new_sequences(1, 48)
    prompt = rng.integers(4, 384, 40).tolist()
    driver.prefill([continued], [prompt[:32]], batch=1)
    last = driver.prefill([continued], [prompt[32:]], batch=1, start_pos=[32], function="prefill_last")
    sequence = EagerSequence(reference)
    sequence.run(prompt[:32])
    assert relative_error(last[0, 0], sequence.run_last(prompt[32:])) < tolerance


def test_int8_on_smollm2s_shapes_decodes_at_batch_16_as_eager_torch_does(tmp_path):
    """SmolLM2's shapes (576 wide, 9 query heads over 3 K/V heads, an MLP 1536 wide) with two
    random layers and int8 weights: IREE's default stack limit refused this decode at batch 16
    (what `kiln serve --quantize int8` builds), where the group sums of the output projection
    want 36 KiB."""
    checkpoint = make_tiny_checkpoint(seed=3, vocab_size=384, hidden_size=576, intermediate_size=1536,
                                      num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3)
    write_hf_directory(checkpoint, tmp_path / "hf")
    artifacts = _export_and_compile(tmp_path / "hf", tmp_path / "int8", [
        "--bs-prefill", "1", "--bs-decode", "16", "--max-seq-len", "256", "--device-block-count", "32",
        "--quantize", "int8"])
    reference = build_model(checkpoint, ExportOptions(quantize="int8").validate(256))
    driver = PagedDriver(Program(Artifacts.in_directory(artifacts)))
    rng = np.random.default_rng(2)
    prompts = [rng.integers(4, 384, n).tolist() for n in (9, 20)]
    seqs = driver.new_sequences(2, 32)
    eager = [EagerSequence(reference) for _ in prompts]
    for seq, prompt, sequence in zip(seqs, prompts, eager):
        driver.prefill([seq], [prompt], batch=1)
        sequence.run(prompt)
    step = driver.decode(seqs, [5, 6], [len(p) for p in prompts], batch=16)  # 14 padding rows
    for row, token in enumerate((5, 6)):
        assert relative_error(step[row, 0], eager[row].run([token])[0]) < TOLERANCE["int8"]


def test_weights_are_stored_narrow_and_the_matmul_takes_them_as_they_are(quantized):
    mode, artifacts, _, _, checkpoint = quantized
    text = (artifacts / "model.mlir").read_text()
    [stored] = parameter_bytes_by_device(text).values()
    whole = 4 * sum(t.size for t in checkpoint.tensors.values())  # all float32
    # The norms stay float32, int8 adds a float32 scale per row and Q8_0 one per 32 values: a
    # little over 1/2, 1/4 and 9/32. Q4_1 adds an offset per 32 values to its layers (10/32),
    # not to its Q8_0 embedding; Q4_K a scale and an offset per 32, Q6_K a scale per 16 (10/32).
    low = {"bf16": 0.5, "int8": 0.25, "q8_0": 9 / 32, "q4_1": 9 / 32, "gguf": 10 / 32}[mode]
    assert whole * low < stored < whole * (low + (0.06 if mode == "q4_1" else 0.03))
    element = "bf16" if mode == "bf16" else "i8"
    accumulator = "f32" if mode == "bf16" else "i32"
    narrow_matmul = (rf"linalg\.(?:batch_)?matmul .* ins\([^:]+ : tensor<\S+x{element}>, tensor<(?:\d+x)+{element}>\) "
                     rf"outs\([^:]+ : tensor<\S+x{accumulator}>\)")
    assert len(re.findall(narrow_matmul, text)) >= 4  # q/k/v, o, gate/up, down at least
    kiln = json.loads((artifacts / "model.kiln.json").read_text())
    assert kiln["quantization"] == mode
    assert json.loads((artifacts / "model.json").read_text())["paged_kv_cache"]["kv_cache_dtype"] == "float32"


def test_the_serving_runtime_generates_the_eager_models_greedy_tokens(quantized):
    mode, artifacts, _, reference, _ = quantized
    prompts = [[5, 9, 200, 31, 7], list(range(40, 70))]
    with LLM(artifacts) as llm:
        results = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        sequence = EagerSequence(reference)
        tokens = [int(sequence.run_last(prompt).argmax())]
        while len(tokens) < 8:
            tokens.append(int(sequence.run([tokens[-1]])[0].argmax()))
        assert result.completions[0].token_ids == tokens


@pytest.mark.parametrize("mode", ["int8", "q8_0", "q4_1", "gguf"])
@pytest.mark.parametrize("target,arch", [("cuda", "sm_80"), ("rocm", "gfx942")])
def test_gpu_targets_compile_the_integer_exports(request, mode, tmp_path, target, arch):
    artifacts = request.getfixturevalue(f"{GGUFS.get(mode, 'tiny_' + mode)}_artifacts")
    out = tmp_path / f"model_{target}.vmfb"
    run_kiln("compile-vmfb", str(artifacts / "model.mlir"), "--target", target, "--arch", arch, "-o", str(out))
    assert out.stat().st_size > 10_000


def test_quantize_with_a_narrow_activation_dtype_is_refused(tiny_hf_dir, tmp_path):
    result = run_kiln("export-model", "--model", str(tiny_hf_dir), "--output-dir", str(tmp_path / "out"),
                      "--quantize", "int8", "--dtype", "float16", check=False)
    assert result.returncode != 0 and "needs --dtype float32" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()
