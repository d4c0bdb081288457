"""The int8 KV cache's numbers (models/kv_quant.py) and the eager model over an int8 cache."""

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


def test_a_vector_comes_back_within_half_a_step_of_its_scale():
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((500, 64)).astype(np.float32)) * torch.from_numpy(
        rng.uniform(1e-3, 300, (500, 1)).astype(np.float32))
    x[0] = 0  # a zero vector (padding) still gets a finite scale
    values, pairs = kv_quant.quantize(x)
    scales = kv_quant.scales(pairs)
    assert values.dtype == torch.int8 and pairs.shape == (500, 2) and torch.isfinite(scales).all()
    error = (values.float() * scales.unsqueeze(1) - x).abs()
    assert (error <= scales.unsqueeze(1) * 0.5 + 1e-6 * x.abs()).all()
    # Rounded up, never clipped: the largest element lands within one step of 127.
    top = values.abs().amax(dim=1)[1:]
    assert (top >= 126).all() and (top <= 127).all()


def test_a_scale_is_a_bfloat16_bit_pattern_little_endian():
    scales = torch.tensor([1e-30, 3.7e-3, 1.0, 0.5, 254.0 / 127, 1e4])
    code = kv_quant.encode_scale(scales * kv_quant.QMAX)
    as_bf16 = torch.from_numpy(code.numpy().astype(np.int16)).view(torch.bfloat16).float()
    assert torch.equal(as_bf16, kv_quant.decode_scale(code))
    assert (as_bf16 >= scales).all() and (as_bf16 <= scales * (1 + 2**-7) + 1e-38).all()
    pairs = kv_quant.code_bytes(code)
    assert np.array_equal(np.frombuffer(pairs.numpy().tobytes(), "<u2"), code.numpy())
    assert torch.equal(kv_quant.bytes_code(pairs), code)


def test_the_paged_path_over_an_int8_cache_stays_near_the_plain_path():
    """Prefill in two chunks, then decode, through an int8 cache: within what 8 bits of K and V
    cost the tiny random model (its logits are a few units; 1% of their range)."""
    checkpoint = make_tiny_checkpoint(seed=5)
    model = PagedLlama(checkpoint.config, block_seq_stride=8).load_tensors(checkpoint.tensors).eval()
    tokens = list(range(10, 31))
    cache = model.allocate_cache(16, torch.int8)
    assert cache.dtype == torch.int8 and cache.shape[1] == model.page_elems(torch.int8)
    table = torch.tensor([[3, 7, 2, 9]])
    with torch.no_grad():
        want = model.forward_reference(torch.tensor([tokens]))[0]
        h1 = model.forward_paged(torch.tensor([tokens[:16]]), torch.tensor([0]), torch.tensor([16]), table[:, :2], cache)
        h2 = model.forward_paged(torch.tensor([tokens[16:20] + [0] * 4]), torch.tensor([16]), torch.tensor([20]),
                                 table[:, :3], cache)
        h3 = model.forward_paged(torch.tensor([[tokens[20]]]), torch.tensor([20]), torch.tensor([21]), table[:, :3],
                                 cache)
        got = torch.cat([model.logits(h1)[0], model.logits(h2)[0, :4], model.logits(h3)[0]])
    assert (got - want).abs().max() / want.abs().max() < 1e-2


def test_an_int8_cache_is_refused_where_it_cannot_be_laid_out(tmp_path):
    with pytest.raises(ExportError, match="kv_cache_dtype must be one of float32, float16, bfloat16, int8"):
        ExportOptions(kv_cache_dtype="int4").validate(256)
    odd = make_tiny_checkpoint(seed=5, hidden_size=60, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ExportError, match="needs an even head_dim, the model's is 15"):
        export_model(odd, ExportOptions(kv_cache_dtype="int8", max_seq_len=64), tmp_path / "out")
