"""Read the Hugging Face checkpoints of the diffusion LMs LLaDA and Dream (their entries in
registry.py).

Each is a Llama (LLaDA, in OLMo's names) or Qwen2 (Dream) decoder run without the causal
mask, so both become an ordinary Checkpoint in Kiln's tensor names, of the diffusion kind.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from kiln.runtime.errors import ModelLoadError

from .config import LlamaConfig
from .hf_loader import llama_config
from .lazy_arrays import LazyArrays, renamed

MASK_TOKEN_IDS = {"llada": 126336, "dream": 151666}  # upstream's defaults
_DISPLAY = {"llada": "LLaDA", "dream": "Dream"}

# config.json fields whose other values need math Kiln does not have: the values it runs,
# and the value upstream assumes when the field is absent. LLaDA's Llama block multiplies
# silu(ff_proj(x)) by up_proj(x) itself, so its SwiGLU is activation_type "silu".
_MISSING = object()
_REQUIRED_VALUES = {
    "llada": {
        "block_type": (("llama",), "sequential"),
        "activation_type": (("silu",), "swiglu"),
        "layer_norm_type": (("rms",), "default"),
        "layer_norm_with_affine": ((True,), True),
        "bias_for_layer_norm": ((None, False), None),
        "rope": ((True,), False),
        "alibi": ((False,), False),
        "include_bias": ((False,), False),
        "attention_layer_norm": ((False,), False),
        "input_emb_norm": ((False,), False),
        "scale_logits": ((False,), False),
        "block_group_size": ((1,), 1),
        "multi_query_attention": ((None, False), None),
    },
    "dream": {"hidden_act": (("silu",), "silu")},
}

# LLaDA's (OLMo's) tensor names, inside model.transformer, to Kiln's (HF Llama's).
_LLADA_BLOCK_PARTS = {
    "attn_norm": "input_layernorm",
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "attn_out": "self_attn.o_proj",
    "ff_norm": "post_attention_layernorm",
    "ff_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "ff_out": "mlp.down_proj",
}
_LLADA_TOP = {"wte": "model.embed_tokens", "ln_f": "model.norm", "ff_out": "lm_head"}
_LLADA_NAME = re.compile(r"(?:model\.)?transformer\.(?:blocks\.(\d+)\.)?(\w+)\.(weight|bias)")


def check_supported(kind: str, values: dict) -> None:
    """Refuse, naming the field, a config.json whose model Kiln's Llama math would not reproduce."""
    for field, (runs, default) in _REQUIRED_VALUES[kind].items():
        value = values.get(field, _MISSING)
        if (default if value is _MISSING else value) in runs:
            continue
        found = f"lacks {field} (so {default!r})" if value is _MISSING else f"has {field}={value!r}"
        raise ModelLoadError(
            f"unsupported {_DISPLAY[kind]} checkpoint: config.json {found}; "
            f"Kiln runs {field}={runs[0]!r} only"
        )


def llada_config(values: dict, name: str = "") -> LlamaConfig:
    """LLaDA's OLMo-style config.json as a LlamaConfig."""
    check_supported("llada", values)
    missing = [f for f in ("d_model", "n_heads", "n_layers", "vocab_size") if f not in values]
    if missing:
        raise ModelLoadError(f"LLaDA config.json lacks {', '.join(missing)}")
    d_model = values["d_model"]
    hf_values = {
        # The embedding matrix may have more rows than the tokenizer has tokens.
        "vocab_size": values.get("embedding_size") or values["vocab_size"],
        "hidden_size": d_model,
        "intermediate_size": values.get("mlp_hidden_size") or values.get("mlp_ratio", 4) * d_model,
        "num_hidden_layers": values["n_layers"],
        "num_attention_heads": values["n_heads"],
        "num_key_value_heads": values.get("n_kv_heads"),
        "rms_norm_eps": values.get("rms_norm_eps", 1e-5),
        "rope_theta": values.get("rope_theta", 10000.0),
        "max_position_embeddings": values.get("max_sequence_length", 1024),
        "tie_word_embeddings": values.get("weight_tying", True),
        "bos_token_id": values.get("bos_token_id"),
        "eos_token_id": values.get("eos_token_id"),
    }
    bias = bool(values.get("include_qkv_bias"))
    return _diffusion_config("llada", values, hf_values, name, attention_bias=bias, logits_shift=0)


def dream_config(values: dict, name: str = "") -> LlamaConfig:
    """Dream's config.json (Qwen2's fields) as a LlamaConfig; its q/k/v always carry a bias."""
    check_supported("dream", values)
    return _diffusion_config("dream", values, values, name, attention_bias=True, logits_shift=1)


def _diffusion_config(kind: str, values: dict, hf_values: dict, name: str, **decided) -> LlamaConfig:
    mask = values.get("mask_token_id", MASK_TOKEN_IDS[kind])
    config = llama_config(
        hf_values, name=name, architecture=kind, mask_token_id=mask, **decided
    )
    if not isinstance(mask, int) or not 0 <= mask < config.vocab_size:
        raise ModelLoadError(
            f"{_DISPLAY[kind]} config.json mask_token_id={mask!r} is not a token id below its "
            f"vocabulary size {config.vocab_size}: a diffusion LM needs its mask token"
        )
    return config


def llada_tensors(tensors: Mapping) -> LazyArrays:
    """LLaDA's tensors under Kiln's names: model.transformer.blocks.3.ff_out.weight is
    model.layers.3.mlp.down_proj.weight, model.transformer.ff_out.weight is lm_head.weight."""
    for name in tensors:
        _llada_name(name)
    return renamed(tensors, _llada_name)


def _llada_name(name: str) -> str:
    match = _LLADA_NAME.fullmatch(name)
    layer, part, kind = match.groups() if match else (None, None, None)
    parts = _LLADA_TOP if layer is None else _LLADA_BLOCK_PARTS
    if part not in parts or (kind == "bias" and part not in ("q_proj", "k_proj", "v_proj")):
        raise ModelLoadError(f"unexpected tensor {name!r} in a LLaDA checkpoint")
    prefix = "" if layer is None else f"model.layers.{layer}."
    return f"{prefix}{parts[part]}.{kind}"
