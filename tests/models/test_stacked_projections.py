"""Q, K and V held as one stored weight (models/stacked_projections.py): the same logits in
prefill and decode, every byte held once, devices kept, and layers that cannot share a weight
left alone."""

from __future__ import annotations

import pytest
import torch
from iree.turbine.aot import DeviceTensorTrait
from torch import nn

from kiln.models.gguf_blocks import read_blocks
from kiln.models.llama import PagedLlama
from kiln.models.quantize import FLOAT32, QuantizedLinear, quantize_model
from kiln.models.sharded_llama import ShardedPagedLlama
from kiln.models.stacked_projections import StackedLinear, StackedRows, stack_attention_projections
from kiln.runtime.device_layout import DeviceLayout
from tests.tiny_model import make_tiny_checkpoint, random_blocks


def _bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("mode", ["none", FLOAT32, "bf16", "int8", "q8_0", "q4_1"])
def test_a_stacked_model_gives_the_same_logits_and_holds_each_byte_once(mode):
    checkpoint = make_tiny_checkpoint(seed=6, attention_bias=True)
    model = quantize_model(PagedLlama(checkpoint.config, block_seq_stride=8).load_tensors(checkpoint.tensors), mode)
    prompt, step = torch.tensor([list(range(10, 30))]), torch.tensor([[41], [7]])
    with torch.no_grad():
        want = model.forward_reference(prompt), model.forward_reference(step)
        held = _bytes(model)
        assert stack_attention_projections(model) == checkpoint.config.num_hidden_layers
        got = model.forward_reference(prompt), model.forward_reference(step)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert _bytes(model) == held
    names = [name for name, _ in model.named_parameters()]
    assert not [name for name in names if any(f".{p}." in name for p in ("q_proj", "k_proj", "v_proj"))]
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    attention = model.model.layers[0].self_attn
    assert isinstance(attention.q_proj, StackedRows) and attention.q_proj.stack is attention.qkv_proj
    assert attention.qkv_proj.bias is not None


def test_decode_multiplies_the_stack_whole_and_prefill_each_projections_rows():
    torch.manual_seed(0)
    layers = [nn.Linear(32, n) for n in (48, 16, 16)]
    stack = StackedLinear(layers)
    rows = [StackedRows(stack, index) for index in range(3)]
    calls = []
    original = stack.product
    stack.product = lambda x, part=None: calls.append(part) or original(x, part)
    x = torch.randn(2, 5, 32)
    from kiln.models.quantize import stacked_linear

    with torch.no_grad():
        torch.testing.assert_close(stacked_linear(rows, x), torch.cat([layer(x) for layer in layers], dim=-1))
        assert calls == [None]
        for layer, part in zip(layers, rows):
            torch.testing.assert_close(part(x), layer(x))
    assert calls[1:] == [slice(0, 48), slice(48, 64), slice(64, 80)]
    assert [part.out_features for part in rows] == [48, 16, 16]


def test_a_sharded_model_stacks_each_shard_on_its_own_device():
    checkpoint = make_tiny_checkpoint(seed=4)
    fresh = PagedLlama(checkpoint.config, block_seq_stride=8).load_tensors(checkpoint.tensors).eval()
    sharded = quantize_model(ShardedPagedLlama(fresh, DeviceLayout(2, 1)), "int8")
    before = {name: DeviceTensorTrait.get(p).ordinal for name, p in sharded.named_parameters()}
    stack_attention_projections(sharded)
    after = {name: DeviceTensorTrait.get(p).ordinal for name, p in sharded.named_parameters()}
    for name, device in after.items():
        if ".qkv_proj." in name:
            assert before[name.replace(".qkv_proj.", ".q_proj.")] == device, name
    assert {after["stages.0.0.attention.0.qkv_proj.scale"], after["stages.0.0.attention.1.qkv_proj.scale"]} == {0, 1}


def test_projections_of_different_storage_keep_their_own_weights():
    """A Q4_K q/k beside a Q6_K v held two 4-bit values a byte where the kernel reads them: the
    packed and unpacked weights cannot share a tensor, so each keeps its own."""

    class NibbleKernel:
        def __call__(self, *args):
            raise AssertionError("not called")

        def rows_nibbles(self, *args):
            raise AssertionError("not called")

    layers = [QuantizedLinear(nn.Linear(512, n, bias=False), "gguf", NibbleKernel(),
                              stored=read_blocks(random_blocks(qtype, n, 512, seed, 0.01), qtype, n, 512))
              for seed, (qtype, n) in enumerate([("Q4_K", 48), ("Q4_K", 16), ("Q6_K", 16)])]
    assert [layer.packed for layer in layers] == [True, True, False]
    assert not StackedLinear.stackable(layers)
    assert StackedLinear.stackable(layers[:2])
