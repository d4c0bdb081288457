"""The export's model built on the meta device and filled in a weight at a time (models/meta_load.py):
the same model as one loaded whole and then quantized, with a GGUF's kept blocks never dequantized
and no weight alive in float32 beside the others."""

from __future__ import annotations

from pathlib import Path

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


def resident_kib(path) -> int:
    """This process's resident KiB in its mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
            inside = len(fields) >= 6 and fields[5] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


def test_the_files_pages_are_let_go_once_each_weight_is_made(tmp_path):
    """The reader maps the whole file: pages read for a weight would stay resident to the end of the
    export, the file's size beside the model, unless dropped once the weight is made. (The kernel
    maps up to 64 KiB around each page read: the file has weights of MBs, as real ones are.)"""
    from gguf import GGUFReader

    from benchmarks import synthetic_gguf

    path = synthetic_gguf.write(tmp_path / "model.gguf", synthetic_gguf.SHAPES["tiny"], "Q4_0", log=lambda line: None)
    size_kib = path.stat().st_size // 1024
    checkpoint = load_checkpoint(path)
    for name in checkpoint.tensors:  # as the default export asks: the blocks where they are kept
        (checkpoint.blocks if name in checkpoint.blocks else checkpoint.tensors)[name]
    dropped = resident_kib(path)

    reader = GGUFReader(path)  # the same reads, nothing dropped: the measure sees the pages
    assert all(t.data.sum() >= 0 for t in reader.tensors)
    assert resident_kib(path) - dropped > size_kib * 3 // 4
    assert dropped < size_kib // 4
