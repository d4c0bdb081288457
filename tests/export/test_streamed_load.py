"""The export's model built on the meta device and filled in a weight at a time (models/meta_load.py):
the same model as one loaded whole and then quantized, with a GGUF's kept blocks never dequantized
and no weight alive in float32 beside the others."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.models import gguf_loader
from kiln.export.export_model import build_model
from kiln.export.options import ExportOptions
from kiln.export.weight_matmul import weight_matmul_kernel
from kiln.models.lazy_arrays import LazyArrays
from kiln.models.llama import PagedLlama
from kiln.models.loader import load_checkpoint
from kiln.models.quantize import quantize_model

TOKENS = torch.tensor([[5, 9, 200, 31, 7, 3, 1, 4]])


def reference_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model.forward_reference(TOKENS).numpy()


@pytest.mark.parametrize("quantize", ["gguf", "q8_0", "none"])
def test_a_streamed_model_is_the_one_loaded_whole(tiny_q4_1_gguf, quantize):
    checkpoint = load_checkpoint(tiny_q4_1_gguf)
    assert isinstance(checkpoint.tensors, LazyArrays) and isinstance(checkpoint.blocks, LazyArrays)
    streamed = build_model(checkpoint, ExportOptions(quantize=quantize).validate(256, "q4_1"))
    whole = PagedLlama(checkpoint.config).load_tensors(dict(checkpoint.tensors))
    whole = quantize_model(whole, quantize, weight_matmul_kernel, dict(checkpoint.blocks)).eval()
    assert not any(p.is_meta for p in streamed.parameters())
    np.testing.assert_array_equal(reference_logits(streamed), reference_logits(whole))


def test_a_weight_served_from_its_blocks_is_never_dequantized(tiny_q4_1_gguf, monkeypatch):
    made = []
    dequantize = gguf_loader._dequantize
    monkeypatch.setattr(gguf_loader, "_dequantize", lambda tensor: made.append(tensor.name) or dequantize(tensor))
    checkpoint = load_checkpoint(tiny_q4_1_gguf)
    assert made == []  # loading reads shapes and metadata, no values
    build_model(checkpoint, ExportOptions(quantize="gguf").validate(256, "q4_1"))
    two_d = {name for name in made if name.endswith(("attn_q.weight", "ffn_up.weight", "token_embd.weight"))}
    assert not two_d, f"kept blocks dequantized: {sorted(two_d)}"
    assert "blk.0.attn_norm.weight" in made  # the norms, float32, are made once each
    assert len(made) == len(set(made))


def test_a_type_no_dequantizer_knows_is_refused_when_the_file_is_read(tiny_gguf, tmp_path, monkeypatch):
    """Values are made at export, but a type that cannot become values is refused at load: here F16,
    with gguf-py's dequantizer made to know none (as it knows no Q8_1)."""
    from gguf import quants

    from kiln.models.gguf_writer import write_gguf
    from kiln.runtime.errors import ModelLoadError

    f16 = write_gguf(load_checkpoint(tiny_gguf), tmp_path / "f16.gguf", dtype="f16")

    def knows_none(raw, qtype):
        raise NotImplementedError(f"no dequantizer for {qtype.name}")

    monkeypatch.setattr(quants, "dequantize", knows_none)
    with pytest.raises(ModelLoadError, match="GGUF type F16 cannot be dequantized"):
        load_checkpoint(f16)


def test_a_truncated_tensor_is_refused_when_the_file_is_read(tiny_q4_1_gguf, tmp_path):
    from kiln.runtime.errors import ModelLoadError

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_q4_1_gguf.read_bytes()[:-4096])
    with pytest.raises(ModelLoadError, match="corrupt or truncated|not a readable GGUF"):
        load_checkpoint(cut)
