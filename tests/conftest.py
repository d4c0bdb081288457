"""Session-wide artifacts: each model is exported and compiled once per run.

The tiny random model is built through the real CLI (`kiln export-model`,
`kiln compile-vmfb`) so those commands are exercised end to end; SmolLM2 goes
through `kiln.export.build` into Kiln's keyed cache, so local reruns reuse it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server_process import ServerProcess
from tests.tiny_model import make_tiny_checkpoint, write_hf_directory

# Small enough to trace in seconds, large enough for several pages per sequence.
TINY_EXPORT_ARGS = [
    "--bs-prefill", "1,4",
    "--bs-decode", "1,4",
    "--block-seq-stride", "16",
    "--max-seq-len", "256",
    "--device-block-count", "64",
]


def run_kiln(*args: str, check: bool = True, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run the installed `kiln` entry point as a user would."""
    result = subprocess.run(
        [sys.executable, "-m", "kiln.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"kiln {' '.join(args)} failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result


@pytest.fixture(scope="session")
def tiny_checkpoint():
    return make_tiny_checkpoint(seed=0)


@pytest.fixture(scope="session")
def tiny_hf_dir(tiny_checkpoint, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-hf")
    write_hf_directory(tiny_checkpoint, directory)
    return directory


@pytest.fixture(scope="session")
def tiny_gguf(tiny_checkpoint, tmp_path_factory) -> Path:
    from kiln.models.gguf_writer import write_gguf

    path = tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf"
    write_gguf(tiny_checkpoint, path, dtype="f32")
    return path


def _tiny_gguf_of(checkpoint, tmp_path_factory, dtype: str) -> Path:
    from kiln.models.gguf_writer import write_gguf

    return write_gguf(checkpoint, tmp_path_factory.mktemp(f"tiny-{dtype}-gguf") / f"tiny-{dtype}.gguf", dtype=dtype)


@pytest.fixture(scope="session")
def tiny_q8_0_gguf(tiny_checkpoint, tmp_path_factory) -> Path:
    """The tiny model as a Q8_0 GGUF (every weight matmul and the embedding in 32-value blocks)."""
    return _tiny_gguf_of(tiny_checkpoint, tmp_path_factory, "q8_0")


@pytest.fixture(scope="session")
def tiny_q4_1_gguf(tiny_checkpoint, tmp_path_factory) -> Path:
    """The tiny model as a Q4_1 GGUF laid out as the bundled SmolLM2's: Q4_1 weight matmuls, the
    embedding in Q8_0."""
    return _tiny_gguf_of(tiny_checkpoint, tmp_path_factory, "q4_1")


def _export_and_compile(model: Path, out: Path, export_args=TINY_EXPORT_ARGS) -> Path:
    run_kiln("export-model", "--model", str(model), "--output-dir", str(out), *export_args)
    run_kiln("compile-vmfb", str(out / "model.mlir"), "--target", "cpu", "-o", str(out / "model_cpu.vmfb"))
    return out


@pytest.fixture(scope="session")
def tiny_artifacts(tiny_hf_dir, tmp_path_factory) -> Path:
    """The tiny model from its HF directory, exported and compiled for the CPU."""
    return _export_and_compile(tiny_hf_dir, tmp_path_factory.mktemp("tiny-artifacts"))


@pytest.fixture(scope="session")
def tiny_embedding_hf(tiny_checkpoint, tmp_path_factory) -> Path:
    """The tiny model as a sentence-transformers embedding model: last-token pooling, then
    normalised, Matryoshka-trained to 16 and 32 of its 64 dimensions."""
    directory = tmp_path_factory.mktemp("tiny-embedding-hf")
    write_hf_directory(tiny_checkpoint, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    stages = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    (directory / "modules.json").write_text(json.dumps([
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (path, kind) in enumerate(stages)]))
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}))
    return directory


@pytest.fixture(scope="session")
def tiny_embedding_artifacts(tiny_embedding_hf, tmp_path_factory) -> Path:
    """The tiny embedding model exported with its embed functions (--embeddings) and compiled."""
    return _export_and_compile(tiny_embedding_hf, tmp_path_factory.mktemp("tiny-embedding-artifacts"),
                               [*TINY_EXPORT_ARGS, "--embeddings"])


@pytest.fixture(scope="session")
def tiny_lora_artifacts(tiny_hf_dir, tmp_path_factory) -> Path:
    """The tiny model with 2 LoRA adapter slots of rank up to 8 over q, v, o and down projections."""
    return _export_and_compile(tiny_hf_dir, tmp_path_factory.mktemp("tiny-lora-artifacts"),
                               [*TINY_EXPORT_ARGS, "--max-loras", "2", "--max-lora-rank", "8",
                                "--lora-target-modules", "q_proj,v_proj,o_proj,down_proj"])


@pytest.fixture(scope="session")
def tiny_lora_kernel_artifacts(tiny_hf_dir, tmp_path_factory) -> Path:
    """The LoRA build with the CPU kernels: each row's adapter applied by the kernel reading its slot in place."""
    return _export_and_compile(tiny_hf_dir, tmp_path_factory.mktemp("tiny-lora-kernel-artifacts"),
                               [*TINY_EXPORT_ARGS, "--max-loras", "2", "--max-lora-rank", "8",
                                "--lora-target-modules", "q_proj,v_proj,o_proj,down_proj", "--cpu-kernels"])


@pytest.fixture(scope="session")
def tiny_gguf_artifacts(tiny_gguf, tmp_path_factory) -> Path:
    """The same tiny model, from its GGUF form."""
    return _export_and_compile(tiny_gguf, tmp_path_factory.mktemp("tiny-gguf-artifacts"))


@pytest.fixture(scope="session")
def tiny_tp2_artifacts(tiny_hf_dir, tmp_path_factory) -> Path:
    """The tiny model with each layer's heads and MLP columns over two devices."""
    return _export_and_compile(tiny_hf_dir, tmp_path_factory.mktemp("tiny-tp2"), [*TINY_EXPORT_ARGS, "--tensor-parallel", "2"])


@pytest.fixture(scope="session")
def tiny_pp2_artifacts(tiny_hf_dir, tmp_path_factory) -> Path:
    """The tiny model with its two layers on two devices, one each."""
    return _export_and_compile(tiny_hf_dir, tmp_path_factory.mktemp("tiny-pp2"), [*TINY_EXPORT_ARGS, "--pipeline-parallel", "2"])


@pytest.fixture(scope="session")
def tiny_bf16_artifacts(tiny_hf_dir, tmp_path_factory) -> Path:
    """The tiny model with its weight matmuls in bf16 (float32 activations)."""
    return _export_and_compile(tiny_hf_dir, tmp_path_factory.mktemp("tiny-bf16"), [*TINY_EXPORT_ARGS, "--quantize", "bf16"])


@pytest.fixture(scope="session")
def tiny_int8_artifacts(tiny_hf_dir, tmp_path_factory) -> Path:
    """The tiny model with int8 weights (a scale per output row) and activations quantized per token."""
    return _export_and_compile(tiny_hf_dir, tmp_path_factory.mktemp("tiny-int8"), [*TINY_EXPORT_ARGS, "--quantize", "int8"])


@pytest.fixture(scope="session")
def tiny_int8_kv_artifacts(tiny_hf_dir, tmp_path_factory) -> Path:
    """The tiny model with an int8 KV cache, its decode attention the CPU kernel reading it in place."""
    return _export_and_compile(tiny_hf_dir, tmp_path_factory.mktemp("tiny-int8-kv"),
                               [*TINY_EXPORT_ARGS, "--kv-cache-dtype", "int8", "--cpu-kernels"])


@pytest.fixture(scope="session")
def tiny_fp8_kv_artifacts(tiny_hf_dir, tmp_path_factory) -> Path:
    """The tiny model with an fp8 e4m3 KV cache (asked for by vLLM's name, "fp8"), its decode
    attention the CPU kernel reading it in place."""
    return _export_and_compile(tiny_hf_dir, tmp_path_factory.mktemp("tiny-fp8-kv"),
                               [*TINY_EXPORT_ARGS, "--kv-cache-dtype", "fp8", "--cpu-kernels"])


@pytest.fixture(scope="session")
def tiny_q8_0_artifacts(tiny_q8_0_gguf, tmp_path_factory) -> Path:
    """The tiny Q8_0 GGUF exported as it comes (`--quantize auto`: its own blocks)."""
    return _export_and_compile(tiny_q8_0_gguf, tmp_path_factory.mktemp("tiny-q8_0"))


@pytest.fixture(scope="session")
def tiny_k_quant_gguf(tmp_path_factory) -> Path:
    """A tiny model 256 wide (a k-quant's super-block) as a Q4_K_M-style GGUF of random blocks:
    Q4_K weight matmuls, Q6_K (blocks of 16) for attn_v, ffn_down, the output head and the
    embedding, as llama.cpp's Q4_K_M mixes them."""
    from unittest import mock
    from zlib import crc32

    from gguf import GGMLQuantizationType

    from kiln.models import gguf_writer
    from tests.tiny_model import make_tiny_checkpoint, random_blocks

    def encode(w, dtype, name):
        if w.ndim == 1:
            return w.astype("float32"), None
        six = name in ("token_embd.weight", "output.weight") or ".attn_v." in name or ".ffn_down." in name
        qtype = "Q6_K" if six else "Q4_K"
        return random_blocks(qtype, *w.shape, seed=crc32(name.encode())), GGMLQuantizationType[qtype]

    path = tmp_path_factory.mktemp("tiny-k-quant-gguf") / "tiny-q4_k_m.gguf"
    with mock.patch.object(gguf_writer, "_encode", encode):
        gguf_writer.write_gguf(make_tiny_checkpoint(seed=11, hidden_size=256, intermediate_size=256), path)
    return path


@pytest.fixture(scope="session")
def tiny_k_quant_artifacts(tiny_k_quant_gguf, tmp_path_factory) -> Path:
    """The tiny k-quant GGUF exported as it comes (`--quantize auto`: "gguf", each weight's own blocks)."""
    return _export_and_compile(tiny_k_quant_gguf, tmp_path_factory.mktemp("tiny-k-quant"))


@pytest.fixture(scope="session")
def tiny_q4_1_artifacts(tiny_q4_1_gguf, tmp_path_factory) -> Path:
    """The tiny Q4_1 GGUF exported as it comes (`--quantize auto`: its own blocks)."""
    return _export_and_compile(tiny_q4_1_gguf, tmp_path_factory.mktemp("tiny-q4_1"))


# The diffusion LMs' export: denoise sizes 1 and 4 (guidance takes two rows), the greedy summaries
# too (so both paths run), the tiny context.
DIFFUSION_EXPORT_ARGS = ["--bs-denoise", "1,4", "--denoise-top", "--block-seq-stride", "16", "--max-seq-len", "256",
                         "--device-block-count", "64"]


@pytest.fixture(scope="session")
def tiny_llada_hf(tmp_path_factory) -> Path:
    from tests.diffusion_model import write_tiny_llada

    return write_tiny_llada(tmp_path_factory.mktemp("tiny-llada-hf"))


@pytest.fixture(scope="session")
def tiny_dream_hf(tmp_path_factory) -> Path:
    from tests.diffusion_model import write_tiny_dream

    return write_tiny_dream(tmp_path_factory.mktemp("tiny-dream-hf"))


@pytest.fixture(scope="session")
def tiny_llada_artifacts(tiny_llada_hf, tmp_path_factory) -> Path:
    """The tiny LLaDA (unshifted logits), exported with denoise functions and compiled for the CPU."""
    return _export_and_compile(tiny_llada_hf, tmp_path_factory.mktemp("tiny-llada-artifacts"), DIFFUSION_EXPORT_ARGS)


@pytest.fixture(scope="session")
def tiny_dream_artifacts(tiny_dream_hf, tmp_path_factory) -> Path:
    """The tiny Dream (shifted logits, q/k/v bias), likewise."""
    return _export_and_compile(tiny_dream_hf, tmp_path_factory.mktemp("tiny-dream-artifacts"), DIFFUSION_EXPORT_ARGS)


@pytest.fixture(scope="session")
def tiny_verifier_hf(tiny_llada_hf, tmp_path_factory) -> Path:
    """A tiny autoregressive Llama with the tiny LLaDA's tokenizer: an APD verifier for it."""
    from kiln.models.loader import load_checkpoint

    llada = load_checkpoint(tiny_llada_hf)
    verifier = make_tiny_checkpoint(seed=5)
    verifier.tokenizer_json, verifier.tokenizer_config = llada.tokenizer_json, llada.tokenizer_config
    directory = tmp_path_factory.mktemp("tiny-verifier-hf")
    write_hf_directory(verifier, directory)
    return directory


@pytest.fixture(scope="session")
def tiny_verifier_artifacts(tiny_verifier_hf, tmp_path_factory) -> Path:
    return _export_and_compile(tiny_verifier_hf, tmp_path_factory.mktemp("tiny-verifier-artifacts"))


@pytest.fixture(scope="session")
def fake_model_dir(tiny_checkpoint, tmp_path_factory) -> Path:
    """Artifacts for tests/fake_program.py's FakeProgram: a config and the tiny tokenizer, no VMFB."""
    from tests.fake_program import write_fake_artifacts

    directory = tmp_path_factory.mktemp("fake-model")
    write_fake_artifacts(directory, tiny_checkpoint.tokenizer_json, tiny_checkpoint.tokenizer_config, embeddings=True)
    return directory


@pytest.fixture(scope="session")
def smollm2_checkpoint():
    from kiln.models.loader import load_checkpoint

    return load_checkpoint(None)


@pytest.fixture(scope="session")
def smollm2_artifacts() -> Path:
    """The bundled SmolLM2-135M-Instruct in float32 (its Q4_1 weights dequantized, as transformers
    loads them), compiled for the CPU with `kiln serve`'s build options otherwise: what the
    reference tokens and logits are checked against. Its decodes are the dynamic ones only: the
    fixed-shape twins are the default build's (smollm2_default_artifacts) and the tiny kernel
    builds' to test, and five more functions here would cost every run about a minute."""
    from dataclasses import replace

    from kiln.export.build import build, default_build_options

    options = replace(default_build_options(quantize="none"), decode_buckets=())
    return build(None, options, ["cpu"], log=lambda line: print(line, file=sys.stderr))


@pytest.fixture(scope="session")
def smollm2_default_artifacts() -> Path:
    """The bundled SmolLM2 exactly as `kiln serve` builds it with no model arguments (same
    options, same cache key): its own Q4_1 blocks (`--quantize auto`)."""
    from kiln.export.build import build, default_build_options

    return build(None, default_build_options(), ["cpu"], log=lambda line: print(line, file=sys.stderr))


@pytest.fixture(scope="session")
def start_server(tmp_path_factory):
    """start_server(*args) → a ready ServerProcess, stopped at the end of the session."""
    started: list[ServerProcess] = []

    def start(*args: str, ready: bool = True, env: dict | None = None) -> ServerProcess:
        log_path = tmp_path_factory.mktemp("serve") / "server.log"
        server = ServerProcess([str(a) for a in args], log_path, env)
        started.append(server)
        return server.wait_ready() if ready else server

    yield start
    for server in started:
        server.stop()
