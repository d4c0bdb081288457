"""A loaded model, whatever file it came from: config, tensors in HF names, tokenizer.

`load_checkpoint` is the one entry point the export uses; it dispatches on the path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .config import LlamaConfig, ModelLoadError


@dataclass
class Checkpoint:
    config: LlamaConfig
    # Hugging Face names: model.embed_tokens.weight, model.layers.{i}.self_attn.q_proj.weight,
    # ..., model.norm.weight, lm_head.weight (absent when embeddings are tied).
    tensors: dict[str, np.ndarray]
    tokenizer_json: str  # the text of a `tokenizers` tokenizer.json
    tokenizer_config: dict[str, Any] = field(default_factory=dict)  # HF tokenizer_config.json
    source: str = ""


def load_checkpoint(path: str | Path | None = None) -> Checkpoint:
    """Load an HF directory, a .gguf file, or (None) the bundled default model."""
    if path is None:
        from .default_model import DEFAULT_MODEL_NAME, default_model_path

        checkpoint = load_checkpoint(default_model_path())
        checkpoint.config.name = DEFAULT_MODEL_NAME
        return checkpoint
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if path.is_dir():
        from .hf_loader import load_hf_directory

        return load_hf_directory(path)
    if path.suffix.lower() == ".gguf":
        from .gguf_loader import load_gguf

        return load_gguf(path)
    raise ModelLoadError(
        f"{path} is neither a Hugging Face model directory nor a .gguf file"
    )
