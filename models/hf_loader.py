"""Read a Hugging Face model directory: config.json, safetensors (one file or sharded), tokenizer.

What differs by family (its config.json's fields, its tensor names) is read by the family's
entry in registry.py: the Llama layout's here, the diffusion LMs' in diffusion_loader.py;
the readers of the other parts are shared from here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import partial
from pathlib import Path

from kiln.runtime.errors import ModelLoadError
from kiln.runtime.safetensors_file import SafetensorsError, read_header, read_tensor
from kiln.runtime.sampling import model_generation_defaults

from .checkpoint import Checkpoint
from .config import FULL, SLIDING, LlamaConfig
from .lazy_arrays import LazyArrays, renamed
from .sentence_transformers import read_embedding_spec


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelLoadError(f"{path} is not valid JSON: {error}") from None


def token_ids(value) -> list[int]:
    """An id field that may be one id, a list of them, or absent."""
    return [value] if isinstance(value, int) else list(value or [])


def hf_llama_config(values: dict, name: str, architecture: str, attention_bias: bool, **decided) -> LlamaConfig:
    """A Llama-layout family's config.json (Llama, Mistral, Qwen2 and their kin) as a LlamaConfig;
    `attention_bias`: whether its q/k/v carry a bias when config.json does not say; `decided`:
    the fields the family fixes."""
    return llama_config(values, name=name, architecture=architecture,
                        attention_bias=values.get("attention_bias", attention_bias), **decided)


def rope_settings(values: dict, head_dim: int) -> dict:
    """rope_theta, rope_scaling, rotary_dim and rope_local_theta from config.json: top-level
    `rope_theta`, `rope_scaling` and `partial_rotary_factor` (how checkpoints on the Hub write them),
    or transformers 5's `rope_parameters`, one dict or one per layer type (Gemma 3: its full and
    sliding layers' bases)."""
    parameters = values.get("rope_parameters")
    local_theta = values.get("rope_local_base_freq")
    if isinstance(parameters, dict) and FULL in parameters:
        local_theta = (parameters.get(SLIDING) or {}).get("rope_theta", local_theta)
        parameters = parameters[FULL]
    if isinstance(parameters, dict):
        theta = parameters.get("rope_theta", values.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in parameters.items() if k not in ("rope_theta", "partial_rotary_factor")}
    else:
        theta, scaling = values.get("rope_theta", 10000.0), dict(values.get("rope_scaling") or {})
    partial = (parameters or {}).get("partial_rotary_factor", values.get("partial_rotary_factor")) or 1.0
    if scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = {}
    elif "original_max_position_embeddings" in values:  # Phi-3 keeps it beside, not inside
        scaling.setdefault("original_max_position_embeddings", values["original_max_position_embeddings"])
    return dict(rope_theta=float(theta), rope_scaling=scaling or None, rotary_dim=int(head_dim * float(partial)),
                rope_local_theta=None if local_theta is None else float(local_theta))


def llama_config(values: dict, **decided) -> LlamaConfig:
    """A LlamaConfig from config.json fields in HF Llama/Qwen2 names; `decided` sets the
    fields the caller knows from the architecture (name, architecture, bias, diffusion)."""
    layer_types = list(values.get("layer_types") or [])
    try:
        fields = dict(
            vocab_size=values["vocab_size"],
            hidden_size=values["hidden_size"],
            intermediate_size=values["intermediate_size"],
            num_hidden_layers=values["num_hidden_layers"],
            num_attention_heads=values["num_attention_heads"],
            num_key_value_heads=values.get("num_key_value_heads") or values["num_attention_heads"],
            head_dim=values.get("head_dim") or 0,
            rms_norm_eps=values.get("rms_norm_eps", 1e-6),
            max_position_embeddings=values.get("max_position_embeddings", 2048),
            tie_word_embeddings=values.get("tie_word_embeddings", False),
            bos_token_id=values.get("bos_token_id"),
            eos_token_ids=token_ids(values.get("eos_token_id")),
            layer_types=layer_types,
            sliding_window=values.get("sliding_window") if SLIDING in layer_types else None,
        )
    except KeyError as error:
        raise ModelLoadError(f"config.json lacks {error.args[0]}") from None
    head_dim = fields["head_dim"] or fields["hidden_size"] // fields["num_attention_heads"]
    return LlamaConfig(**(fields | rope_settings(values, head_dim) | decided))


def _safetensor_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map", {})
        return [directory / name for name in sorted(set(weight_map.values()))]
    single = directory / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(directory.glob("*.safetensors"))
    if not found:
        raise ModelLoadError(f"{directory} has no model.safetensors (or sharded safetensors with an index)")
    return found


def read_safetensors(directory: Path) -> LazyArrays:
    """Every tensor of the directory's safetensors (one file or an indexed set), floats as
    float32, each read from its file only when asked for (an 8B checkpoint is never in memory
    whole); each one's kind is its stored type (F32, BF16...)."""
    tensors = LazyArrays()
    for path in _safetensor_files(directory):
        if not path.exists():
            raise ModelLoadError(f"{path} is listed in the index but missing")
        try:
            header = read_header(path)
        except (SafetensorsError, OSError) as error:
            raise ModelLoadError(f"{path} is not a readable safetensors file: {error}") from None
        for name, stored in header.items():
            tensors.add(name, stored.shape, partial(read_tensor, path, stored), stored.dtype)
    return tensors


def stored_quantization(tensors: LazyArrays) -> str:
    """"bf16" where every 2-D tensor (the weight matmuls, the embedding) is stored as BF16, which
    `--quantize auto` then serves as stored; "none" otherwise."""
    kinds = {tensors.kind(name) for name in tensors if len(tensors.shape(name)) == 2}
    return "bf16" if kinds == {"BF16"} else "none"


def hf_llama_tensors(tensors: Mapping) -> LazyArrays:
    """A Llama-layout family's tensors under Kiln's names: `model.layers...` and bare
    `layers...` naming both accepted."""
    return renamed(tensors, lambda name: name if name.startswith(("model.", "lm_head.")) else "model." + name)


def checkpoint_with_tokenizer(directory: Path, config: LlamaConfig, tensors: Mapping) -> Checkpoint:
    """The Checkpoint of `config` and `tensors` (in Kiln's names) with the directory's
    tokenizer.json (required), tokenizer_config.json, and generation_config.json's stop ids and
    sampling defaults, and its sentence-transformers pooling."""
    if "lm_head.weight" not in tensors and not config.tie_word_embeddings:
        config.tie_word_embeddings = True  # some exports drop a tied head without saying so
    tokenizer_path = directory / "tokenizer.json"
    if not tokenizer_path.exists():
        raise ModelLoadError(f"{directory} has no tokenizer.json")
    tokenizer_config = {}
    if (directory / "tokenizer_config.json").exists():
        tokenizer_config = read_json(directory / "tokenizer_config.json")
    generation = directory / "generation_config.json"
    defaults = {}
    if generation.exists():
        values = read_json(generation)
        extra = token_ids(values.get("eos_token_id"))
        config.eos_token_ids = sorted(set(config.eos_token_ids) | set(extra))
        try:
            defaults = model_generation_defaults(values, str(generation))
        except ValueError as error:
            raise ModelLoadError(str(error)) from None
    return Checkpoint(
        config=config,
        tensors=tensors,
        tokenizer_json=tokenizer_path.read_text(),
        tokenizer_config=tokenizer_config,
        source=str(directory),
        generation_defaults=defaults,
        embedding=read_embedding_spec(directory, read_json(directory / "config.json")),
    )
