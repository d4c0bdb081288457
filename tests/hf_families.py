"""Tiny random checkpoints of the families beyond Llama, written by transformers itself.

No real weights of these families install offline, so each is built from its transformers
config class with random weights and saved with `save_pretrained`: exactly the upstream
format, whatever Kiln's own writer knows. The weights are redrawn at a scale that keeps
logits well apart (transformers' init leaves them nearly tied), and the norms near their
identity (1 for most, 0 for Gemma's 1 + w).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.tiny_model import CHATML_TEMPLATE, EOS_ID, make_tiny_tokenizer

VOCAB = 384
SHAPES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=0, eos_token_id=EOS_ID, pad_token_id=EOS_ID)


def _longrope(pairs: int) -> dict:
    factors = torch.Generator().manual_seed(7)
    short = (1.0 + torch.rand(pairs, generator=factors)).tolist()
    long = (2.0 + 4.0 * torch.rand(pairs, generator=factors)).tolist()
    return {"rope_type": "longrope", "short_factor": short, "long_factor": long, "rope_theta": 10000.0,
            "original_max_position_embeddings": 32}


def _yarn() -> dict:
    """YaRN stretching a 64-token original context 4x (Qwen3's long-context setting, scaled down)."""
    return {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}


def family_configs() -> dict:
    """Each family's transformers config, at the tiny sizes, with its distinguishing features on: Mistral's
    window over every layer, Qwen3's head size apart from hidden / heads, Qwen3-MoE's experts
    unnormalized beside a dense layer and YaRN, Qwen2-MoE's with a gated shared expert, Mixtral's
    renormalized, Phi-3's LongRoPE past a 32-token original context and sliding window, Phi-4-mini's
    over three quarters of each head (partial rotary), SmolLM3's fourth layer without rotary,
    Granite's four multipliers, ERNIE's adjacent rotary pairs, GLM-4's over half of each head, OLMo 2's
    norms after (not before) attention and the MLP, OLMo 3's sliding layers beside YaRN-scaled global
    ones, EXAONE 4's global layers without rotary, Gemma's head larger than hidden / heads, Gemma 2's
    soft-capping, Gemma 3's local layers, rotary bases and linear scaling on its global layers, and
    Gemma 3's as a multimodal checkpoint's language model (Gemma3ForConditionalGeneration, beside a
    vision tower)."""
    import transformers as tf

    gemma3_text = tf.Gemma3TextConfig(
        **SHAPES | {"num_hidden_layers": 4}, head_dim=32, query_pre_attn_scalar=24, sliding_window=6,
        sliding_window_pattern=2,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    return {
        "qwen3": tf.Qwen3Config(**SHAPES, head_dim=32, tie_word_embeddings=False),
        "mistral": tf.MistralConfig(**SHAPES, sliding_window=12, tie_word_embeddings=False),
        "phi3": tf.Phi3Config(**SHAPES, sliding_window=12, rope_parameters=_longrope(8), tie_word_embeddings=False,
                              original_max_position_embeddings=32),
        "phi4_mini": tf.Phi3Config(**SHAPES, sliding_window=12, tie_word_embeddings=True, original_max_position_embeddings=32,
                                   rope_parameters=_longrope(6) | {"partial_rotary_factor": 0.75}),
        "qwen3_moe": tf.Qwen3MoeConfig(**SHAPES, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                       mlp_only_layers=[1], norm_topk_prob=False, tie_word_embeddings=False,
                                       rope_parameters=_yarn()),
        "qwen2_moe": tf.Qwen2MoeConfig(**SHAPES, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                       shared_expert_intermediate_size=96, mlp_only_layers=[1], norm_topk_prob=False,
                                       tie_word_embeddings=False),
        "mixtral": tf.MixtralConfig(**SHAPES, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
        "smollm3": tf.SmolLM3Config(**SHAPES | {"num_hidden_layers": 4}, tie_word_embeddings=True),
        "granite": tf.GraniteConfig(**SHAPES, embedding_multiplier=2.0, attention_multiplier=0.2,
                                    residual_multiplier=0.7, logits_scaling=1.5, tie_word_embeddings=True),
        "exaone4": tf.Exaone4Config(**SHAPES | {"num_hidden_layers": 4}, sliding_window=6, sliding_window_pattern=4,
                                    tie_word_embeddings=False),
        "gemma": tf.GemmaConfig(**SHAPES, head_dim=32),
        "ernie4_5": tf.Ernie4_5Config(**SHAPES, head_dim=16, use_bias=False, tie_word_embeddings=True),
        "glm4": tf.Glm4Config(**SHAPES, head_dim=16, tie_word_embeddings=False),
        "olmo2": tf.Olmo2Config(**SHAPES),
        "olmo3": tf.Olmo3Config(**SHAPES | {"num_hidden_layers": 4}, sliding_window=6,
                                rope_parameters={"full_attention": _yarn(),
                                                 "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
        "gemma2": tf.Gemma2Config(**SHAPES, head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
                                  attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
        "gemma3": gemma3_text,
        "gemma3_vision": tf.Gemma3Config(
            text_config=gemma3_text, mm_tokens_per_image=4, image_token_index=380, boi_token_index=381,
            eoi_token_index=382,
            vision_config=tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                num_attention_heads=2, image_size=28, patch_size=14)),
    }


FAMILIES = ("mistral", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "phi3", "phi4_mini", "smollm3", "granite",
            "ernie4_5", "glm4", "olmo2", "olmo3", "exaone4", "gemma", "gemma2", "gemma3", "gemma3_vision")


def write_family_checkpoint(family: str, directory: Path, seed: int = 0) -> Path:
    """A tiny random `family` model saved by transformers, with the tiny tokenizer beside it."""
    import transformers as tf

    config = family_configs()[family]
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gemma = family.startswith("gemma")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 1:
                centre = 0.0 if gemma and name.endswith("norm.weight") else (1.0 if "norm" in name else 0.0)
                parameter.copy_(centre + 0.1 * torch.randn_like(parameter))
            else:
                # A router's scores spread wide, as trained ones are: routing near a tie would
                # flip between experts at the least rounding (a quantized weight upstream).
                scale = 8.0 if name.endswith((".mlp.gate.weight", "block_sparse_moe.gate.weight")) else 1.0
                parameter.copy_(torch.randn_like(parameter) * scale * parameter.shape[-1] ** -0.5)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer = make_tiny_tokenizer(VOCAB)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "chat_template": CHATML_TEMPLATE, "model_max_length": 256}))
    return directory


def transformers_model(directory: Path):
    """The checkpoint as transformers runs it: float32, eager attention (soft-capping needs it)."""
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32,
                                                   attn_implementation="eager").eval()


def transformers_gguf(path: Path, config_class, model_class, **overrides) -> tuple:
    """(config, tensors) of a GGUF as transformers' own GGUF reader makes them: an independent
    reading of the file (its dequantization, its names); `overrides`: config fields the file does
    not set whose defaults would not fit (Phi-3's padding id past a tiny vocabulary)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    parsed = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    config = config_class(**{k: v for k, v in parsed.items() if k != "model_type"} | overrides)
    with torch.device("meta"):
        skeleton = model_class(config)
    return config, load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
