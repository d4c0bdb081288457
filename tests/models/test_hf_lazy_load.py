"""A Hugging Face directory's safetensors read a tensor at a time, on request (models/hf_loader.py,
runtime/safetensors_file.py): an 8B bf16 checkpoint (16 GB) is never in memory whole, and what is
read equals what safetensors' own loader reads."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks import synthetic_gguf, synthetic_hf
from kiln.export.export_model import build_model
from kiln.export.options import ExportOptions
from kiln.export.weight_matmul import weight_matmul_kernel
from kiln.models.lazy_arrays import LazyArrays
from kiln.models.llama import PagedLlama
from kiln.models.loader import load_checkpoint
from kiln.models.quantize import quantize_model
from kiln.runtime.errors import ModelLoadError
from kiln.runtime.safetensors_file import read_header, read_tensor
from tests.export.test_streamed_load import reference_logits, resident_kib


@pytest.fixture(scope="module")
def synthetic_directory(tmp_path_factory):
    """The tiny shapes as a bf16 checkpoint in three shards."""
    shapes = synthetic_gguf.SHAPES["tiny"]
    return synthetic_hf.write(tmp_path_factory.mktemp("hf") / "tiny-bf16", shapes, shard_gib=0.01,
                              log=lambda line: None)


def test_a_synthetic_directory_loads_with_its_shapes_every_value_as_safetensors_reads_it(synthetic_directory):
    shapes = synthetic_gguf.SHAPES["tiny"]
    shards = sorted(synthetic_directory.glob("model-*.safetensors"))
    assert len(shards) == 3
    checkpoint = load_checkpoint(synthetic_directory)
    c = checkpoint.config
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.vocab_size) == (
        shapes.layers, shapes.hidden, shapes.intermediate, shapes.vocab)
    assert c.rope_scaling["rope_type"] == "llama3" and checkpoint.stored_quantization == "bf16"
    assert isinstance(checkpoint.tensors, LazyArrays)
    expected = {}
    for shard in shards:
        expected |= {name: t.float().numpy() for name, t in load_file(str(shard)).items()}
    assert set(checkpoint.tensors) == set(expected)
    for name, values in expected.items():
        assert checkpoint.tensors.shape(name) == values.shape
        got = checkpoint.tensors[name]
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, values)
    up = checkpoint.tensors["model.layers.1.mlp.up_proj.weight"]
    assert np.std(up) == pytest.approx(synthetic_gguf.WEIGHT_STD, rel=0.05)


def test_loading_reads_no_values_and_reading_one_keeps_none_of_the_file_mapped(synthetic_directory, tmp_path):
    """A tensor's bytes are read when it is asked for (here changed after the load, and read as
    changed), and its file's pages are not left mapped once it is made."""
    import shutil

    directory = tmp_path / "copy"
    shutil.copytree(synthetic_directory, directory)
    checkpoint = load_checkpoint(directory)
    index = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.0.self_attn.q_proj.weight"
    shard = directory / index[name]
    stored = read_header(shard)[name]
    with open(shard, "r+b") as file:  # the tensor's first value becomes 2.0 (bf16 0x4000)
        file.seek(stored.begin)
        file.write(np.array([0x4000], np.uint16).tobytes())
    assert checkpoint.tensors[name][0, 0] == 2.0
    embedding = checkpoint.tensors["model.embed_tokens.weight"]
    assert embedding.shape == (synthetic_gguf.SHAPES["tiny"].vocab, synthetic_gguf.SHAPES["tiny"].hidden)
    assert all(resident_kib(path) == 0 for path in directory.glob("*.safetensors"))


def test_a_streamed_export_of_the_directory_keeps_its_bf16_weights_as_the_model_loaded_whole(synthetic_directory):
    checkpoint = load_checkpoint(synthetic_directory)
    options = ExportOptions().validate(256, checkpoint.stored_quantization)
    assert options.quantize == "bf16"  # `auto`: the checkpoint's own precision
    streamed = build_model(checkpoint, options)
    whole = PagedLlama(checkpoint.config).load_tensors(dict(checkpoint.tensors))
    whole = quantize_model(whole, "bf16", weight_matmul_kernel).eval()
    assert not any(p.is_meta for p in streamed.parameters())
    np.testing.assert_array_equal(reference_logits(streamed), reference_logits(whole))


@pytest.mark.parametrize("dtype,kind", [(torch.float16, "F16"), (torch.float32, "F32"), (torch.int64, "I64")])
def test_other_types_read_as_safetensors_reads_them(tmp_path, dtype, kind):
    values = (torch.arange(24).reshape(2, 3, 4) * 3 - 7).to(dtype)
    save_file({"x": values, "scalar": torch.tensor(5, dtype=dtype)}, str(tmp_path / "t.safetensors"))
    header = read_header(tmp_path / "t.safetensors")
    assert header["x"].dtype == kind and header["x"].shape == (2, 3, 4)
    got = read_tensor(tmp_path / "t.safetensors", header["x"])
    np.testing.assert_array_equal(got, values.numpy().astype(np.float32 if dtype.is_floating_point else np.int64))
    assert read_tensor(tmp_path / "t.safetensors", header["scalar"]).shape == ()


def test_a_file_whose_tensor_runs_past_its_end_is_refused_at_load(synthetic_directory, tmp_path):
    import shutil

    directory = tmp_path / "cut"
    shutil.copytree(synthetic_directory, directory)
    shard = max(directory.glob("model-*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-4096])
    with pytest.raises(ModelLoadError, match="not a readable safetensors file.*do not match its shape"):
        load_checkpoint(directory)


def test_each_weight_made_in_float32_is_let_go_before_the_next_is_made(synthetic_directory, tmp_path, monkeypatch):
    """A weight is made in float32 from the file, stored (here as bf16) and spilled: its float32
    form is let go before the next weight is made. Held to the end of the build, an 8B checkpoint's
    would be 32 GB."""
    import weakref

    from torch import nn

    from kiln.export.parameter_file import Spill
    from kiln.models import meta_load

    made, alive = [], []
    materialize = meta_load.materialize

    def recording(module, prefix, tensors, dtype, skip=()):
        alive.append(sum(ref() is not None for ref in made))
        before = {name for name, p in module.named_parameters(recurse=False) if p.is_meta}
        materialize(module, prefix, tensors, dtype, skip)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            made.extend(weakref.ref(p) for name, p in module.named_parameters(recurse=False) if name in before)

    monkeypatch.setattr(meta_load, "materialize", recording)
    spill = Spill(tmp_path / "weights.spill")
    build_model(load_checkpoint(synthetic_directory), ExportOptions().validate(256, "bf16"), spill)
    spill.close()
    assert len(made) == 2 + 7 * synthetic_gguf.SHAPES["tiny"].layers  # the embedding, the head, 7 a layer
    assert max(alive) == 0
