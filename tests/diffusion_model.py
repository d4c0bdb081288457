"""Tiny random LLaDA and Dream checkpoints, written exactly in their upstream HF formats.

The diffusion loader must read what GSAI-ML and Dream-org publish (LLaDA's OLMo-style names
and flags, Dream's Qwen2 config), so these write that, with a real mask token in the vocabulary.
The output head is scaled up so that confidences differ clearly between positions.
"""

from __future__ import annotations

import json
from pathlib import Path

from kiln.models.checkpoint import Checkpoint
from kiln.models.config import LlamaConfig
from kiln.models.hf_loader import llama_config
from kiln.models.hf_writer import write_hf_directory
from tests.tiny_model import (
    BOS_ID, EOS_ID, IM_END_ID, SPECIAL_TOKENS, make_tiny_tokenizer, random_weights, tiny_tokenizer_config,
)

MASK_TOKEN = "<|mdm_mask|>"
MASK_ID = len(SPECIAL_TOKENS)  # 4: the special tokens take the first ids, in order
DIFFUSION_SPECIAL_TOKENS = [*SPECIAL_TOKENS, MASK_TOKEN]
VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, MLP, MAX_SEQ = 384, 64, 2, 4, 2, 128, 256

# Kiln's per-layer names -> LLaDA's (model.transformer.blocks.{i}.<name>).
LLADA_BLOCK_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "q_proj",
    "self_attn.k_proj": "k_proj",
    "self_attn.v_proj": "v_proj",
    "self_attn.o_proj": "attn_out",
    "post_attention_layernorm": "ff_norm",
    "mlp.gate_proj": "ff_proj",
    "mlp.up_proj": "up_proj",
    "mlp.down_proj": "ff_out",
}


def llada_config_dict(weight_tying: bool = False, **overrides) -> dict:
    """config.json as LLaDA-8B's, at the tiny sizes."""
    return {
        "architectures": ["LLaDAModelLM"],
        "model_type": "llada",
        "activation_type": "silu",
        "alibi": False,
        "attention_layer_norm": False,
        "bias_for_layer_norm": False,
        "block_group_size": 1,
        "block_type": "llama",
        "d_model": HIDDEN,
        "embedding_size": VOCAB,
        "eos_token_id": EOS_ID,
        "include_bias": False,
        "include_qkv_bias": False,
        "input_emb_norm": False,
        "layer_norm_type": "rms",
        "layer_norm_with_affine": True,
        "mask_token_id": MASK_ID,
        "max_sequence_length": MAX_SEQ,
        "mlp_hidden_size": MLP,
        "mlp_ratio": MLP // HIDDEN,
        "multi_query_attention": None,
        "n_heads": HEADS,
        "n_kv_heads": KV_HEADS,
        "n_layers": LAYERS,
        "pad_token_id": EOS_ID,
        "rms_norm_eps": 1e-5,
        "rope": True,
        "rope_full_precision": True,
        "rope_theta": 10000.0,
        "scale_logits": False,
        "vocab_size": VOCAB,
        "weight_tying": weight_tying,
        **overrides,
    }


def dream_config_dict(**overrides) -> dict:
    """config.json as Dream-v0-7B's, at the tiny sizes."""
    return {
        "architectures": ["DreamModel"],
        "model_type": "Dream",
        "bos_token_id": EOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": EOS_ID,
        "mask_token_id": MASK_ID,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "intermediate_size": MLP,
        "max_position_embeddings": MAX_SEQ,
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "vocab_size": VOCAB,
        **overrides,
    }


def write_tiny_llada(directory: str | Path, seed: int = 0, *, shards: int = 1, dtype: str = "float32",
                     weight_tying: bool = False, output_scale: float = 3.0, **config_overrides) -> Path:
    """A tiny random LLaDA in GSAI-ML's layout; `config_overrides` replace config.json fields.
    Stop ids: </s> (1) in config.json, </s> and <|im_end|> (3) in generation_config.json."""
    values = llada_config_dict(weight_tying, **config_overrides)
    shape = LlamaConfig(
        vocab_size=values["embedding_size"] or values["vocab_size"],
        hidden_size=values["d_model"],
        intermediate_size=values["mlp_hidden_size"],
        num_hidden_layers=values["n_layers"],
        num_attention_heads=values["n_heads"],
        num_key_value_heads=values["n_kv_heads"],
        tie_word_embeddings=values["weight_tying"],
        attention_bias=values["include_qkv_bias"],
    )
    tensors = {_llada_name(name): w for name, w in _scaled_weights(shape, seed, output_scale).items()}
    generation = {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID], "pad_token_id": EOS_ID}
    return _write(directory, values, generation, tensors, True, shards, dtype)


def write_tiny_dream(directory: str | Path, seed: int = 0, *, shards: int = 1, dtype: str = "float32",
                     output_scale: float = 3.0, **config_overrides) -> Path:
    """A tiny random Dream in Dream-org's layout (Qwen2 names, q/k/v biases, no BOS added);
    `config_overrides` replace config.json fields. Stop id: </s> (1)."""
    values = dream_config_dict(**config_overrides)
    shape = llama_config(values, attention_bias=True)  # Dream's config.json is in HF's names
    generation = {key: values[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    tensors = _scaled_weights(shape, seed, output_scale)
    return _write(directory, values, generation, tensors, False, shards, dtype)


def _scaled_weights(shape: LlamaConfig, seed: int, output_scale: float) -> dict:
    """Random weights whose output matrix has std output_scale / sqrt(hidden): logits of a
    few units' spread, so the softmax is peaky and its maximum varies between positions."""
    tensors = random_weights(shape, seed)
    head = "model.embed_tokens.weight" if shape.tie_word_embeddings else "lm_head.weight"
    tensors[head] *= output_scale / (tensors[head].std() * shape.hidden_size**0.5)
    return tensors


def _llada_name(name: str) -> str:
    if name.startswith("model.layers."):
        layer, part = name[len("model.layers."):].split(".", 1)
        part, kind = part.rsplit(".", 1)
        return f"model.transformer.blocks.{layer}.{LLADA_BLOCK_NAMES[part]}.{kind}"
    top = {"model.embed_tokens.weight": "wte", "model.norm.weight": "ln_f", "lm_head.weight": "ff_out"}[name]
    return f"model.transformer.{top}.weight"


def _write(directory, values: dict, generation: dict, tensors: dict, add_bos: bool,
           shards: int, dtype: str) -> Path:
    """Tensors (sharded with an index when shards > 1), tokenizer files, then the upstream
    config.json and generation_config.json over the Llama ones hf_writer writes."""
    tokenizer = make_tiny_tokenizer(VOCAB, add_bos=add_bos, special_tokens=DIFFUSION_SPECIAL_TOKENS)
    extra = {"mask_token": MASK_TOKEN} if add_bos else {"mask_token": MASK_TOKEN, "bos_token": None}
    checkpoint = Checkpoint(
        config=LlamaConfig(VOCAB, HIDDEN, MLP, LAYERS, HEADS, KV_HEADS),
        tensors=tensors,
        tokenizer_json=tokenizer.to_str(),
        tokenizer_config=tiny_tokenizer_config(add_bos, MAX_SEQ, **extra),
    )
    directory = write_hf_directory(checkpoint, directory, shards=shards)
    (directory / "config.json").write_text(json.dumps(values, indent=2))
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    if dtype == "bfloat16":
        _to_bfloat16(directory)
    elif dtype != "float32":
        raise ValueError(f"dtype {dtype!r}: float32 or bfloat16")
    return directory


def _to_bfloat16(directory: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    for path in directory.glob("*.safetensors"):
        tensors = {name: t.to(torch.bfloat16) for name, t in load_file(str(path)).items()}
        save_file(tensors, str(path), metadata={"format": "pt"})
