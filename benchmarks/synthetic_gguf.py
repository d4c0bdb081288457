"""A GGUF with a real model's shapes and random weights: what a build, a load and a decode at that
size cost, where the model's own weights are not to be had offline.

    python -m benchmarks.synthetic_gguf [--shapes llama-3.1-8b] [--type Q4_0] [-o FILE]

The file is what llama.cpp's converter writes for that architecture (names, metadata, the llama3
RoPE factors as `rope_freqs.weight`), every 2-D weight in one block type, norms in F32, and is
written a tensor at a time (never the whole model in memory). Its tokenizer is the bundled
SmolLM2's, padded to the shapes' vocabulary. Weights are random blocks whose values have a
standard deviation of 0.02 and mean zero (each block's scale a random sign), so activations stay
in range and the output is gibberish, as expected.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

WEIGHT_STD = 0.02


@dataclass(frozen=True)
class Shapes:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    context: int
    rope_theta: float
    rms_eps: float
    # Llama 3.1's RoPE scaling (factor, low and high frequency factors, original context), or None.
    llama3_rope: tuple[float, float, float, int] | None = None


SHAPES = {
    "llama-3.1-8b": Shapes(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256,
                           context=131072, rope_theta=500000.0, rms_eps=1e-5, llama3_rope=(8.0, 1.0, 4.0, 8192)),
    # A small one of the same form, for the tests.
    "tiny": Shapes(layers=2, hidden=128, intermediate=256, heads=4, kv_heads=2, vocab=49152 + 64,
                   context=2048, rope_theta=500000.0, rms_eps=1e-5, llama3_rope=(8.0, 1.0, 4.0, 1024)),
}
BLOCK_TYPES = ("Q4_0", "Q8_0")
# Every 2-D weight as bfloat16 values: what a bf16 checkpoint converted by llama.cpp's converter holds.
WEIGHT_TYPES = (*BLOCK_TYPES, "BF16")
SLICE_ELEMENTS = 1 << 24  # random values made at a time


def random_bf16(count: int, rng: np.random.Generator):
    """`count` normal values of standard deviation WEIGHT_STD as bfloat16 bit patterns (uint16),
    made a slice at a time."""
    for begin in range(0, count, SLICE_ELEMENTS):
        values = rng.standard_normal(min(SLICE_ELEMENTS, count - begin), dtype=np.float32) * WEIGHT_STD
        yield (values.view(np.uint32) >> 16).astype(np.uint16)


def hf_tensors(s: Shapes) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of a Llama checkpoint of these shapes, in transformers' order."""
    head_dim = s.hidden // s.heads
    names: list = [("model.embed_tokens.weight", (s.vocab, s.hidden))]
    for i in range(s.layers):
        layer = f"model.layers.{i}"
        names += [(f"{layer}.input_layernorm.weight", (s.hidden,)),
                  (f"{layer}.self_attn.q_proj.weight", (s.heads * head_dim, s.hidden)),
                  (f"{layer}.self_attn.k_proj.weight", (s.kv_heads * head_dim, s.hidden)),
                  (f"{layer}.self_attn.v_proj.weight", (s.kv_heads * head_dim, s.hidden)),
                  (f"{layer}.self_attn.o_proj.weight", (s.hidden, s.heads * head_dim)),
                  (f"{layer}.post_attention_layernorm.weight", (s.hidden,)),
                  (f"{layer}.mlp.gate_proj.weight", (s.intermediate, s.hidden)),
                  (f"{layer}.mlp.up_proj.weight", (s.intermediate, s.hidden)),
                  (f"{layer}.mlp.down_proj.weight", (s.hidden, s.intermediate))]
    return names + [("model.norm.weight", (s.hidden,)), ("lm_head.weight", (s.vocab, s.hidden))]


def _tensors(s: Shapes) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, [rows, columns] or [n]) in llama.cpp's order: the checkpoint's, renamed."""
    from kiln.models.gguf_writer import gguf_tensor_name

    return [(gguf_tensor_name(name), shape) for name, shape in hf_tensors(s)]


def random_blocks(rows: int, columns: int, type_name: str, rng: np.random.Generator) -> np.ndarray:
    """[rows, columns] random weights as `type_name`'s blocks, bytes [rows, columns / 32 * size]."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType[type_name]
    block, size = GGML_QUANT_SIZES[qtype]
    count = rows * columns // block
    out = np.empty((count, size), np.uint8)
    if type_name == "Q4_0":  # d, then 32 nibbles q with value d * (q - 8): q - 8's std is 4.61
        quants, spread = rng.integers(0, 256, (count, size - 2), dtype=np.uint8), 4.61
    else:  # Q8_0: d, then 32 int8 q with value d * q
        quants, spread = rng.integers(-127, 128, (count, size - 2), dtype=np.int8).view(np.uint8), 73.6
    signs = rng.integers(0, 2, count) * 2 - 1  # cancels Q4_0's -0.5 mean per block
    out[:, :2] = (signs * (WEIGHT_STD / spread)).astype(np.float16).view(np.uint8).reshape(count, 2)
    out[:, 2:] = quants
    return out.reshape(rows, columns // block * size)


def _tokenizer(vocab: int) -> dict:
    """The bundled SmolLM2's tokenizer as GGUF metadata, its token list padded to `vocab`."""
    from kiln.models.default_model import default_model_path
    from kiln.models.gguf_tokenizer import tokenizer_to_gguf
    from kiln.models.loader import load_checkpoint

    bundled = load_checkpoint(default_model_path())
    return tokenizer_to_gguf(bundled.tokenizer_json, bundled.tokenizer_config, vocab)


def write(path: Path, shapes: Shapes, type_name: str = "Q4_0", seed: int = 0, log=print) -> Path:
    """Write the synthetic GGUF to `path` (through a temporary file beside it)."""
    import gguf
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from kiln.models.gguf_loader import llama3_rope_factors
    from kiln.models.gguf_writer import add_value

    if type_name not in WEIGHT_TYPES:
        raise ValueError(f"--type must be one of {WEIGHT_TYPES}")
    s, rng = shapes, np.random.default_rng(seed)
    head_dim = s.hidden // s.heads
    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(tmp, "llama")
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(f"synthetic {path.stem}")
    w.add_block_count(s.layers)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.intermediate)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_vocab_size(s.vocab)
    w.add_rope_dimension_count(head_dim)
    w.add_file_type(int(gguf.LlamaFileType[f"MOSTLY_{type_name}"]))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value in _tokenizer(s.vocab).items():
        add_value(w, key, value)

    qtype = GGMLQuantizationType[type_name]
    block, size = GGML_QUANT_SIZES[qtype]  # BF16: a "block" of one value, 2 bytes
    extra = {}
    if s.llama3_rope:
        extra["rope_freqs.weight"] = llama3_rope_factors(s.rope_theta, head_dim, *s.llama3_rope)
        w.add_tensor_info("rope_freqs.weight", (head_dim // 2,), np.dtype(np.float32), head_dim // 2 * 4)
    tensors = _tensors(s)
    for name, shape in tensors:
        if len(shape) == 1:
            w.add_tensor_info(name, shape, np.dtype(np.float32), shape[0] * 4)
        else:
            byte_shape = (shape[0], shape[1] // block * size)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), byte_shape[0] * byte_shape[1], raw_dtype=qtype)
    started = time.monotonic()
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for name, values in extra.items():
            w.write_tensor_data(np.asarray(values, np.float32))
        for name, shape in tensors:
            if len(shape) == 1:
                w.write_tensor_data(np.ones(shape, np.float32))
            elif type_name == "BF16":
                w.write_tensor_data(np.concatenate(list(random_bf16(shape[0] * shape[1], rng))).view(np.uint8))
            else:
                w.write_tensor_data(random_blocks(*shape, type_name, rng))
        w.close()
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    log(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.monotonic() - started:.0f} s")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--type", choices=WEIGHT_TYPES, default="Q4_0", help="every 2-D weight's type")
    parser.add_argument("-o", "--output", type=Path, help="default: <shapes>-synthetic-<type>.gguf here")
    args = parser.parse_args()
    write(args.output or Path(f"{args.shapes}-synthetic-{args.type.lower()}.gguf"), SHAPES[args.shapes], args.type)


if __name__ == "__main__":
    main()
