"""Each family beyond Llama through `kiln export-model` → `kiln compile-vmfb` → iree.runtime, against
the torch reference (itself checked against transformers in tests/models/test_families.py)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from kiln.export import cpu_kernels
from kiln.export.cpu_kernels import support_problem
from kiln.export.export_model import build_model
from kiln.export.options import ExportOptions
from kiln.models.config import SLIDING
from kiln.models.gguf_writer import write_gguf
from kiln.models.loader import load_checkpoint, load_hf_directory
from kiln.runtime.contract import Artifacts
from kiln.runtime.program import Program

from tests.conftest import _export_and_compile
from tests.eager_paged import check_call_for_call
from tests.export.test_tiny_e2e import check_generation
from tests.hf_families import FAMILIES, write_family_checkpoint
from tests.server_process import ServerProcess


pytestmark = pytest.mark.e2e
pytest.importorskip("transformers")

# One batch size: half the functions of the tiny model's export, half its compile. With the CPU
# kernels where this CPU has them, as `kiln serve --model` builds.
EXPORT_ARGS = ["--bs-prefill", "4", "--bs-decode", "4", "--block-seq-stride", "16", "--max-seq-len", "256",
               "--device-block-count", "64", *([] if support_problem() else ["--cpu-kernels"])]


# Between them every departure a family makes (Qwen3's QK-norm is Gemma 3's; Mixtral's experts are
# Qwen3-MoE's, renormalized; Phi-4-mini is Phi-3 with a partial rotary): one compile a departure
# holds the suite's time to what they add.
COMPILED = ("qwen3_moe", "qwen2_moe", "phi4_mini", "smollm3", "granite", "olmo3", "gemma2", "gemma3")
assert set(COMPILED) <= set(FAMILIES)


@pytest.fixture(scope="module", params=COMPILED)
def family_build(request, tmp_path_factory):
    directory = write_family_checkpoint(request.param, tmp_path_factory.mktemp(f"{request.param}-hf"))
    artifacts = _export_and_compile(directory, tmp_path_factory.mktemp(f"{request.param}-artifacts"), EXPORT_ARGS)
    reference = build_model(load_hf_directory(directory), ExportOptions().validate(256))
    return Program(Artifacts.in_directory(artifacts)), reference, artifacts


def test_prefill_and_decode_match_the_reference(family_build):
    """Rows past every sliding window (6 and 12 keys) and Phi-3's 32-token original context, batched
    with short ones and a padded row; decode through the in-place kernel on global layers and the
    gathered path on local ones."""
    program, reference, _ = family_build
    # A model with sliding layers has its pages by groups of layers, so that those may be let go.
    assert (program.capabilities.page_groups is not None) == (SLIDING in reference.config.layer_types)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(4, 384, n).tolist() for n in (5, 16, 37)]
    # Gemma's √hidden-scaled embeddings and four norms a layer carry the compiled program's float32
    # rounding (its own reduction order) to ~1e-4 of the largest logit, twice the Llama's.
    check_generation(program, reference, prompts, batch=4, steps=5, tolerance=3e-4)


def test_served_with_prefix_caching_and_a_draft_of_its_own_family(family_build, tmp_path):
    """`kiln serve` on the build, drafting with the same build (a draft of the same family): greedy
    text equal to the torch reference's, and the second request's prompt served from the prefix cache."""
    program, reference, artifacts = family_build
    del program  # the server loads its own
    tokenizer = Tokenizer.from_file(str(artifacts / "tokenizer.json"))
    prompt = "Once upon a time, in a small village by the sea, there lived an old fisherman"
    ids = tokenizer.encode(prompt).ids
    eos = set(reference.config.eos_token_ids)
    with torch.no_grad():
        for _ in range(10):
            ids.append(int(reference.forward_reference(torch.tensor([ids]))[0, -1].argmax()))
            if ids[-1] in eos:
                break
    generated = ids[len(tokenizer.encode(prompt).ids):]
    want = tokenizer.decode([t for t in generated if t not in eos])
    args = ["--artifacts", str(artifacts), "--speculative-model", str(artifacts), "--num-speculative-tokens", "3"]
    server = ServerProcess(args, tmp_path / "server.log")
    try:
        server.wait_ready()
        body = {"prompt": prompt, "max_tokens": 10, "temperature": 0}
        first = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
        second = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
    finally:
        assert server.stop() == 0
    assert first["choices"][0]["text"] == want == second["choices"][0]["text"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16  # whole pages of the prompt


def gguf_build(family: str, tmp_path_factory, dtype: str = "q4_0") -> tuple:
    """(the compiled program, the eager model, the artifacts) of the tiny `family` as a GGUF of `dtype`,
    built as it comes."""
    directory = write_family_checkpoint(family, tmp_path_factory.mktemp(f"{family}-hf"))
    path = write_gguf(load_hf_directory(directory),
                      tmp_path_factory.mktemp(f"{family}-gguf") / f"{family}-{dtype}.gguf", dtype=dtype)
    artifacts = _export_and_compile(path, tmp_path_factory.mktemp(f"{family}-{dtype}-artifacts"), EXPORT_ARGS)
    checkpoint = load_checkpoint(path)
    # The eager model with the kernels' own arithmetic where the build has them.
    options = ExportOptions(cpu_kernels=support_problem() is None).validate(256, checkpoint.stored_quantization)
    assert options.quantize == dtype
    return Program(Artifacts.in_directory(artifacts)), build_model(checkpoint, options), artifacts


@pytest.fixture(scope="module", params=["q4_0", "q8_0"])
def quantized_mixture(request, tmp_path_factory):
    """The tiny Mixtral as a Q4_0 and a Q8_0 GGUF: its experts' blocks served as stored."""
    return gguf_build("mixtral", tmp_path_factory, request.param)


def test_a_quantized_mixture_matches_its_eager_model_call_for_call(quantized_mixture):
    """Q4_0 and Q8_0 experts as stored: a batch-4 prefill with a padded row, then greedy decode
    steps, each token times its chosen experts read where they lie (through the CPU kernel, where
    this CPU has it; gathered and widened where not, every expert in a prefill), against the same
    model in eager torch call for call (integer arithmetic up to float32 scaling: float32's 1e-4)."""
    program, reference, artifacts = quantized_mixture
    experts = reference.model.layers[0].mlp.experts
    assert type(experts).__name__ == "QuantizedExperts"
    assert experts.reads_in_place == (support_problem() is None and cpu_kernels.blocks_supported())
    if experts.reads_in_place:
        assert "flow.dispatch @kiln_expert_blocks_" in (artifacts / "model.mlir").read_text()
    rng = np.random.default_rng(5)
    check_call_for_call(program, reference, [rng.integers(4, 384, n).tolist() for n in (5, 16, 37)], 1e-4)


@pytest.fixture(scope="module")
def quantized_glm4(tmp_path_factory):
    """The tiny GLM-4 as a Q4_0 GGUF: its fused gate_up's blocks split, its q and k blocks' rows
    reordered from adjacent rotary pairs, over half of each head."""
    return gguf_build("glm4", tmp_path_factory)


def test_a_glm4_gguf_s_reordered_blocks_match_its_eager_model_call_for_call(quantized_glm4):
    program, reference, _ = quantized_glm4
    assert reference.config.rotary_dim == reference.config.head_dim // 2
    rng = np.random.default_rng(6)
    check_call_for_call(program, reference, [rng.integers(4, 384, n).tolist() for n in (5, 16, 37)], 1e-4)
