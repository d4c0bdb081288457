"""Quantized weights in eager torch: the storage, the arithmetic each matmul does, and a whole
model (one device and sharded) with every weight matmul and the embedding replaced."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from iree.turbine.aot import DeviceTensorTrait
from torch import nn

from kiln.export.options import ExportOptions
from kiln.models.llama import PagedLlama
from kiln.models.quantize import (
    ACTIVATION_GROUP, QuantizedEmbedding, QuantizedLinear, eager_weight_matmul, quantize_model, quantize_rows,
    stacked_linear,
)
from kiln.models.sharded_llama import ShardedPagedLlama
from kiln.runtime.device_layout import DeviceLayout
from kiln.runtime.errors import ExportError
from tests.tiny_model import make_tiny_checkpoint


def test_int8_rows_round_trip_within_half_a_step_and_zero_rows_stay_zero():
    x = torch.randn(5, 64) * torch.tensor([0.01, 1, 30, 0, 2]).view(5, 1)
    q, scale = quantize_rows(x)
    assert q.dtype == torch.int8 and scale.shape == (5, 1)
    assert (q.abs().amax(dim=1)[[0, 1, 2, 4]] == 127).all()  # each row's largest value maps to ±127
    assert (q[3] == 0).all()
    assert ((q.float() * scale - x).abs() <= scale / 2 + 1e-7).all()


def test_int8_matmul_is_exact_and_bf16_sums_in_float32():
    rng = np.random.default_rng(0)
    a, b = rng.integers(-127, 128, (3, 200)), rng.integers(-127, 128, (7, 200))
    got = eager_weight_matmul(torch.tensor(a, dtype=torch.int8), torch.tensor(b, dtype=torch.int8))
    assert got.dtype == torch.int32 and (got.numpy() == a @ b.T).all()
    x, w = torch.randn(3, 64).bfloat16(), torch.randn(7, 64).bfloat16()
    got = eager_weight_matmul(x, w)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, (x.double() @ w.double().T).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode,tolerance", [("bf16", 1e-2), ("int8", 3e-2)])
def test_a_quantized_linear_approximates_the_float_one(mode, tolerance):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=True)
    quantized = QuantizedLinear(linear, mode)
    assert quantized.weight.dtype == {"bf16": torch.bfloat16, "int8": torch.int8}[mode]
    assert (quantized.scale is None) == (mode == "bf16")
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        want, got = linear(x), quantized(x)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert (got - want).abs().max() / want.abs().max() < tolerance
    # The stored weight stands for the float one to within half a quantization step per row.
    step = (linear.weight.abs().amax(dim=1, keepdim=True) / 127) if mode == "int8" else linear.weight.abs() / 128
    assert ((quantized.dequantized() - linear.weight).abs() <= step / 2 + 1e-7).all()


def test_many_tokens_widen_the_weight_and_one_token_quantizes_its_input_per_group():
    torch.manual_seed(3)
    layer = QuantizedLinear(nn.Linear(2 * ACTIVATION_GROUP, 24, bias=False), "int8")
    x = torch.randn(3, 5, 2 * ACTIVATION_GROUP)
    x[..., 0] *= 50  # an outlier channel: only its own group's scale grows
    with torch.no_grad():
        torch.testing.assert_close(layer(x), x @ layer.dequantized().T)  # prefill: float32 arithmetic
        one = x[:, :1]
        got = layer(one)
    want = torch.zeros(3, 1, 24)
    for group in range(2):
        part = one[..., group * ACTIVATION_GROUP:(group + 1) * ACTIVATION_GROUP]
        q, scale = quantize_rows(part)
        w = layer.weight[:, group * ACTIVATION_GROUP:(group + 1) * ACTIVATION_GROUP]
        want += (q.double() @ w.double().T).float() * scale
    torch.testing.assert_close(got, want * layer.scale, rtol=1e-5, atol=1e-5)
    assert (got - one @ layer.dequantized().T).abs().max() < 0.1 * got.abs().max()  # the outlier costs its group


@pytest.mark.parametrize("mode", ["bf16", "int8"])
def test_stacked_layers_give_each_layers_output(mode):
    torch.manual_seed(1)
    layers = [QuantizedLinear(nn.Linear(32, n, bias=True), mode) for n in (48, 16, 16)]
    x = torch.randn(3, 1, 32)
    with torch.no_grad():
        stacked = stacked_linear(layers, x)
        separate = torch.cat([layer(x) for layer in layers], dim=-1)
    # int8 quantizes x once per matmul either way, with the same row scale: the same numbers.
    torch.testing.assert_close(stacked, separate, rtol=1e-6, atol=1e-6)


def test_a_quantized_embedding_looks_up_and_projects_with_the_same_rows():
    torch.manual_seed(2)
    embedding = QuantizedEmbedding(nn.Embedding(50, 16), "int8")
    tokens = torch.tensor([[3, 49, 0]])
    with torch.no_grad():
        torch.testing.assert_close(embedding(tokens), embedding.dequantized()[tokens])
        h = torch.randn(1, 3, 16)
        logits = embedding.project(h)
    assert logits.shape == (1, 3, 50)
    assert (logits - h @ embedding.dequantized().T).abs().max() < 0.05 * logits.abs().max()


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("mode", ["bf16", "int8"])
def test_every_weight_matmul_of_a_model_is_replaced(mode, tied):
    checkpoint = make_tiny_checkpoint(seed=3, tie_word_embeddings=tied)
    model = PagedLlama(checkpoint.config, block_seq_stride=8).load_tensors(checkpoint.tensors).eval()
    tokens = torch.tensor([list(range(10, 30))])
    with torch.no_grad():
        want = model.forward_reference(tokens)
        float_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        quantize_model(model, mode)
        got = model.forward_reference(tokens)
    assert not [m for m in model.modules() if type(m) in (nn.Linear, nn.Embedding)]
    assert (model.lm_head is None) == tied
    stored = sum(p.numel() * p.element_size() for p in model.parameters())
    assert stored < float_bytes * {"bf16": 0.55, "int8": 0.3}[mode]
    assert (got - want).abs().max() / want.abs().max() < {"bf16": 2e-2, "int8": 6e-2}[mode]
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_a_sharded_model_keeps_each_weight_on_its_device():
    checkpoint = make_tiny_checkpoint(seed=4)
    fresh = PagedLlama(checkpoint.config, block_seq_stride=8).load_tensors(checkpoint.tensors).eval()
    sharded = ShardedPagedLlama(fresh, DeviceLayout(2, 1))
    before = {name: DeviceTensorTrait.get(p).ordinal for name, p in sharded.named_parameters()}
    quantize_model(sharded, "int8")
    after = {name: DeviceTensorTrait.get(p).ordinal for name, p in sharded.named_parameters()}
    for name, device in after.items():
        owner = name.rsplit(".", 1)[0]
        assert before.get(f"{owner}.weight", before.get(name)) == device, name
    assert {after["stages.0.0.attention.1.q_proj.scale"], after["stages.0.0.mlp.1.down_proj.weight"]} == {1}


def test_quantize_is_checked_before_any_work():
    with pytest.raises(ExportError, match="quantize must be one of"):
        ExportOptions(quantize="int4").validate(256)
    with pytest.raises(ExportError, match="needs --dtype float32"):
        ExportOptions(quantize="int8", dtype="float16").validate(256)
    assert ExportOptions(quantize="bf16", kv_cache_dtype="float16").validate(256).quantize == "bf16"
