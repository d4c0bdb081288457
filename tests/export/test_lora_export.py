"""LoRA slots in the compiled functions: a batch whose rows use different adapters (or none) gives
each row the logits of the model with its adapter merged (float32, 1e-4), in prefill and decode;
and what an export with slots refuses."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from kiln.export import cpu_kernels
from kiln.export.options import ExportOptions
from kiln.models.llama import PagedLlama
from kiln.runtime.contract import Artifacts
from kiln.runtime.errors import ExportError
from kiln.runtime.lora.adapter import LoraAdapter, LoraShapes
from kiln.runtime.lora.weights import StackedLoraWeights
from kiln.runtime.program import Program


def random_adapter(shapes: LoraShapes, rank: int, seed: int) -> LoraAdapter:
    rng = np.random.default_rng(seed)
    weights = {(layer, module): ((rng.normal(size=(rank, fin)) * 0.1).astype(np.float32),
                                 (rng.normal(size=(fout, rank)) * 0.1).astype(np.float32))
               for layer in range(shapes.layers) for module, (fin, fout) in shapes.modules.items()}
    return LoraAdapter(f"a{seed}", None, rank, 1.0, weights)


@pytest.mark.parametrize("build", ["gathered", "kernel"])
def test_each_row_gets_the_logits_of_its_adapter_merged(build, request, tiny_checkpoint):
    """Both forms of the delta: the model's own (every row's weights gathered) and the CPU kernel's
    (each row's slot read in place, nothing for a row without an adapter)."""
    if build == "kernel" and cpu_kernels.support_problem():
        pytest.skip(cpu_kernels.support_problem())
    artifacts = request.getfixturevalue("tiny_lora_artifacts" if build == "gathered" else "tiny_lora_kernel_artifacts")
    program = Program(Artifacts.in_directory(artifacts), "local-task", "auto")
    abi = program.capabilities
    shapes = LoraShapes(abi.lora_layers, abi.lora_rank, {name: (fin, fout) for name, fin, fout in abi.lora_modules})
    adapters = {1: random_adapter(shapes, 8, 1), 2: random_adapter(shapes, 3, 2)}  # rank 3 is zero-padded to 8
    stacked = StackedLoraWeights(shapes, abi.lora_slots)
    for slot, adapter in adapters.items():
        stacked.write(slot, adapter)
    weights = [program.device_array(array) for module in shapes.modules
               for array in (stacked.a[module], stacked.b[module])]

    def reference(slot: int, ids: list[int]) -> np.ndarray:
        tensors = dict(tiny_checkpoint.tensors)
        for (layer, module), (a, b) in (adapters[slot].weights.items() if slot else ()):
            block = "mlp" if module == "down_proj" else "self_attn"
            name = f"model.layers.{layer}.{block}.{module}.weight"
            tensors[name] = tensors[name] + b @ a
        model = PagedLlama(tiny_checkpoint.config).load_tensors(tensors).eval()
        with torch.no_grad():
            return model.forward_reference(torch.tensor([ids]))[0].numpy()

    rng = np.random.default_rng(3)
    tokens = rng.integers(4, 300, size=(4, 32)).astype(np.int64)
    lengths = np.array([20, 20, 17, 9], np.int64)
    slots = np.array([0, 1, 2, 1], np.int64)
    table = np.arange(1, 9, dtype=np.int64).reshape(4, 2)
    cache = program.allocate_cache(64)
    prefill = np.array(program.call("prefill_bs4", tokens, np.zeros(4, np.int64), lengths, table, slots, *weights,
                                    cache))
    following = rng.integers(4, 300, size=(4, 1)).astype(np.int64)
    decode = np.array(program.call("decode_bs4", following, lengths + 1, lengths, table, slots, *weights, cache))
    for row in range(4):
        ids = tokens[row, :lengths[row]].tolist()
        expected = reference(int(slots[row]), ids + [int(following[row, 0])])
        np.testing.assert_allclose(prefill[row, :lengths[row]], expected[:-1], atol=1e-4)
        np.testing.assert_allclose(decode[row, 0], expected[-1], atol=1e-4)
    assert not np.allclose(reference(1, ids), reference(0, ids), atol=1e-2)  # the adapters change the logits


@pytest.mark.parametrize("options, message", [
    (dict(lora_slots=2, lora_modules=("q_proj", "lm_head")), "--lora-modules must be some of"),
    (dict(lora_slots=2, lora_rank=0), "--max-lora-rank"),
    (dict(lora_slots=2, tensor_parallel=2), "one-device export"),
])
def test_lora_options_that_cannot_be_built_are_refused(options, message):
    with pytest.raises(ExportError, match=message):
        replace(ExportOptions(), **options).validate(2048)
