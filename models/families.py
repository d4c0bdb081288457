"""The families that depart from Llama's layer (Mistral's window, Qwen3, Qwen3-MoE, Mixtral, Phi-3,
Gemma 2 and 3): their config.json, their tensors, and what their GGUF metadata leaves unsaid.

Each reader turns what its family's checkpoint says into the LlamaConfig fields the model reads
(QK-norm, GeGLU, sandwich norms, sliding layers...) and its tensors into Kiln's (Llama's) names,
so the one model in llama.py runs them all.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import numpy as np

from kiln.runtime.errors import ModelLoadError

from .config import FULL, SLIDING, LlamaConfig
from .hf_loader import hf_llama_config, hf_llama_tensors, llama_config
from .lazy_arrays import LazyArrays, lazy, renamed, rows
from .rope import unpermute_qk

# Gemma's turns: `model` for the assistant, a system message folded into the first user turn.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set system = messages[0]['content'] + '\n\n' if messages and messages[0]['role'] == 'system' else '' %}"
    "{% for message in messages if message['role'] != 'system' %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{{ (system if loop.first else '') + (message['content'] | trim) + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
GEMMA3_LOCAL_THETA = 10000.0  # Gemma 3's rope_local_base_freq where a checkpoint leaves it out

# config.json's activation names, by what LlamaConfig.hidden_act calls them.
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def _activation(values: dict, default: str) -> str:
    name = values.get("hidden_activation") or values.get("hidden_act") or default
    if name not in _ACTIVATIONS:
        raise ModelLoadError(f"config.json's activation {name!r} is not supported: Kiln runs {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def text_config(values: dict) -> dict:
    """The config.json fields of a multimodal checkpoint's language model (its `text_config`, with the
    start and end ids the wrapper sets), which Kiln serves alone; a text checkpoint's as they are."""
    text = values.get("text_config")
    if not isinstance(text, dict):
        return values
    return {k: values[k] for k in ("bos_token_id", "eos_token_id") if k in values} | text


# A multimodal checkpoint's language model's names (as transformers writes them, and its older
# layout) and a text checkpoint's; the rest (its vision tower and projector) is left out.
_LANGUAGE_MODEL = (("language_model.model.", "model."), ("model.language_model.", "model."),
                   ("language_model.lm_head.", "lm_head."))
_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def language_model_tensors(tensors: Mapping) -> LazyArrays:
    """A multimodal checkpoint's language model's tensors under a text checkpoint's names (a text
    checkpoint's as they are)."""
    source, text = lazy(tensors), LazyArrays()
    for name in source:
        old, new = next(((old, new) for old, new in _LANGUAGE_MODEL if name.startswith(old)), ("", ""))
        if old:
            text.add_from(source, name, new + name[len(old):])
        elif not name.startswith(_VISION):
            text.add_from(source, name)
    return text


def llama_family_config(values: dict, name: str) -> LlamaConfig:
    """Llama and Mistral. Mistral's config.json may set a sliding window over every layer (v0.1's
    4,096; null from v0.2), which transformers applies; a Llama or Qwen2 config's `sliding_window`
    is not one (Qwen2's sits beside `use_sliding_window: false`). Of Mistral Small 3's multimodal
    checkpoints (Mistral3ForConditionalGeneration), its language model."""
    values = text_config(values)
    window = values.get("sliding_window") if values.get("model_type") == "mistral" else None
    layers = values.get("num_hidden_layers", 0)
    types = values.get("layer_types") or ([SLIDING] * layers if window else [])
    return hf_llama_config(values | {"layer_types": types}, name, "llama", attention_bias=False)


def qwen3_config(values: dict, name: str) -> LlamaConfig:
    """Qwen3: Qwen2's layer with an RMSNorm over each head's q and k, and no q/k/v bias."""
    return hf_llama_config(values, name, "qwen3", attention_bias=False, qk_norm=True)


def smollm3_config(values: dict, name: str) -> LlamaConfig:
    """SmolLM3: Llama's layer, with no rotary in every `no_rope_layer_interval`-th layer (NoPE;
    `no_rope_layers` flags each layer, 1 where it rotates)."""
    layers = int(values.get("num_hidden_layers", 0))
    interval = int(values.get("no_rope_layer_interval") or 4)
    rotates = values.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    if len(rotates) != layers:
        raise ModelLoadError(f"no_rope_layers has {len(rotates)} flags for {layers} layers")
    return hf_llama_config(values, name, "smollm3", attention_bias=False,
                           unrotated_layers=[i for i, rotary in enumerate(rotates) if not rotary])


def smollm3_gguf_config(key, fields: dict) -> dict:
    """A `smollm3` GGUF: every fourth layer without rotary, as llama.cpp takes it."""
    return dict(unrotated_layers=[i for i in range(fields["num_hidden_layers"]) if (i + 1) % 4 == 0])


def granite_config(values: dict, name: str) -> LlamaConfig:
    """Granite (3.x, dense): Llama's layer with its embeddings, scores, sublayer outputs and logits
    each scaled by a multiplier of the config's."""
    return hf_llama_config(values, name, "granite", attention_bias=bool(values.get("attention_bias", False)),
                           **_granite_scales(values.get("embedding_multiplier"), values.get("attention_multiplier"),
                                             values.get("residual_multiplier"), values.get("logits_scaling")))


def granite_gguf_config(key, fields: dict) -> dict:
    """A `granite` GGUF: the multipliers as llama.cpp's converter names them (…_scale)."""
    return _granite_scales(key("embedding_scale"), key("attention.scale"), key("residual_scale"), key("logit_scale"))


def _granite_scales(embedding, attention, residual, logits) -> dict:
    """Granite's four multipliers as LlamaConfig fields; a score multiplier m is a
    query_pre_attn_scalar of m^-2 (scores are scaled by that scalar's -1/2 power)."""
    return dict(embedding_multiplier=float(embedding or 1.0), residual_multiplier=float(residual or 1.0),
                logits_scaling=float(logits or 1.0),
                query_pre_attn_scalar=float(attention) ** -2 if attention else None)


def olmo2_config(values: dict, name: str) -> LlamaConfig:
    """OLMo 2 and 3: norms after attention and the MLP only (none before), and a q/k norm over the
    whole projections; OLMo 3's sliding layers (`layer_types`) rotate on its base unscaled."""
    config = hf_llama_config(values, name, "olmo2", attention_bias=False, qk_norm=True, qk_norm_whole=True,
                             pre_norms=False, sandwich_norms=True)
    if SLIDING in config.layer_types and config.rope_scaling and config.rope_local_theta is None:
        config.rope_local_theta = config.rope_theta
    return config


def olmo2_gguf_config(key, fields: dict) -> dict:
    """An `olmo2` GGUF (OLMo 3's too): where it sets a window, the layers its pattern flags (every
    layer but each fourth, where it has none, as llama.cpp takes it) are sliding, on the unscaled base."""
    window = key("attention.sliding_window")
    if not window:
        return dict(pre_norms=False, qk_norm_whole=True)
    layers = fields["num_hidden_layers"]
    pattern = key("attention.sliding_window_pattern") or [(i + 1) % 4 != 0 for i in range(layers)]
    return dict(pre_norms=False, qk_norm_whole=True, sliding_window=int(window),
                layer_types=[SLIDING if local else FULL for local in pattern],
                rope_local_theta=float(key("rope.freq_base_swa", fields["rope_theta"])))


def exaone4_config(values: dict, name: str) -> LlamaConfig:
    """EXAONE 4: OLMo 2's norms after attention and the MLP only, a q/k norm over each head; with a
    window, three sliding layers to each global one, and the global ones without rotary (NoPE)."""
    layers = int(values.get("num_hidden_layers", 0))
    if not values.get("sliding_window"):  # no window: every layer global, and rotating (as transformers runs it)
        values = values | {"layer_types": [FULL] * layers}
    types = values.get("layer_types") or [FULL] * layers
    unrotated = [i for i, kind in enumerate(types) if kind == FULL] if values.get("sliding_window") else []
    return hf_llama_config(values, name, "exaone4", attention_bias=False, qk_norm=True, pre_norms=False,
                           sandwich_norms=True, unrotated_layers=unrotated)


def exaone4_gguf_config(key, fields: dict) -> dict:
    """An `exaone4` GGUF: where it sets a window, its pattern's layers (each fourth global where it
    has none) sliding and the global ones unrotated."""
    window = key("attention.sliding_window")
    if not window:
        return dict(pre_norms=False)
    layers = fields["num_hidden_layers"]
    pattern = key("attention.sliding_window_pattern") or [(i + 1) % 4 != 0 for i in range(layers)]
    return dict(pre_norms=False, sliding_window=int(window),
                layer_types=[SLIDING if local else FULL for local in pattern],
                unrotated_layers=[i for i, local in enumerate(pattern) if not local])


# OLMo 2's (and EXAONE 4's) names for its norms after attention and the MLP, and Kiln's.
_OLMO2_NORMS = {"post_attention_layernorm": "attention_output_norm", "post_feedforward_layernorm": "mlp_output_norm"}


def olmo2_tensors(tensors: Mapping, config: LlamaConfig) -> LazyArrays:
    """OLMo 2's tensors in Kiln's names: its norms after attention and the MLP renamed."""
    return renamed(hf_llama_tensors(tensors), partial(_module_renamed, _OLMO2_NORMS))


def _module_renamed(names: dict[str, str], name: str) -> str:
    """`name` with its module (the part before `.weight`/`.bias`) renamed as `names` says."""
    parts = name.split(".")
    if len(parts) > 1 and parts[-2] in names:
        parts[-2] = names[parts[-2]]
    return ".".join(parts)


def ernie4_5_config(values: dict, name: str) -> LlamaConfig:
    """ERNIE 4.5 (dense): Llama's layer rotating adjacent pairs (adjacent_pairs_to_halves)."""
    if values.get("use_bias"):
        raise ModelLoadError("ERNIE 4.5 with use_bias: biases on the output projection and the MLP are not supported")
    return hf_llama_config(values, name, "ernie4_5", attention_bias=False,
                           tie_word_embeddings=values.get("tie_word_embeddings", True))


def ernie4_5_tensors(tensors: Mapping, config: LlamaConfig) -> LazyArrays:
    """ERNIE 4.5's tensors in Kiln's names and layout: q and k reordered to halves; from Baidu's
    first layout too (under `ernie.`, with q, k, v as one `qkv_proj` and `up_gate_proj`, gate first)."""
    def llama_name(name: str) -> str:
        return name.replace("ernie.", "model.", 1).replace(".up_gate_proj.", ".gate_up_proj.")

    return adjacent_pairs_to_halves(split_fused_projections(renamed(tensors, llama_name), config), config)


def glm4_config(values: dict, name: str) -> LlamaConfig:
    """GLM-4 (0414 and Z1): norms after attention and the MLP too, q/k/v biases, gate and up as one
    weight (split at load), and adjacent pairs rotating over half of each head."""
    values = values | {"partial_rotary_factor": values.get("partial_rotary_factor", 0.5)}
    return hf_llama_config(values, name, "glm4", attention_bias=True, sandwich_norms=True)


# GLM-4's names for its norms after attention and the MLP.
_GLM4_NORMS = {"post_self_attn_layernorm": "attention_output_norm", "post_mlp_layernorm": "mlp_output_norm"}


def glm4_tensors(tensors: Mapping, config: LlamaConfig) -> LazyArrays:
    """GLM-4's tensors in Kiln's names and layout: gate_up_proj split, its norms after attention and
    the MLP renamed, q and k reordered to halves."""
    split = split_fused_projections(tensors, config)
    return adjacent_pairs_to_halves(renamed(split, partial(_module_renamed, _GLM4_NORMS)), config)


def adjacent_pairs_to_halves(tensors: LazyArrays, config: LlamaConfig) -> LazyArrays:
    """q_proj's and k_proj's rows (weights and biases) of a checkpoint rotating adjacent pairs (ERNIE,
    GLM-4: transformers' `rotate_half` over x[0::2], x[1::2]) reordered to the model's halves. The
    scores q·k are the same whatever order both share; the cached keys are in the new one."""
    out = LazyArrays()
    for name in tensors:
        if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name:
            heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
            make = partial(_reordered, tensors, name, heads, config.rotary_dim)
            out.add(name, tensors.shape(name), make, tensors.kind(name))
        else:
            out.add_from(tensors, name)
    return out


def _reordered(tensors: LazyArrays, name: str, heads: int, rotary: int) -> np.ndarray:
    return unpermute_qk(np.asarray(tensors[name]), heads, rotary)


def phi3_config(values: dict, name: str) -> LlamaConfig:
    """Phi-3: Llama's layer with fused projections (split_fused_projections splits them), LongRoPE scaling,
    and a sliding window over every layer when config.json sets one (as transformers applies it)."""
    window = values.get("sliding_window")
    layers = values.get("num_hidden_layers", 0)
    types = values.get("layer_types") or ([SLIDING] * layers if window else [])
    return llama_config(values | {"layer_types": types}, name=name, architecture="phi3",
                        attention_bias=False, hidden_act=_activation(values, "silu"))


def split_fused_projections(tensors: Mapping, config: LlamaConfig) -> LazyArrays:
    """A Llama-layout checkpoint with fused projections (Phi-3's, GLM-4's, ERNIE's first): `qkv_proj`
    split into q/k/v and `gate_up_proj` into gate/up (gate first), each part read from the fused
    weight only when asked for."""
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    source, out = hf_llama_tensors(tensors), LazyArrays()
    for name in source:
        shape = source.shape(name)
        if name.endswith("self_attn.qkv_proj.weight"):
            if shape[0] != q_rows + 2 * kv_rows:
                raise ModelLoadError(f"{name} has {shape[0]} rows, not q+k+v's {q_rows + 2 * kv_rows}")
            base, bounds = name.removesuffix("qkv_proj.weight"), (0, q_rows, q_rows + kv_rows, shape[0])
            parts = ("q_proj", "k_proj", "v_proj")
        elif name.endswith("mlp.gate_up_proj.weight"):
            if shape[0] != 2 * config.intermediate_size:
                raise ModelLoadError(f"{name} has {shape[0]} rows, not 2 x intermediate_size")
            base, bounds = name.removesuffix("gate_up_proj.weight"), (0, shape[0] // 2, shape[0])
            parts = ("gate_proj", "up_proj")
        else:
            out.add_from(source, name)
            continue
        for part, begin, end in zip(parts, bounds, bounds[1:]):
            out.add(f"{base}{part}.weight", (end - begin, *shape[1:]), rows(source, name, begin, end))
    return out


def _gemma_config(values: dict, name: str, architecture: str, layer_types: list[str], sandwich: bool = True,
                  **decided) -> LlamaConfig:
    """What Gemmas share: GeGLU, embeddings scaled by √hidden, (1 + w) norms (gemma_tensors), scores
    scaled by query_pre_attn_scalar, local layers in `layer_types`; from Gemma 2 (`sandwich`), norms
    after attention and the MLP too."""
    return llama_config(
        values | {"layer_types": values.get("layer_types") or layer_types},
        name=name, architecture=architecture, attention_bias=bool(values.get("attention_bias", False)),
        tie_word_embeddings=values.get("tie_word_embeddings", True),
        hidden_act=_activation(values, "gelu_pytorch_tanh"),
        embedding_multiplier=float(values["hidden_size"]) ** 0.5,
        query_pre_attn_scalar=values.get("query_pre_attn_scalar"),
        sandwich_norms=sandwich,
        attn_logit_softcapping=values.get("attn_logit_softcapping"),
        final_logit_softcapping=values.get("final_logit_softcapping"),
        **decided,
    )


def gemma_config(values: dict, name: str) -> LlamaConfig:
    """Gemma (and CodeGemma): every layer global, no norms after attention and the MLP. Its GeGLU is
    the tanh GELU whatever an early config.json's `hidden_act: gelu` says (transformers then forced
    it, and llama.cpp computes it so)."""
    if values.get("hidden_act") == "gelu" and not values.get("hidden_activation"):
        values = values | {"hidden_activation": "gelu_pytorch_tanh"}
    return _gemma_config(values, name, "gemma", [], sandwich=False)


def gemma_gguf_config(key, fields: dict) -> dict:
    """What llama.cpp takes for granted in a `gemma` GGUF: GeGLU, embeddings scaled by √hidden."""
    return dict(hidden_act="gelu_tanh", embedding_multiplier=float(fields["hidden_size"]) ** 0.5)


def gemma2_config(values: dict, name: str) -> LlamaConfig:
    """Gemma 2: local and global layers alternate, local first; scores and logits soft-capped."""
    layers = values.get("num_hidden_layers", 0)
    return _gemma_config(values, name, "gemma2", [SLIDING if i % 2 == 0 else FULL for i in range(layers)])


def _gemma3_layer_types(layers: int, pattern: int) -> list[str]:
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]


# transformers' Gemma3TextConfig defaults, which a config.json's missing fields mean: the multimodal
# checkpoints' `text_config` (Gemma 3 4B, 12B, 27B) writes only where it departs from them.
GEMMA3_TEXT_DEFAULTS = dict(
    vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072,
    rms_norm_eps=1e-6, rope_theta=1_000_000.0, rope_local_base_freq=GEMMA3_LOCAL_THETA, query_pre_attn_scalar=256,
    sliding_window=4096, tie_word_embeddings=True, bos_token_id=2, eos_token_id=1)


def gemma3_config(values: dict, name: str) -> LlamaConfig:
    """Gemma 3 (text): every `sliding_window_pattern`-th layer global, the rest local with their own
    rotary base; QK-norm. Of a multimodal checkpoint (Gemma3ForConditionalGeneration), its language
    model (`text_config`), served alone: a request's images are refused as any model's are."""
    values = GEMMA3_TEXT_DEFAULTS | text_config(values)
    layers = values.get("num_hidden_layers", 0)
    pattern = int(values.get("sliding_window_pattern") or values.get("_sliding_window_pattern") or 6)
    config = _gemma_config(values, name, "gemma3", _gemma3_layer_types(layers, pattern), qk_norm=True)
    if config.rope_local_theta is None:
        config.rope_local_theta = GEMMA3_LOCAL_THETA
    return config



def gemma3_gguf_config(key, fields: dict) -> dict:
    """What llama.cpp takes for granted in a `gemma3` GGUF: every sixth layer global (unless
    attention.sliding_window_pattern says otherwise, as a period or a per-layer flag), local
    layers on a 10,000 base, scores scaled by the head size, GeGLU, embeddings scaled by √hidden."""
    layers = fields["num_hidden_layers"]
    pattern = key("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        types = [SLIDING if local else FULL for local in pattern]
    else:
        types = _gemma3_layer_types(layers, int(pattern))
    return dict(hidden_act="gelu_tanh", embedding_multiplier=float(fields["hidden_size"]) ** 0.5,
                query_pre_attn_scalar=float(fields["head_dim"]), layer_types=types,
                sliding_window=int(key("attention.sliding_window", required=True)),
                rope_local_theta=float(key("rope.freq_base_swa", GEMMA3_LOCAL_THETA)))


def gemma2_gguf_config(key, fields: dict) -> dict:
    """What llama.cpp takes for granted in a `gemma2` GGUF: local and global layers alternating,
    local first; scores scaled by the head size (by hidden / heads in the 27B, its 46 layers), GeGLU,
    embeddings scaled by √hidden; the soft-caps and the window from the file."""
    layers = fields["num_hidden_layers"]
    scalar = fields["hidden_size"] // fields["num_attention_heads"] if layers == 46 else fields["head_dim"]
    caps = {name: float(value) for name in ("attn_logit_softcapping", "final_logit_softcapping")
            if (value := key(name)) is not None}
    return dict(hidden_act="gelu_tanh", embedding_multiplier=float(fields["hidden_size"]) ** 0.5,
                query_pre_attn_scalar=float(scalar),
                layer_types=[SLIDING if i % 2 == 0 else FULL for i in range(layers)],
                sliding_window=int(key("attention.sliding_window", required=True)), **caps)


def phi3_gguf_config(key, fields: dict) -> dict:
    """A `phi3` GGUF: a window over every layer where the file sets one (its LongRoPE factors are
    tensors, read with the weights)."""
    window = key("attention.sliding_window")
    if not window:
        return {}
    return dict(sliding_window=int(window), layer_types=[SLIDING] * fields["num_hidden_layers"])


# Gemma's norms scale by (1 + weight); its names for the norms around attention and the MLP.
_GEMMA_NORMS = {
    "post_attention_layernorm": "attention_output_norm",
    "pre_feedforward_layernorm": "post_attention_layernorm",
    "post_feedforward_layernorm": "mlp_output_norm",
}


def gemma_tensors(tensors: Mapping, config: LlamaConfig) -> LazyArrays:
    """Gemma's tensors in Kiln's names, each norm's weight as the plain factor it scales by (1 + w),
    as llama.cpp's converter stores them too. (Gemma 1's norms are named as Llama's.)"""
    norm_names = _GEMMA_NORMS if config.sandwich_norms else {}
    source, out = renamed(hf_llama_tensors(tensors), partial(_module_renamed, norm_names)), LazyArrays()
    for name in source:
        if name.endswith("norm.weight"):
            out.add(name, source.shape(name), partial(_plus_one, source, name))
        else:
            out.add_from(source, name)
    return out


def gemma3_tensors(tensors: Mapping, config: LlamaConfig) -> LazyArrays:
    """Gemma 3's tensors in Kiln's names (gemma_tensors'); a multimodal checkpoint's language model's alone."""
    return gemma_tensors(language_model_tensors(tensors), config)


def _plus_one(tensors: Mapping, name: str) -> np.ndarray:
    return tensors[name].astype(np.float32) + 1.0


def _expert_counts(values: dict) -> dict:
    """num_experts (`num_local_experts` in Mixtral's config.json and in what transformers 5 writes;
    `num_experts` in Qwen3-MoE's on the Hub) and num_experts_per_tok."""
    experts = values.get("num_local_experts", values.get("num_experts"))
    if experts is None or "num_experts_per_tok" not in values:
        raise ModelLoadError("config.json lacks num_local_experts (or num_experts) and num_experts_per_tok")
    return dict(num_experts=int(experts), num_experts_per_tok=int(values["num_experts_per_tok"]))


def mixtral_config(values: dict, name: str) -> LlamaConfig:
    """Mixtral: Mistral's layer with a mixture of experts for every MLP, the top two renormalized."""
    return hf_llama_config(values, name, "mixtral", attention_bias=False, norm_topk_prob=True, **_expert_counts(values))


def qwen3_moe_config(values: dict, name: str) -> LlamaConfig:
    """Qwen3-MoE: Qwen3's attention; experts in every `decoder_sparse_step`-th layer not listed in
    `mlp_only_layers`, their weights renormalized when `norm_topk_prob` says so."""
    return hf_llama_config(values, name, "qwen3_moe", attention_bias=False, qk_norm=True, **_qwen_experts(values))


def qwen2_moe_config(values: dict, name: str) -> LlamaConfig:
    """Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases), Qwen3-MoE's
    experts, and beside them a shared expert every token runs, gated by a sigmoid."""
    return hf_llama_config(values, name, "qwen2_moe", attention_bias=True, **_qwen_experts(values),
                           shared_expert_intermediate_size=int(values.get("shared_expert_intermediate_size") or 0))


def _qwen_experts(values: dict) -> dict:
    """Qwen's mixtures: experts in every `decoder_sparse_step`-th layer not in `mlp_only_layers`."""
    step = int(values.get("decoder_sparse_step") or 1)
    only = set(values.get("mlp_only_layers") or [])
    layers = int(values.get("num_hidden_layers", 0))
    return dict(moe_intermediate_size=int(values.get("moe_intermediate_size") or 0),
                norm_topk_prob=bool(values.get("norm_topk_prob", False)),
                dense_layers=[i for i in range(layers) if i in only or (i + 1) % step], **_expert_counts(values))


def _stacked_experts(tensors: Mapping, config: LlamaConfig, moe: str, names: dict[str, str]) -> LazyArrays:
    """Per-expert tensors (`{moe}.experts.{j}.{name}.weight`, as checkpoints store them) stacked into
    Kiln's [E, ...] parameters under `mlp.experts.*` (a layer's experts read when its stack is asked
    for); `{moe}.gate` (the router) as `mlp.gate`. `names`: each stored name's Kiln name (gate_proj,
    up_proj, down_proj)."""
    source, out, experts = hf_llama_tensors(tensors), LazyArrays(), {}
    for name in source:
        parts = name.split(".")
        if len(parts) > 4 and parts[3] == moe and parts[4] == "experts":
            layer, expert, kind = int(parts[2]), int(parts[5]), parts[6]
            if kind not in names:
                raise ModelLoadError(f"unexpected expert tensor {name}")
            experts[(layer, names[kind], expert)] = name
        elif len(parts) > 3 and parts[3] == moe:
            out.add_from(source, name, ".".join(parts[:3] + ["mlp"] + parts[4:]))
        else:
            out.add_from(source, name)
    for layer in range(config.num_hidden_layers):
        if not config.is_moe(layer):
            continue
        for kind in names.values():
            try:
                stacked = [experts.pop((layer, kind, j)) for j in range(config.num_experts)]
            except KeyError as missing:
                raise ModelLoadError(f"layer {layer} lacks expert {missing.args[0][2]}'s {kind}") from None
            out.add(f"model.layers.{layer}.mlp.experts.{kind}", (len(stacked), *source.shape(stacked[0])),
                    partial(_stack, source, stacked))
    if experts:
        raise ModelLoadError(f"expert tensors beyond num_experts={config.num_experts}: {sorted(experts)[:3]}")
    return out


def _stack(tensors: Mapping, names: list[str]) -> np.ndarray:
    return np.stack([tensors[name] for name in names])


def mixtral_tensors(tensors: Mapping, config: LlamaConfig) -> LazyArrays:
    """Mixtral's `block_sparse_moe` experts (w1 gate, w3 up, w2 down), stacked."""
    return _stacked_experts(tensors, config, "block_sparse_moe", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"})


def qwen3_moe_tensors(tensors: Mapping, config: LlamaConfig) -> LazyArrays:
    """Qwen3-MoE's and Qwen2-MoE's `mlp.experts.{j}.{gate,up,down}_proj`, stacked (Qwen2-MoE's
    `mlp.shared_expert.*` and `mlp.shared_expert_gate` as they are)."""
    return _stacked_experts(tensors, config, "mlp", {k: k for k in ("gate_proj", "up_proj", "down_proj")})
