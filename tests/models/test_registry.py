"""The model registry: every family names a reader, a module and a kind the runtime serves, and
a family added to it loads through the one entry point with nothing else changed."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from kiln.models import registry
from kiln.models.loader import load_checkpoint
from kiln.models.registry import AUTOREGRESSIVE, FAMILIES, family_named, family_of_gguf
from kiln.runtime.contract import DIFFUSION
from kiln.runtime.errors import ModelLoadError
from tests.tiny_model import make_tiny_checkpoint, write_hf_directory


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_family_names_a_module_and_a_kind_the_runtime_serves(family):
    assert issubclass(family.module_class(), torch.nn.Module)
    assert family.kind in (AUTOREGRESSIVE, DIFFUSION)
    assert family_named(family.name) is family
    if family.gguf_architecture is not None:
        assert family_of_gguf(family.gguf_architecture) is family


def test_an_unknown_gguf_architecture_is_named():
    with pytest.raises(ModelLoadError, match="'gpt2'.*llama, qwen2"):
        family_of_gguf("gpt2")


def test_a_family_added_to_the_registry_loads_with_nothing_else_changed(tmp_path, monkeypatch):
    """A Llama-layout family under a new name: one entry, and load_checkpoint reads it."""
    llama = family_named("llama")
    added = replace(llama, name="tinyllama", hf_architectures=("TinyLlamaForCausalLM",), gguf_architecture=None)
    monkeypatch.setattr(registry, "FAMILIES", (*FAMILIES, added))
    directory = write_hf_directory(make_tiny_checkpoint(seed=3), tmp_path / "tiny")
    config_path = directory / "config.json"
    values = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**values, "architectures": ["TinyLlamaForCausalLM"]}))
    checkpoint = load_checkpoint(directory)
    assert (checkpoint.config.architecture, checkpoint.config.model_kind) == ("tinyllama", AUTOREGRESSIVE)
    assert family_named(checkpoint.config.architecture).module_class() is llama.module_class()
    assert registry.family_of_hf(values | {"architectures": ["TinyLlamaForCausalLM"]}) is added
