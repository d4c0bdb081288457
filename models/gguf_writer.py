"""Write a `Checkpoint` as a llama.cpp-compatible GGUF file.

The tests use it for HF -> GGUF -> HF round trips on a tiny model, and benchmarks
use it to hand llama.cpp the same weights Kiln serves (an F32/F16 SmolLM2).
Naming, Q/K permutation, metadata and tokenizer follow llama.cpp's convert_hf_to_gguf.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from kiln.runtime.errors import ModelLoadError

from .checkpoint import Checkpoint
from .gguf_loader import (ADJACENT_PAIRS, EXPERT_NAMES, GLOBAL_NAMES, LAYER_NAMES, LONGROPE_FACTORS, PERMUTED_QK,
                          SAMPLING_KEYS, llama3_rope_factors)
from .registry import family_named
from .rope import permute_qk
from .gguf_tokenizer import tokenizer_to_gguf

WRITE_DTYPES = ("f32", "f16", "q8_0", "q4_0", "q4_1")

_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_HF_GLOBAL_RE = re.compile(r"^(.+)\.(weight|bias)$")
_TO_GGUF_LAYER = {hf: g for g, hf in LAYER_NAMES.items()}
_TO_GGUF_GLOBAL = {hf: g for g, hf in GLOBAL_NAMES.items()}
_TO_GGUF_EXPERTS = {kiln: g for g, kiln in EXPERT_NAMES.items()}
_HF_EXPERTS_RE = re.compile(r"^model\.layers\.(\d+)\.(mlp\.experts\.\w+)$")


def gguf_tensor_name(hf_name: str) -> str:
    """llama.cpp's name for an HF tensor name."""
    if (m := _HF_EXPERTS_RE.match(hf_name)) and m.group(2) in _TO_GGUF_EXPERTS:
        return f"blk.{m.group(1)}.{_TO_GGUF_EXPERTS[m.group(2)]}.weight"
    if m := _HF_LAYER_RE.match(hf_name):
        if m.group(2) in _TO_GGUF_LAYER:
            return f"blk.{m.group(1)}.{_TO_GGUF_LAYER[m.group(2)]}.{m.group(3)}"
    elif m := _HF_GLOBAL_RE.match(hf_name):
        if m.group(1) in _TO_GGUF_GLOBAL:
            return f"{_TO_GGUF_GLOBAL[m.group(1)]}.{m.group(2)}"
    raise ModelLoadError(f"tensor {hf_name} has no GGUF name")


def _encode(w: np.ndarray, dtype: str, name: str):
    """(data, raw ggml type or None) for one tensor at the requested file type.

    Like llama.cpp, 1-D tensors (norms, biases) stay F32, the block types fall back to F16
    for rows that are not a multiple of their 32-element block, and the Q4 types keep the
    token embedding in Q8_0 (as the bundled SmolLM2's Q4_1 file does).
    """
    from gguf import GGMLQuantizationType, quants

    if dtype == "f32" or w.ndim == 1:
        return w.astype(np.float32), None
    if dtype in ("q8_0", "q4_0", "q4_1") and w.shape[-1] % 32 == 0:
        qtype = GGMLQuantizationType.Q8_0 if name == "token_embd.weight" else GGMLQuantizationType[dtype.upper()]
        return quants.quantize(w, qtype), qtype
    return w.astype(np.float16), None


def add_value(writer, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        writer.add_array(key, list(value))
    else:
        raise TypeError(f"cannot write {key}={value!r} to GGUF")


def write_gguf(checkpoint: Checkpoint, path: str | Path, dtype: str = "f32") -> Path:
    """Write `checkpoint` to `path` as GGUF with weights in `dtype` (WRITE_DTYPES)."""
    import gguf

    if dtype not in WRITE_DTYPES:
        raise ValueError(f"dtype must be one of {WRITE_DTYPES}, not {dtype!r}")
    c = checkpoint.config
    arch = c.architecture
    if arch not in WRITTEN_ARCHITECTURES:
        raise ModelLoadError(f"cannot write architecture {arch!r} to GGUF")
    gguf_arch = "llama" if arch == "mixtral" else family_named(arch).gguf_architecture
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")

    w = gguf.GGUFWriter(tmp, gguf_arch)
    w.add_type(gguf.GGUFType.MODEL)
    if c.name:
        w.add_name(c.name)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_theta))
    w.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(c.rotary_dim)
    if c.head_dim != c.hidden_size // c.num_attention_heads:
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
                 "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}[dtype]
    w.add_file_type(int(file_type))
    if dtype not in ("f32", "f16"):
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    if c.num_experts:
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_weights_norm(c.norm_topk_prob)
        if arch in ("qwen3_moe", "qwen2_moe"):
            w.add_expert_feed_forward_length(c.moe_intermediate_size)
        if c.shared_expert_intermediate_size:
            w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if c.sliding_window and c.layer_types:
        w.add_sliding_window(c.sliding_window)
        if arch in ("olmo2", "exaone4"):
            w.add_sliding_window_pattern([c.is_sliding(i) for i in range(c.num_hidden_layers)])
            if c.rope_local_theta is not None:
                w.add_rope_freq_base_swa(float(c.rope_local_theta))
    if arch == "smollm3" and c.unrotated_layers != [i for i in range(c.num_hidden_layers) if (i + 1) % 4 == 0]:
        raise ModelLoadError(f"cannot write layers {c.unrotated_layers} without rotary to GGUF: llama.cpp "
                             "takes every fourth")
    if arch == "granite":
        w.add_embedding_scale(float(c.embedding_multiplier))
        w.add_residual_scale(float(c.residual_multiplier))
        w.add_logit_scale(float(c.logits_scaling))
        if c.query_pre_attn_scalar is not None:
            w.add_attention_scale(float(c.query_pre_attn_scalar) ** -0.5)
    if arch == "gemma2":
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(c, name) is not None:
                getattr(w, f"add_{name}")(float(getattr(c, name)))

    rope_freqs = None
    longrope = {}
    scaling = c.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "longrope":
        # Phi-3's converter: the factors as tensors, the original context and cos/sin's factor as keys.
        from .llama import rope_attention_factor

        longrope = {name: np.asarray(scaling[key], dtype=np.float32) for name, key in LONGROPE_FACTORS.items()}
        w.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
        w.add_rope_scaling_attn_factors(float(rope_attention_factor(c)))
    elif rope_type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(scaling["factor"]))
    elif rope_type == "llama3":
        rope_freqs = llama3_rope_factors(
            c.rope_theta, c.rotary_dim, float(scaling["factor"]),
            float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0)),
            int(scaling.get("original_max_position_embeddings", 8192)),
        )
    elif rope_type == "yarn":
        if scaling.get("mscale", 1.0) != 1.0 or not scaling.get("truncate", True):
            raise ModelLoadError(f"cannot write YaRN's {scaling} to GGUF: llama.cpp takes an mscale of 1, truncated")
        original = scaling.get("original_max_position_embeddings") or c.max_position_embeddings
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(scaling.get("factor") or c.max_position_embeddings / original))
        w.add_rope_scaling_orig_ctx_len(int(original))
        for name, add in (("attention_factor", w.add_rope_scaling_yarn_attn_factor),
                          ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                          ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
            if scaling.get(name) is not None:
                add(float(scaling[name]))
        if scaling.get("mscale") and scaling.get("mscale_all_dim"):
            w.add_rope_scaling_yarn_log_mul(float(scaling["mscale_all_dim"]))
    elif rope_type not in (None, "default"):
        raise ModelLoadError(f"cannot write rope scaling {scaling} to GGUF")

    for field, value in checkpoint.generation_defaults.items():  # as gguf_loader reads them back
        key = f"general.sampling.{SAMPLING_KEYS[field]}"
        if field == "top_k":
            w.add_int32(key, value)
        else:
            w.add_float32(key, value)

    # Tokenizer.
    meta = tokenizer_to_gguf(checkpoint.tokenizer_json, checkpoint.tokenizer_config, c.vocab_size)
    if "tokenizer.ggml.bos_token_id" not in meta and c.bos_token_id is not None:
        meta["tokenizer.ggml.bos_token_id"] = c.bos_token_id
    eos = meta.get("tokenizer.ggml.eos_token_id")
    if eos is None and c.eos_token_ids:
        eos = meta["tokenizer.ggml.eos_token_id"] = c.eos_token_ids[0]
    # Further end-of-generation ids: llama.cpp stops on eot and eom too.
    extra = [i for i in c.eos_token_ids if i != eos]
    for key, token_id in zip(("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"), extra):
        meta[key] = token_id
    for key, value in meta.items():
        add_value(w, key, value)

    # Tensors.
    tensors = checkpoint.tensors
    order = sorted(tensors, key=_tensor_order)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
    for name, factors in longrope.items():
        w.add_tensor(name, factors)
    for name in order:
        if c.tie_word_embeddings and name == "lm_head.weight":
            continue
        fusions = FUSED.get(arch, {})
        if name.endswith(tuple(part for _, parts in fusions.values() for part in parts[1:])):
            continue  # written inside its fused tensor
        if (m := _HF_LAYER_RE.match(name)) and f"{m.group(2)}.weight" in fusions:
            fused, parts = fusions[f"{m.group(2)}.weight"]
            base, gname = f"model.layers.{m.group(1)}.", f"blk.{m.group(1)}.{fused}.weight"
            data, raw = _encode(np.concatenate([np.asarray(tensors[base + part], dtype=np.float32) for part in parts]),
                                dtype, gname)
            w.add_tensor(gname, data, raw_dtype=raw)
            continue
        gname = gguf_tensor_name(name)
        t = np.asarray(tensors[name], dtype=np.float32)
        if arch in PERMUTED_QK + ADJACENT_PAIRS and (".attn_q." in gname or ".attn_k." in gname):
            t = permute_qk(t, c.num_attention_heads if ".attn_q." in gname else c.num_key_value_heads, c.rotary_dim)
        data, raw = _encode(t, dtype, gname)
        w.add_tensor(gname, data, raw_dtype=raw)

    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


# Fused tensors, as each family's converter writes them: the first part's name -> (the fused tensor's
# GGUF name, its parts in order). gate_up goes by ffn_up, gate rows first (Phi-3's, GLM-4's).
_GATE_UP = {"mlp.gate_proj.weight": ("ffn_up", ("mlp.gate_proj.weight", "mlp.up_proj.weight"))}
FUSED = {"phi3": {"self_attn.q_proj.weight": ("attn_qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                           "self_attn.v_proj.weight")), **_GATE_UP},
         "glm4": _GATE_UP}
WRITTEN_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "phi3", "gemma", "gemma2",
                         "smollm3", "granite", "olmo2", "exaone4", "ernie4_5", "glm4")


def _tensor_order(name: str):
    if m := _HF_LAYER_RE.match(name):
        return (1, int(m.group(1)), name)
    return (0 if "embed_tokens" in name else 2, 0, name)
