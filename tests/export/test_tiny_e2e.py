"""The tiny random Llama through export → compile → iree.runtime, against the torch reference."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.export.export_model import build_model
from kiln.export.options import ExportOptions
from kiln.runtime.config import load_model_config
from kiln.runtime.contract import Artifacts
from kiln.runtime.program import Program
from benchmarks.dispatch_count import dispatch_counts
from tests.compiled_module import compiled_functions, replays_a_recorded_command_buffer
from tests.conftest import TINY_EXPORT_ARGS, _export_and_compile, run_kiln
from tests.export.test_contract import signatures
from tests.paged_driver import PagedDriver, call_ms, relative_error

pytestmark = pytest.mark.e2e
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    return build_model(tiny_checkpoint, ExportOptions().validate(256))


def reference_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model.forward_reference(torch.tensor([list(tokens)])).numpy()[0]


def check_generation(program: Program, reference, prompts, batch: int, steps: int = 4, tolerance: float = TOLERANCE):
    """Prefill `prompts` in one batch, then decode greedily; every logit row vs the reference."""
    driver = PagedDriver(program)
    seqs = driver.new_sequences(len(prompts), max(len(p) for p in prompts) + steps)
    logits = driver.prefill(seqs, prompts, batch)
    sequences = [list(p) for p in prompts]
    for row, prompt in enumerate(prompts):
        want = reference_logits(reference, prompt)
        assert relative_error(logits[row, : len(prompt)], want) < tolerance
        sequences[row].append(int(want[-1].argmax()))
    for _ in range(steps):
        positions = [len(s) - 1 for s in sequences]
        logits = driver.decode(seqs, [s[-1] for s in sequences], positions, batch)
        for row, seq in enumerate(sequences):
            want = reference_logits(reference, seq)[-1]
            assert relative_error(logits[row, 0], want) < tolerance
            seq.append(int(want.argmax()))


@pytest.fixture(scope="module")
def program(tiny_artifacts):
    return Program(Artifacts.in_directory(tiny_artifacts))


def test_batch_one(program, reference):
    check_generation(program, reference, [[5, 9, 200, 31, 7]], batch=1)


def test_batch_four_mixed_lengths_with_a_padded_row(program, reference):
    rng = np.random.default_rng(1)
    # 16 is a whole page, 5 and 37 are not; the fourth row is padding onto page 0.
    prompts = [rng.integers(4, 384, n).tolist() for n in (5, 16, 37)]
    check_generation(program, reference, prompts, batch=4, steps=5)


def check_cached_prefix(program: Program, reference, prompt: list[int]) -> None:
    """A 40-token prompt prefilled as 32 tokens, then 8 from position 32 over the cached prefix:
    the second call's logits are the reference's."""
    driver = PagedDriver(program)
    seqs = driver.new_sequences(1, 48)
    driver.prefill(seqs, [prompt[:32]], batch=1)
    logits = driver.prefill(seqs, [prompt[32:]], batch=1, start_pos=[32])
    assert relative_error(logits[0, :8], reference_logits(reference, prompt)[32:]) < TOLERANCE


def test_prefill_at_a_start_position_continues_a_cached_prefix(program, reference):
    check_cached_prefix(program, reference, np.random.default_rng(2).integers(4, 384, 40).tolist())


def test_prefill_last_returns_each_rows_last_logits(program, reference):
    """The serving fast path: the same prefill, only the logits a sampler reads."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(4, 384, n).tolist() for n in (5, 16, 37)]
    driver = PagedDriver(program)
    seqs = driver.new_sequences(len(prompts), 48)
    logits = driver.prefill(seqs, prompts, batch=4, function="prefill_last")
    assert logits.shape[:2] == (4, 1)
    for row, prompt in enumerate(prompts):
        assert relative_error(logits[row, 0], reference_logits(reference, prompt)[-1]) < TOLERANCE
    # and after a cached prefix, at a start position
    prompt = rng.integers(4, 384, 40).tolist()
    seqs = driver.new_sequences(1, 48)
    driver.prefill(seqs, [prompt[:32]], batch=1, function="prefill_last")
    logits = driver.prefill(seqs, [prompt[32:]], batch=1, start_pos=[32], function="prefill_last")
    assert relative_error(logits[0, 0], reference_logits(reference, prompt)[-1]) < TOLERANCE


def test_gguf_export_matches_reference(tiny_gguf_artifacts, reference):
    program = Program(Artifacts.in_directory(tiny_gguf_artifacts))
    check_generation(program, reference, [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]], batch=4, steps=2)


@pytest.fixture(scope="module")
def bucket_artifacts(tiny_hf_dir, tmp_path_factory):
    """The tiny model (attention gathering its pages) with fixed-shape decodes for 32 and 256 tokens."""
    return _export_and_compile(tiny_hf_dir, tmp_path_factory.mktemp("tiny-buckets"),
                               [*TINY_EXPORT_ARGS, "--decode-buckets", "32,256"])


def test_fixed_shape_decode_buckets_match_the_reference(bucket_artifacts, reference, monkeypatch):
    """decode_bs<N>_ctx32 and _ctx256 take static shapes, replay a command buffer recorded at load,
    and give the reference's logits; the server's choice moves from one to the next as the rows
    grow past 32 tokens."""
    functions = signatures((bucket_artifacts / "model.mlir").read_text())
    page_elems = load_model_config(bucket_artifacts / "model.json")[0].page_elems
    assert functions["decode_bs4_ctx32"][3:] == [("4,2", "si64"), (f"64,{page_elems}", "f32")]
    assert functions["decode_bs4_ctx256"][3] == ("4,16", "si64")
    compiled = compiled_functions(bucket_artifacts / "model_cpu.vmfb")
    for name in ("decode_bs1_ctx32", "decode_bs1_ctx256", "decode_bs4_ctx32", "decode_bs4_ctx256"):
        assert replays_a_recorded_command_buffer(compiled, name), name
    program = Program(Artifacts.in_directory(bucket_artifacts))
    called = []
    invoke = program.invoke
    monkeypatch.setattr(program, "invoke", lambda name, *args: called.append(name) or invoke(name, *args))
    check_generation(program, reference, [[5, 9, 200, 31, 7] * 5 + [3], [2, 7, 1, 8]], batch=4, steps=8)
    decodes = [name for name in called if name.startswith("decode")]
    assert decodes == ["decode_bs4_ctx32"] * 6 + ["decode_bs4_ctx256"] * 2


def test_fixed_shape_decode_buckets_compile_for_gpus_recorded_once(bucket_artifacts, tmp_path):
    out = tmp_path / "model_cuda.vmfb"
    run_kiln("compile-vmfb", str(bucket_artifacts / "model.mlir"), "--target", "cuda", "--arch", "sm_80",
             "-o", str(out))
    compiled = compiled_functions(out)
    assert replays_a_recorded_command_buffer(compiled, "decode_bs4_ctx256")
    assert not replays_a_recorded_command_buffer(compiled, "decode_bs4")


@pytest.fixture(scope="module")
def gpu_form_artifacts(tiny_hf_dir, tmp_path_factory):
    """The tiny model as a GPU build exports it (attention one fused op, sample_bs<N> beside the
    steps), compiled for the CPU."""
    return _export_and_compile(tiny_hf_dir, tmp_path_factory.mktemp("tiny-gpu-form"),
                               [*TINY_EXPORT_ARGS, "--attention", "fused", "--sampling-functions"])


def test_fused_attention_matches_the_reference(gpu_form_artifacts, reference):
    """IREE's attention op over the gathered pages, with the padded row, page-straddling prompts,
    a lone decode row and a prefill after a cached prefix: the reference's logits, here on the
    CPU's code for it."""
    assert "torch.aten.scaled_dot_product_attention" in (gpu_form_artifacts / "model.mlir").read_text()
    program = Program(Artifacts.in_directory(gpu_form_artifacts))
    check_generation(program, reference, [[5, 9, 200, 31, 7]], batch=1)
    rng = np.random.default_rng(1)
    check_generation(program, reference, [rng.integers(4, 384, n).tolist() for n in (5, 16, 37)], batch=4, steps=3)
    check_cached_prefix(program, reference, rng.integers(4, 384, 40).tolist())


def test_tokens_chosen_by_the_compiled_sampler_equal_the_host_samplers(gpu_form_artifacts, monkeypatch):
    """The same seeded requests through sample_bs<N> and through the host sampler: the same tokens,
    greedy, with temperature, top-k, top-p and min-p; a request with logprobs in the same run
    keeps its batches on the host."""
    from kiln.runtime import LLM, SamplingParams

    sampled_calls = []
    call_sampled = Program.call_sampled
    monkeypatch.setattr(Program, "call_sampled",
                        lambda self, *args: sampled_calls.append(args[2]) or call_sampled(self, *args))
    prompts = [[5, 9, 200, 31, 7], [3, 1, 4, 1, 5, 9, 2, 6], list(range(10, 50))]
    settings = [dict(temperature=0), dict(temperature=1.0, seed=1), dict(temperature=0.8, top_k=20, seed=2),
                dict(temperature=1.2, top_p=0.9, seed=3), dict(temperature=0.9, top_k=50, top_p=0.8, min_p=0.02, seed=4)]
    tokens = {}
    for on_device in (True, False):
        with LLM(gpu_form_artifacts, prefix_sharing="none", device_sampling=on_device) as llm:
            tokens[on_device] = [[r.completions[0].token_ids for r in
                                  llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True, **s))]
                                 for s in settings]
            if on_device:
                assert {"sample_bs1", "sample_bs4"} <= set(sampled_calls)
                calls = len(sampled_calls)
                result = llm.generate([prompts[0]], SamplingParams(max_tokens=4, temperature=0, logprobs=2))[0]
                assert len(result.completions[0].logprobs) == 4 and len(sampled_calls) == calls
    assert tokens[True] == tokens[False]


def test_config_is_shortfin_compatible(tiny_artifacts):
    import json

    config = json.loads((tiny_artifacts / "model.json").read_text())
    # Exactly shortfin's ModelParams fields: it refuses unknown keys.
    assert set(config) == {
        "max_seq_len", "transformer_block_count", "attn_head_dim", "prefill_batch_sizes",
        "decode_batch_sizes", "has_prefill_position", "use_extend_attention", "module_name",
        "module_abi_version", "logits_normalization", "attn_dtype", "top_k", "paged_kv_cache",
    }
    assert config["paged_kv_cache"] == {
        "block_seq_stride": 16, "attention_head_count_kv": 2, "device_block_count": 64, "kv_cache_dtype": "float32",
    }
    assert config["prefill_batch_sizes"] == [1, 4] and config["max_seq_len"] == 256
    kiln = json.loads((tiny_artifacts / "model.kiln.json").read_text())
    assert kiln["vocab_size"] == 384
    for name in ("model.irpa", "tokenizer.json", "tokenizer_config.json", "model.mlir"):
        assert (tiny_artifacts / name).stat().st_size > 0


def _decode_ms(program: Program, pages: int) -> float:
    cache = program.allocate_cache(pages)
    return call_ms(program, "decode_bs1", (np.array([[3]]), np.array([21]), np.array([20]), np.array([[1, 2]]), cache),
                   repeats=30)


def test_cache_is_updated_in_place(program):
    """A full-cache copy per call makes a 64x larger cache ~40x slower here; in place, no slower."""
    small, large = _decode_ms(program, 64), _decode_ms(program, 64 * 64)
    assert large < 3 * small + 0.5, f"decode {small:.2f} ms at 64 pages, {large:.2f} ms at 4096 pages"


def test_weights_are_external(tiny_artifacts):
    text = (tiny_artifacts / "model.mlir").read_text()
    assert "#flow.parameter.named<\"model\"::" in text
    assert (tiny_artifacts / "model_cpu.vmfb").stat().st_size < 1 << 20


@pytest.mark.parametrize("build", ["tiny_artifacts", "tiny_q4_1_artifacts", "tiny_int8_kv_artifacts"])
def test_the_cpu_module_holds_each_weight_once(build, request, tmp_path):
    """The compiled CPU module reads each parameter where the file holds it: no global that an
    initializer fills at load with a copy of a weight (a concatenation, a 4-bit unpack, a widened,
    transposed or packed copy), one per function that traced it."""
    from kiln.export.compile import run_iree_compile, target_flags

    artifacts = request.getfixturevalue(build)
    out = tmp_path / "global-optimization.mlir"
    run_iree_compile([str(artifacts / "model.mlir"), *target_flags("cpu", "host"),
                      f"--iree-hal-executable-object-search-path={artifacts}", "--compile-to=global-optimization",
                      "-o", str(out)], "compiling to global optimization")
    text = out.read_text()
    assert '#flow.parameter.named<"model"::"model.layers.0.self_attn.qkv_proj.weight">' in text
    assert "self_attn.q_proj" not in text  # stored once, as the stack
    # A tensor global with no value of its own (outside its attributes) is one an initializer computes at load.
    globals_ = [re.sub(r"\{[^{}]*\}", "", line.strip()) for line in text.splitlines()
                if line.lstrip().startswith("util.global ")]
    assert [line.split()[2] for line in globals_ if ": tensor<" in line and " = " not in line] == []
    assert "util.initializer" not in text


def recorded_dispatches(target: str) -> dict[str, int]:
    """The tiny model's dispatches per call on `target` as README.md records them (its table under
    "GPU dispatch budget")."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = readme.split("### GPU dispatch budget", 1)[1].split("\n\n|", 1)[1].split("\n\n", 1)[0]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in ("|" + table).splitlines()[2:]]
    column = {"cuda": 2, "rocm": 3}[target]
    return {row[1].strip("`"): int(row[column].replace(",", "")) for row in rows if row[0] == "tiny test model"}


@pytest.mark.parametrize("target,arch", [("cuda", "sm_80"), ("rocm", "gfx942")])
def test_gpu_targets_compile_within_the_dispatch_budget(gpu_form_artifacts, tmp_path, target, arch):
    """Each call's dispatches are most of a GPU step's time (one launch each): a change to the
    export that adds any fails here, on a machine without a GPU, until README.md's figures are
    raised on purpose. The export is a GPU build's (attention fused, the sampler beside), and its
    sampler's command buffer is recorded once, at load (its shapes are all static)."""
    out = tmp_path / f"model_{target}.vmfb"
    result = run_kiln("compile-vmfb", str(gpu_form_artifacts / "model.mlir"), "--target", target, "--arch", arch,
                      "-o", str(out))
    assert "marked 6 cache argument(s)" in result.stderr  # prefill, prefill_last (bs 1, 4), decode (bs 1, 4)
    counts = dispatch_counts(out)
    recorded = recorded_dispatches(target)
    assert set(recorded) == {"prefill_last_bs1", "prefill_last_bs4", "decode_bs1", "decode_bs4"}
    grown = {name: f"{counts[name]} > {figure}" for name, figure in recorded.items() if counts[name] > figure}
    assert not grown, f"dispatches per call past README.md's figures: {grown} (all: {counts})"
    assert replays_a_recorded_command_buffer(compiled_functions(out), "sample_bs4")


def test_a_gpu_export_tells_iree_what_its_dynamic_sizes_are(tiny_artifacts):
    """The token count's bounds and stride reach IREE (torch.bind_symbolic_shape), so its GPU
    code tiles prefill's matmuls instead of running them row by row (export/exporter.py)."""
    text = (tiny_artifacts / "model.mlir").read_text()
    assert re.search(r'torch\.symbolic_int "16\*s\d+" \{min_val = 16, max_val = 256\}', text)
    assert "torch.bind_symbolic_shape" in text


def test_a_gpu_arch_iree_cannot_target_is_refused_with_what_to_use(tiny_artifacts, tmp_path):
    out = tmp_path / "model_cuda.vmfb"
    result = run_kiln("compile-vmfb", str(tiny_artifacts / "model.mlir"), "--target", "cuda", "--arch", "sm_90",
                      "-o", str(out), check=False)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "no cuda code generation for --arch sm_90: compile for sm_80" in result.stderr
    assert not out.exists()


@pytest.mark.parametrize("dtype,kv_dtype", [("float16", ""), ("bfloat16", ""), ("float32", "float16")])
def test_half_precision_exports_run_close_to_the_float32_reference(tiny_hf_dir, tmp_path, reference, dtype, kv_dtype):
    from tests.conftest import TINY_EXPORT_ARGS

    kv_args = ["--kv-cache-dtype", kv_dtype] if kv_dtype else []
    run_kiln("export-model", "--model", str(tiny_hf_dir), "--output-dir", str(tmp_path), "--dtype", dtype,
             *kv_args, *TINY_EXPORT_ARGS)
    run_kiln("compile-vmfb", str(tmp_path / "model.mlir"), "--target", "cpu", "-o", str(tmp_path / "model_cpu.vmfb"))
    program = Program(Artifacts.in_directory(tmp_path))
    assert program.cache_dtype.itemsize == 2
    prompt = np.random.default_rng(3).integers(4, 384, 21).tolist()
    driver = PagedDriver(program)
    seqs = driver.new_sequences(1, 24)
    logits = driver.prefill(seqs, [prompt], batch=1)
    want = reference_logits(reference, prompt)
    assert relative_error(logits[0, : len(prompt)], want) < (6e-2 if dtype == "bfloat16" else 2e-2)
    # Decode reads what prefill cached (in the cache's own dtype) and still lands close.
    step = driver.decode(seqs, [int(want[-1].argmax())], [len(prompt)], batch=1)
    want_step = reference_logits(reference, prompt + [int(want[-1].argmax())])[-1]
    assert relative_error(step[0, 0], want_step) < (6e-2 if dtype == "bfloat16" else 2e-2)
