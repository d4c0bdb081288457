"""A loaded model, whatever file it came from: config, tensors in HF names, tokenizer.

The loaders (hf_loader.py, gguf_loader.py) produce one; `loader.load_checkpoint` picks
the loader for a path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .config import LlamaConfig
from .gguf_blocks import BlockWeight
from .sentence_transformers import EmbeddingSpec


@dataclass
class Checkpoint:
    config: LlamaConfig
    # Hugging Face names: model.embed_tokens.weight, model.layers.{i}.self_attn.q_proj.weight,
    # ..., model.norm.weight, lm_head.weight (absent when embeddings are tied).
    # A GGUF's are made from the file when asked for (models/lazy_arrays.py): a Mapping, not a dict.
    tensors: Mapping[str, np.ndarray]
    tokenizer_json: str  # the text of a `tokenizers` tokenizer.json
    tokenizer_config: dict[str, Any] = field(default_factory=dict)  # HF tokenizer_config.json
    source: str = ""
    # The narrow form the file stores every weight matmul's weight in, when Kiln can serve that
    # form as it is (models/quantize.py): "q8_0", "q4_0", "q4_1" or "bf16" for such a GGUF,
    # else "none".
    stored_quantization: str = "none"
    # A GGUF's block-quantized 2-D weights (Q8_0, Q4_0, Q4_1) as stored, by HF name: what a
    # block mode serves instead of re-quantizing `tensors`.
    blocks: Mapping[str, BlockWeight] = field(default_factory=dict)
    # The model's own sampling defaults (runtime/sampling.py's MODEL_DEFAULT_FIELDS), for
    # requests that leave those fields unset: from generation_config.json or a GGUF's
    # general.sampling.* keys, checked (model_generation_defaults).
    generation_defaults: dict[str, float | int] = field(default_factory=dict)
    # How its embeddings pool its hidden states (an --embeddings export's): its
    # sentence-transformers files' say, else last-token pooling, normalised.
    embedding: EmbeddingSpec = field(default_factory=EmbeddingSpec)
