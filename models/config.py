"""The hyperparameters of a Llama-family decoder, in Hugging Face's field names.

Both loaders (HF directory, GGUF) produce one of these, so the model and the
export never need to know where the weights came from.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kiln.runtime.errors import ModelLoadError


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

    @property
    def is_diffusion(self) -> bool:
        return self.model_kind == "diffusion"

    def __post_init__(self):
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "LlamaConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})
