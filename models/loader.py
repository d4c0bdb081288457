"""`load_checkpoint`: the one entry point the export uses, whatever the path holds."""

from __future__ import annotations

from pathlib import Path

from kiln.runtime.errors import ModelLoadError

from .checkpoint import Checkpoint
from .default_model import DEFAULT_MODEL_GENERATION_DEFAULTS, DEFAULT_MODEL_NAME, default_model_path
from .gguf_loader import load_gguf
from .hf_loader import checkpoint_with_tokenizer, read_json, read_safetensors, stored_quantization
from .packaged import PACKAGED, resolve_model_path
from .registry import family_of_hf


def load_checkpoint(path: str | Path | None = None) -> Checkpoint:
    """Load an HF directory, a .gguf file, or (None) the bundled default model."""
    if path is None:
        checkpoint = load_checkpoint(default_model_path())
        checkpoint.config.name = DEFAULT_MODEL_NAME
        checkpoint.generation_defaults = checkpoint.generation_defaults or dict(DEFAULT_MODEL_GENERATION_DEFAULTS)
        return checkpoint
    path = resolve_model_path(path)
    if not path.exists():
        known = ", ".join(PACKAGED)
        raise ModelLoadError(f"model path {path} does not exist (nor is it a packaged model's name: {known})")
    if path.is_dir():
        return load_hf_directory(path)
    if path.suffix.lower() == ".gguf":
        return load_gguf(path)
    raise ModelLoadError(f"{path} is neither a Hugging Face model directory nor a .gguf file")


def load_hf_directory(directory: Path) -> Checkpoint:
    """An HF directory, read as its config.json's family says."""
    values = read_json(directory / "config.json")
    family = family_of_hf(values)
    config = family.config_from_hf(values, directory.name)
    config.architecture, config.model_kind = family.name, family.kind
    stored = read_safetensors(directory)
    checkpoint = checkpoint_with_tokenizer(directory, config, family.tensors_from_hf(stored, config))
    checkpoint.stored_quantization = stored_quantization(stored)
    return checkpoint
