"""The export's model pointed at its parameter archive once written (export/parameter_file.py):
the trace reads the archive's mapped bytes, not a copy of every weight held in memory."""

from __future__ import annotations

from pathlib import Path

import torch
from iree.turbine.aot import DeviceTensorTrait
from iree.turbine.aot.tensor_traits import ExternalTensorTrait
from torch import nn

from kiln.export.parameter_file import save_parameters


def mapped_from(path) -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of `path` (/proc/self/maps)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5] == str(path):
            start, end = (int(a, 16) for a in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.head = nn.Linear(8, 32, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.Linear(8, 8)
        self.register_buffer("scale", torch.arange(8, dtype=torch.int8))
        self.register_buffer("table", torch.ones(4), persistent=False)  # a constant of the trace, not archived


def test_saved_tensors_become_views_of_the_archive(tmp_path):
    torch.manual_seed(0)
    model = Tied()
    expected = {name: t.detach().clone() for name, t in model.state_dict().items()}
    DeviceTensorTrait(1).set(model.norm.weight)
    table = model.table
    save_parameters(model, tmp_path / "model.irpa", "model")

    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0)
    archive = mapped_from(tmp_path / "model.irpa")
    for tensor in (model.embed.weight, model.norm.weight, model.norm.bias, model.scale):
        assert any(start <= tensor.data_ptr() < end for start, end in archive)
        assert ExternalTensorTrait.get(tensor).external_scope == "model"
    assert isinstance(model.norm.weight, nn.Parameter)
    assert ExternalTensorTrait.get(model.scale).external_name == "scale"
    assert model.head.weight is model.embed.weight  # still one tensor, archived once
    assert DeviceTensorTrait.get(model.norm.weight).ordinal == 1  # its device kept
    assert model.table is table


def test_weights_spilled_as_made_are_archived_as_turbine_archives_them(tmp_path):
    """A weight moved to the scratch file when made is held there, not in memory; the archive
    written from it holds what turbine's own save writes from the model in memory."""
    from iree.turbine import aot
    from iree.turbine.aot.params import ParameterArchive

    from kiln.export.parameter_file import Spill

    torch.manual_seed(0)
    reference = Tied()
    aot.externalize_module_parameters(reference, external_scope="model")
    aot.save_module_parameters(tmp_path / "reference.irpa", reference)

    model = Tied()
    model.load_state_dict(reference.state_dict())
    spill = Spill(tmp_path / "weights.spill")
    spill.spill(model)
    scratch = mapped_from(tmp_path / "weights.spill")
    assert all(any(start <= t.data_ptr() < end for start, end in scratch) for t in model.state_dict().values())
    model.norm.bias = nn.Parameter(torch.full((8,), 3.0))  # made after the spill: archived from memory
    reference.norm.bias.data.fill_(3.0)
    aot.save_module_parameters(tmp_path / "reference.irpa", reference)
    save_parameters(model, tmp_path / "model.irpa", "model", spill)

    def entries(path):
        return {key: (entry.as_flat_tensor().numpy().tobytes(), entry.as_tensor().dtype, entry.as_tensor().shape)
                for key, entry in ParameterArchive(path).items()}

    # turbine writes a tied tensor under each of its names; the traced model asks for it by one
    assert ExternalTensorTrait.get(model.embed.weight).external_name == "head.weight"
    theirs = entries(tmp_path / "reference.irpa")
    assert entries(tmp_path / "model.irpa") == {key: entry for key, entry in theirs.items() if key != "embed.weight"}
    assert not (tmp_path / "weights.spill").exists()
    archive = mapped_from(tmp_path / "model.irpa")
    assert all(any(start <= t.data_ptr() < end for start, end in archive) for t in model.state_dict().values())
