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
    ACTIVATION_GROUP, Q8_0_BLOCK, QuantizedEmbedding, QuantizedLinear, QuantizedWeight, eager_weight_matmul,
    pack_nibbles, quantize_model, quantize_q8_0, quantize_rows, stacked_linear, unpack_nibbles,
)
from kiln.models.sharded_llama import ShardedPagedLlama
from kiln.runtime.device_layout import DeviceLayout
from kiln.runtime.errors import ExportError
from tests.tiny_model import make_tiny_checkpoint, random_blocks


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


@pytest.mark.parametrize("mode,tolerance", [("bf16", 1e-2), ("int8", 3e-2), ("q8_0", 2e-2), ("q4_0", 0.2),
                                            ("q4_1", 0.2)])
def test_a_quantized_linear_approximates_the_float_one(mode, tolerance):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=True)
    quantized = QuantizedLinear(linear, mode)
    assert quantized.weight.dtype == (torch.bfloat16 if mode == "bf16" else torch.int8)
    assert (quantized.offset is None) == (mode != "q4_1")
    assert (quantized.scale is None) == (mode == "bf16")
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        want, got = linear(x), quantized(x)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert (got - want).abs().max() / want.abs().max() < tolerance
    # The stored weight stands for the float one to within half a quantization step per row
    # (per block for Q8_0, whose float16 scale is off by up to 2^-11 of itself, which a value of
    # up to 127 steps multiplies).
    if mode == "int8":
        step = linear.weight.abs().amax(dim=1, keepdim=True) / 127
    elif mode == "q8_0":
        blocks = linear.weight.abs().view(96, -1, Q8_0_BLOCK).amax(dim=-1, keepdim=True) / 127
        step = (blocks * (1 + 2 * 127 * 2**-11)).expand(-1, -1, Q8_0_BLOCK).reshape(96, 64)
    elif mode in ("q4_0", "q4_1"):  # 16 levels per block, a float16 scale (and offset)
        blocks = linear.weight.view(96, -1, Q8_0_BLOCK)
        # Q4_0's levels run -8..7 steps from the largest |w|'s side: the other side's extreme
        # is clamped a whole step short.
        span = 2 * blocks.abs().amax(-1, keepdim=True) / 8 if mode == "q4_0" else (
            blocks.amax(-1, keepdim=True) - blocks.amin(-1, keepdim=True)) / 15
        step = (span * 1.02).expand(-1, -1, Q8_0_BLOCK).reshape(96, 64)
    else:
        step = linear.weight.abs() / 128
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


def test_int8_rows_go_to_the_block_kernel_whole_with_the_rows_scale_in_every_block():
    """Where the matmul offers `rows_blocks`, an int8 weight's one-token product goes there at any
    batch (its input quantized per block of 32, each block taking the weight row's scale); a K
    that is no multiple of 32 keeps the grouped int8 matmul."""
    calls = []

    def matmul(*args):
        return eager_weight_matmul(*args)

    def rows_blocks(q, xs, w, ws, xsum=None, wo=None):  # the block kernel's arithmetic, float64 sums
        calls.append((q.shape[0], tuple(ws.shape)))
        m, groups = xs.shape
        sums = torch.einsum("mgk,ngk->mgn", q.view(m, groups, -1).double(), w.view(w.shape[0], groups, -1).double())
        return (sums.float() * ws * xs.view(m, groups, 1)).sum(dim=1)

    matmul.rows_blocks = rows_blocks
    torch.manual_seed(8)
    layer = QuantizedLinear(nn.Linear(3 * Q8_0_BLOCK, 24, bias=False), "int8", matmul)
    x = torch.randn(1, 1, 3 * Q8_0_BLOCK)
    x[..., 0] *= 50  # an outlier channel: only its own block's scale grows
    with torch.no_grad():
        got = layer(x)
        assert calls == [(1, (24,))]
        want = torch.zeros(1, 1, 24)
        for block in range(3):
            q, scale = quantize_rows(x[..., block * Q8_0_BLOCK:(block + 1) * Q8_0_BLOCK])
            w = layer.weight[:, block * Q8_0_BLOCK:(block + 1) * Q8_0_BLOCK]
            want += (q.double() @ w.double().T).float() * scale
        torch.testing.assert_close(got, want * layer.scale, rtol=1e-5, atol=1e-5)
        assert (got - x @ layer.dequantized().T).abs().max() < 0.02 * got.abs().max()
        torch.testing.assert_close(layer(torch.cat([x, -x])), torch.cat([got, -got]))
        QuantizedLinear(nn.Linear(40, 8, bias=False), "int8", matmul)(torch.randn(1, 1, 40))
    assert calls == [(1, (24,)), (2, (24,))]


def test_q8_0_blocks_are_ggmls_and_one_token_sums_each_block_with_both_scales():
    from gguf import GGMLQuantizationType, quants

    torch.manual_seed(5)
    weight = torch.randn(24, 3 * Q8_0_BLOCK) * torch.tensor([1e-3, 1, 40]).repeat_interleave(Q8_0_BLOCK)
    weight[0, :Q8_0_BLOCK] = 0  # an all-zero block: scale 0, values 0
    values, scales = quantize_q8_0(weight)
    blocks = quants.quantize(weight.numpy(), GGMLQuantizationType.Q8_0).reshape(24, 3, 34)
    assert (values.numpy() == blocks[..., 2:].copy().view(np.int8).reshape(24, -1)).all()
    assert (scales.numpy() == blocks[..., :2].copy().view(np.float16).reshape(24, 3).T).all()
    layer = QuantizedLinear(nn.Linear(3 * Q8_0_BLOCK, 24, bias=False), "q8_0")
    layer.weight.data, layer.scale.data = values, scales
    x = torch.randn(2, 1, 3 * Q8_0_BLOCK)
    with torch.no_grad():
        got = layer(x)
        many = x.expand(2, 3, -1)  # a prefill: its rows as one matrix, times the widened weight
        torch.testing.assert_close(layer(many), (many.reshape(6, -1) @ layer.dequantized().T).view(2, 3, 24))
    want = torch.zeros(2, 1, 24)
    for block in range(3):
        part = x[..., block * Q8_0_BLOCK:(block + 1) * Q8_0_BLOCK]
        q, scale = quantize_rows(part)
        w = values[:, block * Q8_0_BLOCK:(block + 1) * Q8_0_BLOCK]
        want += (q.double() @ w.double().T).float() * scale * scales[block].float()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_q4_1_blocks_sum_each_block_with_both_scales_and_add_the_quantized_input_sum_times_the_offset():
    from kiln.models.gguf_blocks import quantize_blocks

    torch.manual_seed(7)
    weight = torch.randn(24, 3 * Q8_0_BLOCK) + torch.tensor([-2.0, 0, 3]).repeat_interleave(Q8_0_BLOCK)
    blocks = quantize_blocks(weight.numpy(), "Q4_1")
    assert blocks.values.min() >= 0 and blocks.values.max() <= 15 and blocks.offsets.shape == (3, 24)
    layer = QuantizedLinear(nn.Linear(3 * Q8_0_BLOCK, 24, bias=False), "q4_1", stored=blocks)
    x = torch.randn(2, 1, 3 * Q8_0_BLOCK)
    with torch.no_grad():
        got = layer(x)
        many = x.expand(2, 3, -1)
        torch.testing.assert_close(layer(many), many @ torch.from_numpy(blocks.dequantized()).T)
    want = torch.zeros(2, 1, 24)
    for block in range(3):
        part = x[..., block * Q8_0_BLOCK:(block + 1) * Q8_0_BLOCK]
        q, scale = quantize_rows(part)
        w = torch.from_numpy(blocks.values[:, block * Q8_0_BLOCK:(block + 1) * Q8_0_BLOCK])
        want += (q.double() @ w.double().T).float() * scale * torch.from_numpy(blocks.scales[block])
        want += (q.float() * scale).sum(-1, keepdim=True) * torch.from_numpy(blocks.offsets[block])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_blocks_read_from_a_files_bytes_dequantize_as_gguf_py_does(qtype):
    from gguf import GGMLQuantizationType, quants

    from kiln.models.gguf_blocks import read_blocks

    raw = random_blocks(qtype, 40, 512, scale=0.01)
    blocks = read_blocks(raw, qtype, 40, 512)
    assert blocks.values.dtype == np.int8 and blocks.block == (16 if qtype == "Q6_K" else 32)
    assert blocks.scales.shape == (512 // blocks.block, 40)
    assert (blocks.offsets is None) == (qtype in ("Q8_0", "Q4_0", "Q5_0", "Q6_K"))
    assert (blocks.dequantized() == quants.dequantize(raw, GGMLQuantizationType[qtype])).all()
    if qtype in ("Q8_0", "Q4_0", "Q4_1"):  # gguf-py quantizes these: an all-zero block stays zero
        weight = np.random.default_rng(8).standard_normal((40, 96)).astype(np.float32)
        weight[3, 32:64] = 0
        raw = quants.quantize(weight, GGMLQuantizationType[qtype])
        assert (read_blocks(raw, qtype, 40, 96).dequantized() == quants.dequantize(raw, GGMLQuantizationType[qtype])).all()


def test_a_k_quant_mix_is_served_each_weight_in_its_own_blocks():
    """Q4_K q/k beside a Q6_K v (blocks of 32 and 16) in one stacked matmul: each layer's output
    as alone, and the one-token product the dequantized weight's with the per-block quantized
    input."""
    from kiln.models.gguf_blocks import read_blocks

    torch.manual_seed(9)
    layers = [QuantizedLinear(nn.Linear(512, n, bias=False), "gguf",
                              stored=read_blocks(random_blocks(qtype, n, 512, seed, 0.01), qtype, n, 512))
              for seed, (qtype, n) in enumerate([("Q4_K", 48), ("Q4_K", 16), ("Q6_K", 16)])]
    x = torch.randn(3, 1, 512)
    with torch.no_grad():
        stacked = stacked_linear(layers, x)
        separate = [layer(x) for layer in layers]
    # The stack quantizes x per 16 for all three, the Q4_K layers alone per 32: close, not equal.
    for got, want, layer in zip(stacked.split([48, 16, 16], dim=-1), separate, layers):
        exact = x @ layer.dequantized().T
        assert (got - exact).abs().max() < 0.02 * exact.abs().max()
        assert (want - exact).abs().max() < 0.02 * exact.abs().max()
    torch.testing.assert_close(stacked[..., 64:], separate[2], rtol=1e-5, atol=1e-5)  # Q6_K: per 16 either way


def _with_nibble_kernel():
    """eager_weight_matmul offering products of 4-bit values two a byte, any rows: unpacked, the
    block sums by hand (float64, exact), both scales and the offset term as the CPU kernel takes them."""

    def matmul(*args):
        return eager_weight_matmul(*args)

    def rows_nibbles(q, xs, packed, ws, xsum, wo):  # q [M, K], xs and xsum [M, G]
        values = unpack_nibbles(packed).double()
        m, groups = xs.shape
        sums = torch.einsum("mgk,ngk->mgn", q.view(m, groups, -1).double(), values.view(values.shape[0], groups, -1))
        return ((sums.float() * ws + xsum.unsqueeze(-1) * wo) * xs.unsqueeze(-1)).sum(dim=1)

    matmul.rows_nibbles = rows_nibbles
    return matmul


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_4_bit_values_are_kept_two_a_byte_as_the_file_holds_them_where_the_kernel_takes_them(qtype):
    """The packed bytes are the file's own (ggml's layout), the weight they stand for is the same
    bit for bit (Q4_0's q - 8 as q with an offset of -8 d), and every product matches the one over
    values one a byte: one token of one row or three, and several tokens (a prefill's, each token
    the kernel's one-token product, not widened)."""
    from kiln.models.gguf_blocks import BLOCK_BYTES, read_blocks

    raw = random_blocks(qtype, 24, 256, seed=4, scale=0.01)
    blocks = read_blocks(raw, qtype, 24, 256)
    packed = QuantizedLinear(nn.Linear(256, 24, bias=False), "gguf", _with_nibble_kernel(), blocks)
    plain = QuantizedLinear(nn.Linear(256, 24, bias=False), "gguf", stored=blocks)
    assert packed.packed and not plain.packed
    assert packed.weight.shape == (24, 128) and packed.weight.dtype == torch.int8 and packed.offset is not None
    values = torch.randint(0, 16, (5, 64), dtype=torch.int8)
    assert (unpack_nibbles(pack_nibbles(values)) == values).all()
    if qtype != "Q4_K":  # a 32-value block's last 16 bytes are its values (Q4_K's interleave blocks in pairs)
        file_values = raw.view(np.uint8).reshape(24, 256 // 32, BLOCK_BYTES[qtype])[..., -16:].reshape(24, 128)
        assert (packed.weight.numpy().view(np.uint8) == file_values).all()
    assert (packed.dequantized() == plain.dequantized()).all()
    torch.manual_seed(4)
    for tokens in (1, 3):
        x = torch.randn(2, tokens, 256) if tokens > 1 else torch.randn(1, 1, 256)
        with torch.no_grad():
            one_at_a_time = torch.cat([plain(x[:, t:t + 1]) for t in range(tokens)], dim=1)
            torch.testing.assert_close(packed(x), one_at_a_time, rtol=1e-5, atol=1e-5)
    rows = torch.randn(3, 1, 256)  # a decode step of three rows
    with torch.no_grad():
        torch.testing.assert_close(packed(rows), plain(rows), rtol=1e-5, atol=1e-5)


def test_a_4_bit_embedding_two_a_byte_looks_up_and_projects_as_one_a_byte():
    """A tied embedding in Q4_0 (a file whose embedding is 4-bit): its rows are unpacked where
    looked up, and as the output head it takes the kernel at one token and at several."""
    from kiln.models.gguf_blocks import read_blocks

    blocks = read_blocks(random_blocks("Q4_0", 50, 64, seed=6, scale=0.01), "Q4_0", 50, 64)
    packed = QuantizedEmbedding(nn.Embedding(50, 64), "q4_0", _with_nibble_kernel(), blocks)
    plain = QuantizedEmbedding(nn.Embedding(50, 64), "q4_0", stored=blocks)
    assert packed.packed and packed.weight.shape == (50, 32)
    tokens = torch.tensor([[3, 49, 0]])
    torch.manual_seed(6)
    with torch.no_grad():
        assert (packed(tokens) == plain(tokens)).all()
        for h in (torch.randn(1, 1, 64), torch.randn(1, 3, 64)):
            one_at_a_time = torch.cat([plain.project(h[:, t:t + 1]) for t in range(h.shape[1])], dim=1)
            torch.testing.assert_close(packed.project(h), one_at_a_time, rtol=1e-5, atol=1e-5)


def test_stacked_layers_of_values_two_a_byte_stack_them_and_beside_other_blocks_run_alone():
    torch.manual_seed(5)
    kernel = _with_nibble_kernel()
    q4 = [QuantizedLinear(nn.Linear(64, n, bias=True), "q4_1", kernel) for n in (48, 16)]
    q8 = QuantizedLinear(nn.Linear(64, 16, bias=True), "q8_0", kernel)
    assert [layer.packed for layer in (*q4, q8)] == [True, True, False]
    for tokens in (1, 5):
        x = torch.randn(2, tokens, 64)
        with torch.no_grad():
            for layers in (q4, [*q4, q8]):
                stacked = stacked_linear(layers, x)
                separate = torch.cat([layer(x) for layer in layers], dim=-1)
                torch.testing.assert_close(stacked, separate, rtol=1e-5, atol=1e-5)


def test_gguf_mode_needs_a_file_of_blocks():
    with pytest.raises(ExportError, match="--quantize gguf serves a GGUF's own blocks"):
        ExportOptions(quantize="gguf").validate(256, "none")
    assert ExportOptions(quantize="gguf").validate(256, "q4_1").quantize == "gguf"


def test_q8_0_keeps_a_width_that_is_no_multiple_of_32_in_row_scales():
    layer = QuantizedLinear(nn.Linear(48, 8, bias=False), "q8_0")
    assert layer.weight.dtype == torch.int8 and layer.scale.shape == (8,)


@pytest.mark.parametrize("mode", ["bf16", "int8", "q8_0", "q4_1"])
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
@pytest.mark.parametrize("mode", ["bf16", "int8", "q8_0", "q4_0", "q4_1"])
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
    assert stored < float_bytes * {"bf16": 0.55, "int8": 0.3, "q8_0": 0.3, "q4_0": 0.3, "q4_1": 0.33}[mode]
    if mode.startswith("q4"):
        # 16 levels per block move a random tiny model's near-flat logits past each other: the
        # check is against the float model holding the weights the blocks stand for.
        narrow = {f"{name}.weight": m.dequantized().numpy() for name, m in model.named_modules()
                  if isinstance(m, QuantizedWeight)}
        if tied:
            narrow.pop("lm_head.weight", None)
        dequantized = PagedLlama(checkpoint.config, block_seq_stride=8).load_tensors(
            checkpoint.tensors | narrow).eval()
        with torch.no_grad():
            want = dequantized.forward_reference(tokens)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        return
    assert (got - want).abs().max() / want.abs().max() < {"bf16": 2e-2, "int8": 6e-2, "q8_0": 6e-2}[mode]
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


@pytest.mark.parametrize("dtype,stored,resolved", [
    ("float32", "q8_0", "q8_0"), ("float32", "q4_1", "q4_1"), ("float32", "bf16", "bf16"), ("float32", "none", "none"),
    ("float16", "q8_0", "none"),  # narrow activations: the file's blocks are widened to the dtype
])
def test_auto_takes_the_files_own_quantization_where_activations_stay_float32(dtype, stored, resolved):
    assert ExportOptions(dtype=dtype).validate(256, stored).quantize == resolved
    assert ExportOptions(quantize="int8").validate(256, stored).quantize == "int8"  # an explicit mode wins


def _file_blocks(raw: np.ndarray, qtype: str, rows: int) -> tuple[np.ndarray, ...]:
    """(values, scales, offsets or None) of a tensor's blocks, each [rows, blocks(, 32)], read
    from ggml's byte layout as ggml-common.h writes it."""
    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[qtype]
    blocks = np.asarray(raw).reshape(rows, -1, size)
    scales = blocks[..., :2].copy().view(np.float16)[..., 0]
    if qtype == "Q8_0":
        return blocks[..., 2:].copy().view(np.int8), scales, None
    packed = blocks[..., size - 16:].astype(np.int16)
    values = np.concatenate([packed % 16, packed // 16], axis=-1)  # low nibbles first, then high
    if qtype == "Q4_0":
        return values - 8, scales, None
    return values, scales, blocks[..., 2:4].copy().view(np.float16)[..., 0]


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("tied", [True, False])
def test_a_block_quantized_gguf_is_served_from_its_own_blocks(tmp_path, tied, dtype):
    """Every block of a Q8_0, Q4_0 or Q4_1 file (whose embedding is Q8_0, as llama.cpp writes Q4
    files) is what the export stores: its values byte for byte, its float16 scale and offset
    exactly (held as float32); the weights they stand for are gguf-py's dequantization of them."""
    from gguf import GGMLQuantizationType, GGUFReader, quants

    from kiln.export.export_model import build_model
    from kiln.models.gguf_loader import hf_tensor_name
    from kiln.models.rope import unpermute_qk
    from kiln.models.gguf_writer import write_gguf
    from kiln.models.loader import load_checkpoint

    path = write_gguf(make_tiny_checkpoint(seed=6, tie_word_embeddings=tied), tmp_path / f"tiny-{dtype}.gguf", dtype=dtype)
    checkpoint = load_checkpoint(path)
    assert checkpoint.stored_quantization == dtype
    model = build_model(checkpoint, ExportOptions().validate(256, checkpoint.stored_quantization))
    config, checked = checkpoint.config, 0
    for tensor in GGUFReader(path).tensors:
        if len(tensor.shape) != 2:
            continue
        qtype = tensor.tensor_type.name
        assert qtype == ("Q8_0" if tensor.name == "token_embd.weight" else dtype.upper())
        rows = int(tensor.shape[1])
        values, scales, offsets = _file_blocks(tensor.data, qtype, rows)
        floats = quants.dequantize(np.asarray(tensor.data), GGMLQuantizationType[qtype]).reshape(rows, -1)
        if ".attn_q." in tensor.name or ".attn_k." in tensor.name:
            heads = config.num_attention_heads if ".attn_q." in tensor.name else config.num_key_value_heads
            values, scales, floats = (unpermute_qk(a, heads) for a in (values, scales, floats))
            offsets = None if offsets is None else unpermute_qk(offsets, heads)
        module = model.get_submodule(hf_tensor_name(tensor.name).removesuffix(".weight"))
        assert (module.weight.numpy() == values.reshape(rows, -1)).all(), tensor.name
        assert (module.scale.numpy().T == scales).all()  # each float16 scale, exactly
        assert (offsets is None) == (module.offset is None) and (offsets is None or (module.offset.numpy().T == offsets).all())
        assert (module.dequantized().numpy() == floats).all(), tensor.name
        checked += 1
    assert checked == 2 + 7 * config.num_hidden_layers - tied


def test_the_files_quantization_is_kept_only_when_every_weight_has_it():
    from kiln.models.gguf_loader import stored_quantization

    assert stored_quantization(["Q8_0"] * 5) == "q8_0"
    assert stored_quantization(["BF16"] * 5) == "bf16"
    # llama.cpp's Q4_1 files keep the embedding in Q8_0: both are blocks Kiln reads as stored.
    assert stored_quantization(["Q4_1"] * 4 + ["Q8_0"]) == "q4_1"
    assert stored_quantization(["Q4_0"] * 4 + ["Q8_0"]) == "q4_0"
    assert stored_quantization(["Q4_K", "Q6_K", "Q8_0"]) == "gguf"  # a k-quant mix: each in its own type
    assert stored_quantization(["Q4_1", "Q5_0"]) == "gguf"
    assert stored_quantization(["Q4_K", "IQ4_XS"]) == "none"  # a type Kiln widens: all are widened
    assert stored_quantization(["Q8_0", "BF16"]) == "none"
    assert stored_quantization(["F16", "F32"]) == "none"
