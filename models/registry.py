"""The model families Kiln runs: from what a checkpoint says it is to how it is read, built and served.

A family is found from a config.json's `architectures` (else its `model_type`) or a GGUF's
`general.architecture`. Its entry names the reader of its config.json, the renaming of its
tensors to Kiln's names, the torch module the export builds for it, and the kind of model
the sidecar records (`KilnParams.model_kind`), from which the runtime chooses its generation
modes. Adding a family adds an entry here, its reader and module in models/, what the export
needs in export/, and a test: runtime/ and server/ stay as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import import_module


from kiln.runtime.contract import DIFFUSION
from kiln.runtime.errors import ModelLoadError

from .config import LlamaConfig
from .diffusion_loader import dream_config, llada_config, llada_tensors
from .families import (GEMMA_CHAT_TEMPLATE, ernie4_5_config, ernie4_5_tensors, exaone4_config, exaone4_gguf_config,
                       gemma2_config, gemma2_gguf_config, gemma3_config, gemma3_gguf_config, gemma3_tensors,
                       gemma_config, gemma_gguf_config, gemma_tensors, glm4_config, glm4_tensors, granite_config,
                       granite_gguf_config, language_model_tensors, llama_family_config, mixtral_config,
                       mixtral_tensors, olmo2_config, olmo2_gguf_config, olmo2_tensors, phi3_config, phi3_gguf_config,
                       qwen2_moe_config, qwen3_config, qwen3_moe_config, qwen3_moe_tensors, smollm3_config,
                       smollm3_gguf_config, split_fused_projections)
from .hf_loader import hf_llama_config, hf_llama_tensors

AUTOREGRESSIVE = "autoregressive"  # KilnParams.model_kind's default; DIFFUSION is the contract's other kind


@dataclass(frozen=True)
class ModelFamily:
    name: str  # LlamaConfig.architecture
    hf_architectures: tuple[str, ...]  # config.json's `architectures` entries
    hf_model_types: tuple[str, ...]  # its `model_type` (lowercased), where `architectures` names none of ours
    gguf_architecture: str | None  # a GGUF's general.architecture (None: no GGUF form)
    kind: str  # the sidecar's model_kind: AUTOREGRESSIVE or DIFFUSION
    config_from_hf: Callable[[dict, str], LlamaConfig]  # (config.json, the model's name)
    tensors_from_hf: Callable[[Mapping, LlamaConfig], Mapping]  # to Kiln's names, read lazily
    module: str = "kiln.models.llama:PagedLlama"  # what the export builds, as "module:class"
    # The LlamaConfig fields a GGUF of the family implies beyond the common ones, from (its
    # metadata by key under the architecture's prefix, the common fields read so far).
    config_from_gguf: Callable[[Callable, dict], dict] = lambda key, fields: {}
    chat_template: str | None = None  # the family's, for a checkpoint that carries none (a GGUF of a base model)

    def module_class(self) -> type:
        """The torch module the export builds (imported here, on first use: it needs torch)."""
        module, name = self.module.split(":")
        return getattr(import_module(module), name)


def _renamed(tensors: Mapping, config: LlamaConfig) -> Mapping:
    return hf_llama_tensors(language_model_tensors(tensors))


FAMILIES = (
    # Mistral Small 3's multimodal checkpoints serve their language model.
    ModelFamily("llama", ("LlamaForCausalLM", "MistralForCausalLM", "LlamaModel", "MistralModel",
                          "Mistral3ForConditionalGeneration"), (), "llama", AUTOREGRESSIVE, llama_family_config, _renamed),
    ModelFamily("qwen2", ("Qwen2ForCausalLM", "Qwen2Model"), (), "qwen2", AUTOREGRESSIVE,
                lambda values, name: hf_llama_config(values, name, "qwen2", attention_bias=True), _renamed),
    ModelFamily("qwen3", ("Qwen3ForCausalLM", "Qwen3Model"), (), "qwen3", AUTOREGRESSIVE, qwen3_config, _renamed),
    ModelFamily("qwen2_moe", ("Qwen2MoeForCausalLM",), (), "qwen2moe", AUTOREGRESSIVE, qwen2_moe_config,
                qwen3_moe_tensors),
    ModelFamily("qwen3_moe", ("Qwen3MoeForCausalLM",), (), "qwen3moe", AUTOREGRESSIVE, qwen3_moe_config,
                qwen3_moe_tensors),
    # A Mixtral GGUF says `llama` and has experts (gguf_loader tells them apart).
    ModelFamily("mixtral", ("MixtralForCausalLM",), (), None, AUTOREGRESSIVE, mixtral_config, mixtral_tensors),
    ModelFamily("phi3", ("Phi3ForCausalLM",), (), "phi3", AUTOREGRESSIVE, phi3_config, split_fused_projections,
                config_from_gguf=phi3_gguf_config),
    ModelFamily("smollm3", ("SmolLM3ForCausalLM",), (), "smollm3", AUTOREGRESSIVE, smollm3_config, _renamed,
                config_from_gguf=smollm3_gguf_config),
    ModelFamily("granite", ("GraniteForCausalLM",), (), "granite", AUTOREGRESSIVE, granite_config, _renamed,
                config_from_gguf=granite_gguf_config),
    ModelFamily("ernie4_5", ("Ernie4_5ForCausalLM",), (), "ernie4_5", AUTOREGRESSIVE, ernie4_5_config,
                ernie4_5_tensors),
    ModelFamily("glm4", ("Glm4ForCausalLM",), (), "glm4", AUTOREGRESSIVE, glm4_config, glm4_tensors),
    ModelFamily("olmo2", ("Olmo2ForCausalLM", "Olmo3ForCausalLM"), (), "olmo2", AUTOREGRESSIVE, olmo2_config,
                olmo2_tensors, config_from_gguf=olmo2_gguf_config),
    ModelFamily("exaone4", ("Exaone4ForCausalLM",), (), "exaone4", AUTOREGRESSIVE, exaone4_config, olmo2_tensors,
                config_from_gguf=exaone4_gguf_config),
    ModelFamily("gemma", ("GemmaForCausalLM",), (), "gemma", AUTOREGRESSIVE, gemma_config, gemma_tensors,
                config_from_gguf=gemma_gguf_config, chat_template=GEMMA_CHAT_TEMPLATE),
    ModelFamily("gemma2", ("Gemma2ForCausalLM",), (), "gemma2", AUTOREGRESSIVE, gemma2_config, gemma_tensors,
                config_from_gguf=gemma2_gguf_config, chat_template=GEMMA_CHAT_TEMPLATE),
    ModelFamily("gemma3", ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"), ("gemma3_text",), "gemma3",
                AUTOREGRESSIVE, gemma3_config, gemma3_tensors, config_from_gguf=gemma3_gguf_config,
                chat_template=GEMMA_CHAT_TEMPLATE),
    ModelFamily("llada", ("LLaDAModelLM",), ("llada",), None, DIFFUSION, llada_config,
                lambda tensors, config: llada_tensors(tensors)),
    ModelFamily("dream", ("DreamModel",), ("dream",), None, DIFFUSION, dream_config, lambda tensors, config: tensors),
)


def family_of_hf(values: dict) -> ModelFamily:
    """The family a config.json (as a dict) describes; ModelLoadError naming the field otherwise."""
    architectures = values.get("architectures") or []
    for architecture in architectures:
        for family in FAMILIES:
            if architecture in family.hf_architectures:
                return family
    model_type = str(values.get("model_type", "")).lower()
    for family in FAMILIES:
        if model_type in family.hf_model_types:
            return family
    field = "architectures" if architectures else "model_type"
    found = ", ".join(architectures) or values.get("model_type", "unknown")
    runs = ", ".join(a for family in FAMILIES for a in family.hf_architectures)
    raise ModelLoadError(f"unsupported architecture {found} (config.json {field}): Kiln runs {runs}")


def family_of_gguf(architecture: object) -> ModelFamily:
    """The family of a GGUF's general.architecture; ModelLoadError naming it otherwise."""
    for family in FAMILIES:
        if family.gguf_architecture is not None and architecture == family.gguf_architecture:
            return family
    runs = ", ".join(f.gguf_architecture for f in FAMILIES if f.gguf_architecture)
    raise ModelLoadError(f"GGUF architecture {architecture!r} is not supported; Kiln runs {runs}")


def family_named(name: str) -> ModelFamily:
    """The family of a loaded checkpoint (its config.architecture)."""
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ModelLoadError(f"no model family is named {name!r}: Kiln runs {', '.join(f.name for f in FAMILIES)}")
