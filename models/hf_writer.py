"""Write a Checkpoint as a Hugging Face model directory.

Other engines (transformers, llama.cpp's converter, sharktank) read that layout, so
this is how they get exactly the weights Kiln serves, whatever file those came from.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from kiln.runtime.errors import ModelLoadError

from .checkpoint import Checkpoint
from .config import LlamaConfig
from .registry import family_named


def hf_config_dict(config: LlamaConfig) -> dict:
    """config.json in Hugging Face's format for LlamaForCausalLM / Qwen2ForCausalLM."""
    family = family_named(config.architecture)
    if family.name not in ("llama", "qwen2"):
        raise ModelLoadError(f"Kiln writes HF directories of Llama and Qwen2 checkpoints, not {family.name}'s")
    qwen = family.name == "qwen2"
    eos = config.eos_token_ids
    d = {
        "architectures": [family.hf_architectures[0]],
        "model_type": family.name,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else list(eos),
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    if not qwen:
        d |= {"attention_bias": config.attention_bias, "mlp_bias": False, "pretraining_tp": 1}
    return d


def generation_config_dict(config: LlamaConfig, sampling: dict | None = None) -> dict:
    """generation_config.json: the stop ids, which HF takes from here rather than config.json,
    and the model's sampling defaults (`sampling`: Checkpoint.generation_defaults)."""
    eos = config.eos_token_ids
    return {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else list(eos),
        **({"do_sample": True, **sampling} if sampling else {}),
    }


def untied(checkpoint: Checkpoint) -> Checkpoint:
    """The same model with an explicit `lm_head.weight` (a copy of the embeddings) and
    `tie_word_embeddings` false: for readers that do not tie (sharktank)."""
    if not checkpoint.config.tie_word_embeddings:
        return checkpoint
    tensors = dict(checkpoint.tensors)
    tensors["lm_head.weight"] = np.array(tensors["model.embed_tokens.weight"], copy=True)
    config = dataclasses.replace(checkpoint.config, tie_word_embeddings=False)
    return dataclasses.replace(checkpoint, config=config, tensors=tensors)


def write_hf_directory(checkpoint: Checkpoint, directory: str | Path, shards: int = 1,
                       untie_lm_head: bool = False) -> Path:
    """Save `checkpoint` as an HF model directory: config.json, generation_config.json,
    safetensors (one file, or `shards` files with model.safetensors.index.json),
    tokenizer.json and tokenizer_config.json (with the chat template, if any)."""
    from safetensors.numpy import save_file

    if untie_lm_head:
        checkpoint = untied(checkpoint)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = checkpoint.config
    _write_json(directory / "config.json", hf_config_dict(config))
    _write_json(directory / "generation_config.json", generation_config_dict(config, checkpoint.generation_defaults))
    (directory / "tokenizer.json").write_text(checkpoint.tokenizer_json)
    _write_json(directory / "tokenizer_config.json", checkpoint.tokenizer_config)
    tensors = {k: np.ascontiguousarray(v) for k, v in checkpoint.tensors.items()}
    if shards <= 1:
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return directory
    names = list(tensors)
    per = -(-len(names) // shards)
    weight_map, total = {}, 0
    for s in range(shards):
        part = names[s * per : (s + 1) * per]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k] for k in part}, str(directory / fname), metadata={"format": "pt"})
        for k in part:
            weight_map[k] = fname
            total += tensors[k].nbytes
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _write_json(directory / "model.safetensors.index.json", index)
    return directory


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False))
