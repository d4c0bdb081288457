"""A Hugging Face model directory with a real model's shapes and random bf16 weights: what building,
holding and running a checkpoint of that size costs, where its own weights are not to be had offline.

    python -m benchmarks.synthetic_hf [--shapes llama-3.1-8b] [--shard-gib 5] [-o DIR]

What transformers saves for that architecture: config.json (LlamaForCausalLM, llama3 RoPE scaling),
sharded `model-0000K-of-0000N.safetensors` with their index, generation_config.json, and the
bundled SmolLM2's tokenizer (its vocabulary is smaller than the shapes', as a checkpoint's may be).
Written a tensor at a time, a slice at a time: never the model in memory. Weights are normal with a
standard deviation of 0.02, norms ones, as benchmarks/synthetic_gguf.py's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np

from benchmarks.synthetic_gguf import SHAPES, Shapes, hf_tensors, random_bf16


def _shards(tensors: list[tuple[str, tuple[int, ...]]], shard_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    shards, current, size = [], [], 0
    for name, shape in tensors:
        nbytes = int(np.prod(shape)) * 2
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((name, shape))
        size += nbytes
    return shards + [current]


def _write_shard(path: Path, tensors: list[tuple[str, tuple[int, ...]]], rng: np.random.Generator) -> None:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in tensors:
        nbytes = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as file:
        file.write(len(text).to_bytes(8, "little") + text)
        for name, shape in tensors:
            count = int(np.prod(shape))
            if len(shape) == 1:
                file.write(np.full(count, 0x3F80, np.uint16).tobytes())  # 1.0
                continue
            file.writelines(values.tobytes() for values in random_bf16(count, rng))


def write(directory: Path, shapes: Shapes, shard_gib: float = 5.0, seed: int = 0, log=print) -> Path:
    """Write the synthetic checkpoint into `directory` (through a temporary directory beside it)."""
    from kiln.models.default_model import default_model_path
    from kiln.models.loader import load_checkpoint

    s, rng = shapes, np.random.default_rng(seed)
    bundled = load_checkpoint(default_model_path())
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    started = time.monotonic()
    try:
        config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": s.hidden,
                  "intermediate_size": s.intermediate, "num_hidden_layers": s.layers, "num_attention_heads": s.heads,
                  "num_key_value_heads": s.kv_heads, "head_dim": s.hidden // s.heads, "vocab_size": s.vocab,
                  "max_position_embeddings": s.context, "rms_norm_eps": s.rms_eps, "rope_theta": s.rope_theta,
                  "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                  "bos_token_id": bundled.config.bos_token_id, "eos_token_id": bundled.config.eos_token_ids[0]}
        if s.llama3_rope:
            factor, low, high, original = s.llama3_rope
            config["rope_scaling"] = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                                      "high_freq_factor": high, "original_max_position_embeddings": original}
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": bundled.config.bos_token_id, "eos_token_id": bundled.config.eos_token_ids}))
        (tmp / "tokenizer.json").write_text(bundled.tokenizer_json)
        (tmp / "tokenizer_config.json").write_text(json.dumps(bundled.tokenizer_config))
        shards = _shards(hf_tensors(s), int(shard_gib * 2**30))
        weight_map = {}
        for index, tensors in enumerate(shards, start=1):
            name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
            _write_shard(tmp / name, tensors, rng)
            weight_map |= {tensor: name for tensor, _ in tensors}
            log(f"wrote {name} ({(tmp / name).stat().st_size / 2**30:.2f} GiB)")
        total = sum(int(np.prod(shape)) * 2 for _, shape in hf_tensors(s))
        (tmp / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        shutil.rmtree(directory, ignore_errors=True)
        tmp.rename(directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"wrote {directory} ({total / 2**30:.2f} GiB) in {time.monotonic() - started:.0f} s")
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--shard-gib", type=float, default=5.0, help="the most bytes a safetensors shard holds")
    parser.add_argument("-o", "--output", type=Path, help="default: <shapes>-synthetic-bf16 here")
    args = parser.parse_args()
    write(args.output or Path(f"{args.shapes}-synthetic-bf16"), SHAPES[args.shapes], args.shard_gib)


if __name__ == "__main__":
    main()
