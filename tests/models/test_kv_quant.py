"""The byte KV caches' numbers (models/kv_quant.py: int8 and fp8 e4m3) and the eager model over a
byte cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.export.export_model import export_model
from kiln.export.options import ExportOptions
from kiln.models import kv_quant
from kiln.models.llama import PagedLlama
from kiln.runtime.errors import ExportError
from tests.tiny_model import make_tiny_checkpoint

BYTE_FORMATS = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


@pytest.mark.parametrize("fmt", BYTE_FORMATS)
def test_a_vector_comes_back_within_half_a_step_of_its_scale(fmt):
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((500, 64)).astype(np.float32)) * torch.from_numpy(
        rng.uniform(1e-3, 300, (500, 1)).astype(np.float32))
    x[0] = 0  # a zero vector (padding) still gets a finite scale
    values, pairs = kv_quant.quantize(x, fmt)
    scales = kv_quant.scales(pairs).unsqueeze(1)
    assert values.dtype == torch.int8 and pairs.shape == (500, 2) and torch.isfinite(scales).all()
    decoded = kv_quant.values(values, fmt)
    error = (decoded * scales - x).abs()
    # Half a step: int8's steps are one scale; e4m3's are 2**-3 of the value's power of two (2**-9
    # below 2**-6, the subnormals).
    if fmt == "int8":
        step = torch.ones_like(x)
    else:
        step = torch.exp2(torch.clamp(torch.floor(torch.log2((x / scales).abs())), min=-6.0) - 3.0)
    assert (error <= scales * step * 0.5 + 1e-6 * x.abs()).all()
    # Rounded up, never clipped: the largest element lands within one step of the format's largest.
    top = decoded.abs().amax(dim=1)[1:]
    assert (top >= {"int8": 126, "fp8_e4m3": 448}[fmt]).all() and (top <= kv_quant.QMAX[fmt]).all()


def test_fp8_bytes_are_torchs_float8_e4m3fn():
    """The arithmetic encoding gives torch's own conversion's bits (round to nearest even, the
    subnormals, the carry at each power of two), and decodes every byte but the two NaNs exactly."""
    x = torch.cat([torch.linspace(-448, 448, 400_001), torch.linspace(-0.04, 0.04, 100_001),
                   torch.tensor([0.0, 2.0**-9, 2.0**-10, 3 * 2.0**-10, 2.0**-6, 15 * 2.0**-10, 464.0 - 1e-3])])
    x = torch.clamp(x, -448, 448)
    assert torch.equal(kv_quant.fp8_bytes(x), x.to(torch.float8_e4m3fn).view(torch.int8))
    every = torch.arange(-128, 128).to(torch.int8)
    number = (every != 127) & (every != -1)
    assert torch.equal(kv_quant.fp8_values(every)[number], every.view(torch.float8_e4m3fn).float()[number])


def test_a_scale_is_a_bfloat16_bit_pattern_little_endian():
    scales = torch.tensor([1e-30, 3.7e-3, 1.0, 0.5, 254.0 / 127, 1e4])
    code = kv_quant.encode_scale(scales * 127, 127)
    as_bf16 = torch.from_numpy(code.numpy().astype(np.int16)).view(torch.bfloat16).float()
    assert torch.equal(as_bf16, kv_quant.decode_scale(code))
    assert (as_bf16 >= scales).all() and (as_bf16 <= scales * (1 + 2**-7) + 1e-38).all()
    pairs = kv_quant.code_bytes(code)
    assert np.array_equal(np.frombuffer(pairs.numpy().tobytes(), "<u2"), code.numpy())
    assert torch.equal(kv_quant.bytes_code(pairs), code)


@pytest.mark.parametrize("fmt", BYTE_FORMATS)
def test_the_paged_path_over_a_byte_cache_stays_near_the_plain_path(fmt):
    """Prefill in two chunks, then decode, through a byte cache: within what 8 bits of K and V cost
    the tiny random model (its logits are a few units; 1% of their range for int8, 2% for e4m3's
    3 mantissa bits)."""
    dtype = BYTE_FORMATS[fmt]
    checkpoint = make_tiny_checkpoint(seed=5)
    model = PagedLlama(checkpoint.config, block_seq_stride=8).load_tensors(checkpoint.tensors).eval()
    tokens = list(range(10, 31))
    cache = model.allocate_cache(16, dtype)
    assert cache.dtype == dtype and cache.shape[1] == model.page_elems(dtype) == model.page_elems(torch.int8)
    table = torch.tensor([[3, 7, 2, 9]])
    with torch.no_grad():
        want = model.forward_reference(torch.tensor([tokens]))[0]
        h1 = model.forward_paged(torch.tensor([tokens[:16]]), torch.tensor([0]), torch.tensor([16]), table[:, :2], cache)
        h2 = model.forward_paged(torch.tensor([tokens[16:20] + [0] * 4]), torch.tensor([16]), torch.tensor([20]),
                                 table[:, :3], cache)
        h3 = model.forward_paged(torch.tensor([[tokens[20]]]), torch.tensor([20]), torch.tensor([21]), table[:, :3],
                                 cache)
        got = torch.cat([model.logits(h1)[0], model.logits(h2)[0, :4], model.logits(h3)[0]])
    assert (got - want).abs().max() / want.abs().max() < {"int8": 1e-2, "fp8_e4m3": 2e-2}[fmt]


@pytest.mark.parametrize("fmt", BYTE_FORMATS)
def test_a_byte_cache_is_refused_where_it_cannot_be_laid_out(fmt, tmp_path):
    with pytest.raises(ExportError, match="kv_cache_dtype must be one of float32, float16, bfloat16, int8, fp8_e4m3"):
        ExportOptions(kv_cache_dtype="int4").validate(256)
    odd = make_tiny_checkpoint(seed=5, hidden_size=60, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ExportError, match=f"--kv-cache-dtype {fmt} .* needs an even head_dim, the model's is 15"):
        export_model(odd, ExportOptions(kv_cache_dtype=fmt, max_seq_len=64), tmp_path / "out")
