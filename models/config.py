"""The hyperparameters of a Llama-family decoder, in Hugging Face's field names.

Both loaders (HF directory, GGUF) produce one of these, so the model and the
export never need to know where the weights came from.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kiln.runtime.errors import ModelLoadError

FULL, SLIDING = "full_attention", "sliding_attention"  # LlamaConfig.layer_types' values, HF's names
ACTIVATIONS = ("silu", "gelu_tanh")
ROPE_SCALINGS = ("default", "linear", "llama3", "yarn", "longrope", "su")  # rope_scaling's rope_type values


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rotary_dim: int = 0  # the leading dimensions of each head that rotate (Phi-4-mini: 3/4); 0: all
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    architecture: str = "llama"  # its family's name (registry.py)
    name: str = ""
    # Diffusion LMs (LLaDA, Dream) see the whole sequence (no causal mask), start their output
    # as a canvas of `mask_token_id`, and, with `logits_shift` 1 (Dream), the logits at
    # position i predict token i + 1 rather than token i.
    model_kind: str = "autoregressive"  # or "diffusion"
    mask_token_id: int | None = None
    logits_shift: int = 0
    # How a family departs from Llama's layer (each family's reader in registry.py sets these):
    qk_norm: bool = False  # an RMSNorm over each head's q and k before the rotary (Qwen3, Gemma 3)
    qk_norm_whole: bool = False  # that norm over the whole q and k projections, every head at once (OLMo 2)
    pre_norms: bool = True  # a norm before attention and before the MLP (OLMo 2 norms only their outputs)
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embedding_multiplier: float = 1.0  # the embeddings' scale on the way in (Gemma: √hidden)
    query_pre_attn_scalar: float | None = None  # scores are scaled by its -1/2 power; None: head_dim's
    sandwich_norms: bool = False  # attention's and the MLP's outputs are normed too (Gemma 2, 3)
    attn_logit_softcapping: float | None = None  # scores become cap·tanh(score / cap) (Gemma 2)
    final_logit_softcapping: float | None = None  # the same on the logits
    sliding_window: int | None = None  # how many keys a local layer's query sees, its own included
    layer_types: list[str] = field(default_factory=list)  # per layer, FULL or SLIDING; [] is all FULL
    rope_local_theta: float | None = None  # local layers' rotary base, unscaled (Gemma 3); None: as global
    unrotated_layers: list[int] = field(default_factory=list)  # layers whose q and k take no rotary (SmolLM3's NoPE)
    residual_multiplier: float = 1.0  # attention's and the MLP's outputs scaled as they join the residual (Granite)
    logits_scaling: float = 1.0  # the logits divided by it (Granite)
    # Mixture of experts (Mixtral, Qwen3-MoE): each token's MLP is the weighted sum of the
    # `num_experts_per_tok` experts its router scores highest, of `num_experts` (0: a dense MLP).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's; 0: intermediate_size
    norm_topk_prob: bool = True  # the chosen experts' weights renormalized to sum to 1
    dense_layers: list[int] = field(default_factory=list)  # layers with a dense MLP all the same
    shared_expert_intermediate_size: int = 0  # an expert every token runs, its output gated (Qwen2-MoE); 0: none

    @property
    def is_diffusion(self) -> bool:
        return self.model_kind == "diffusion"

    def is_moe(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def is_sliding(self, layer: int) -> bool:
        """Whether layer `layer` attends only to the last `sliding_window` keys."""
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING

    def __post_init__(self):
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if not self.rotary_dim:
            self.rotary_dim = self.head_dim
        if not 0 < self.rotary_dim <= self.head_dim or (self.rotary_dim < self.head_dim and self.rotary_dim % 2):
            raise ModelLoadError(f"{self.rotary_dim} rotary dimensions do not fit a head of {self.head_dim} "
                                 "(pairs of them, at most the head's)")
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type", scaling.get("type", "default")) not in ROPE_SCALINGS:
            raise ModelLoadError(f"rope scaling {scaling.get('rope_type', scaling.get('type'))!r} is not supported: "
                                 f"Kiln runs {', '.join(ROPE_SCALINGS[:-1])}")
        if self.qk_norm_whole and not self.qk_norm:
            raise ModelLoadError("qk_norm_whole says how the q/k norm spans the heads: it needs qk_norm")
        if not (self.pre_norms or self.sandwich_norms):
            raise ModelLoadError("a layer without norms before attention and the MLP needs them after (sandwich_norms)")
        if self.sandwich_norms and self.residual_multiplier != 1.0:
            raise ModelLoadError("a residual multiplier with sandwich norms: no family has both")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ModelLoadError(f"activation {self.hidden_act!r} is not supported: Kiln runs {', '.join(ACTIVATIONS)}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelLoadError(f"num_experts_per_tok={self.num_experts_per_tok} must be 1 to "
                                 f"num_experts={self.num_experts}")
        if not self.moe_intermediate_size:
            self.moe_intermediate_size = self.intermediate_size
        if self.layer_types:
            if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - {FULL, SLIDING}:
                raise ModelLoadError(f"layer_types must name {FULL!r} or {SLIDING!r} for each of the "
                                     f"{self.num_hidden_layers} layers, not {self.layer_types}")
            if SLIDING in self.layer_types and not self.sliding_window:
                raise ModelLoadError("sliding-attention layers need a positive sliding_window")
            if SLIDING not in self.layer_types:
                self.layer_types = []  # every layer global, as a config without them says

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "LlamaConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})
