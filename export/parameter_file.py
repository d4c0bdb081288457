"""The export's parameter archive, and the model's weights kept out of memory while it is built,
saved and traced.

Tracing reads only the shapes and types of the model's weights (torch.export fakes them), and a
weight once quantized is never changed, yet the model would hold every one in memory from the
moment it is made to the end of the trace: the parameters' size beside the build's own (5.7 GB at
8B, more than the file). `Spill` writes each weight to a scratch file as soon as it is made and
leaves a view of its bytes there in its place; the archive is then written from that file, and
the model pointed at the archive's own bytes for the trace. Pages of those files are the system's
to drop; the build's own memory is one weight and the traced graphs.
"""

from __future__ import annotations

import ctypes
import json
import os
import warnings
from pathlib import Path

import numpy as np
import torch
from iree.runtime import FileHandle, ParameterIndex
from iree.turbine import aot
from iree.turbine.aot.params import ParameterArchive
from iree.turbine.aot.tensor_traits import ExternalTensorTrait
from torch import nn

ALIGNMENT = 64  # each spilled tensor's first byte, so that any element type's view is aligned
EXTENT = "_kiln_spill_extent"  # a spilled tensor's (offset, bytes) in the scratch file
# How turbine's ParameterArchive reads an entry back as a tensor (its metadata's form).
_METADATA_PREFIX = "PYTORCH:"
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
                torch.int8: "int8", torch.int16: "int16", torch.int32: "int32", torch.int64: "int64",
                torch.uint8: "uint8", torch.bool: "bool", torch.float64: "float64"}


def _saved_tensors(model: nn.Module):
    """(module's store, name there, tensor) for each parameter and persistent buffer."""
    for module in model.modules():
        for name, tensor in list(module._parameters.items()):
            if tensor is not None:
                yield module._parameters, name, tensor
        for name, tensor in list(module._buffers.items()):
            if tensor is not None and name not in module._non_persistent_buffers_set:
                yield module._buffers, name, tensor


def _replace(model: nn.Module, make) -> None:
    """Put make(tensor) (None: keep it) in each saved tensor's place, keeping what is set on either
    (its archive name, its device, its extent in a spill) and a tensor held in several places (a
    tied output head) one tensor."""
    made: dict[int, torch.Tensor] = {}
    for store, name, tensor in _saved_tensors(model):
        if id(tensor) not in made:
            new = make(tensor)
            if new is None:
                made[id(tensor)] = tensor
                continue
            placed = nn.Parameter(new, requires_grad=False) if isinstance(tensor, nn.Parameter) else new
            for attribute, value in {**vars(tensor), **vars(new)}.items():
                setattr(placed, attribute, value)
            made[id(tensor)] = placed
        store[name] = made[id(tensor)]


def _readonly_view(path: Path, offset: int, like: torch.Tensor) -> torch.Tensor:
    """`like`'s shape and type over its bytes at `offset` in the file at `path`, mapped read-only."""
    mapped = np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(like.numel() * like.element_size(),))
    with warnings.catch_warnings():  # read-only: nothing writes a made weight
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(mapped).view(like.dtype).reshape(like.shape)


class Spill:
    """A scratch file that the model's weights move to as they are made (`spill(model)`), each
    replaced by a read-only view of its bytes there."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._file = open(self.path, "w+b")

    def spill(self, model: nn.Module) -> None:
        def move(tensor: torch.Tensor) -> torch.Tensor | None:
            if tensor.is_meta or hasattr(tensor, EXTENT) or tensor.numel() == 0:
                return None
            data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            offset = -self._file.tell() % ALIGNMENT + self._file.tell()
            self._file.seek(offset)
            self._file.write(memoryview(data))
            self._file.flush()
            view = _readonly_view(self.path, offset, tensor)
            setattr(view, EXTENT, (offset, data.nbytes))
            return view

        _replace(model, move)
        return_freed_memory()

    def close(self) -> None:
        self._file.close()


def return_freed_memory() -> None:
    """Hand memory freed in the heap back to the system (glibc's malloc_trim): decoding a GGUF's
    blocks a weight at a time leaves freed temporaries there (~0.9 GB at 1.5B) that glibc would
    otherwise keep to the end of the process. A no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _metadata(tensor: torch.Tensor) -> str:
    return _METADATA_PREFIX + json.dumps({"type": "Tensor", "dtype": _DTYPE_NAMES[tensor.dtype],
                                          "shape": list(tensor.shape)})


def save_parameters(model: nn.Module, path: Path, scope: str, spilled: Spill | None = None) -> None:
    """Write the model's parameters and persistent buffers to the archive at `path` under `scope`
    (spilled ones copied from the scratch file, file to file), then point the model's tensors at
    their bytes in the archive (`map_saved_tensors`)."""
    aot.externalize_module_parameters(model, external_scope=scope)
    index, scratch = ParameterIndex(), None
    kept = []  # the bytes of tensors not spilled, alive until the archive is written
    if spilled is not None:
        spilled.close()
        scratch = os.open(spilled.path, os.O_RDONLY)
        handle = FileHandle.wrap_fd(scratch)
    try:
        added: set[int] = set()
        for _, _, tensor in _saved_tensors(model):
            if id(tensor) in added:
                continue
            added.add(id(tensor))
            name = ExternalTensorTrait.get(tensor).external_name
            if spilled is not None and hasattr(tensor, EXTENT):
                offset, size = getattr(tensor, EXTENT)
                index.add_from_file_handle(name, handle, size, offset, _metadata(tensor))
            else:
                data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
                kept.append(data)
                index.add_buffer(name, data, metadata=_metadata(tensor))
        index.create_archive_file(str(path))
    finally:
        if scratch is not None:
            os.close(scratch)
    map_saved_tensors(model, path)
    if spilled is not None:
        spilled.path.unlink(missing_ok=True)


def map_saved_tensors(model: nn.Module, path: Path) -> None:
    """Replace each of the model's archived tensors with a read-only view of its bytes in the archive."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        saved = {key: entry.as_tensor() for key, entry in ParameterArchive(path).items()}

    def mapped(tensor: torch.Tensor) -> torch.Tensor | None:
        trait = ExternalTensorTrait.get(tensor)
        if trait is None:
            return None
        view = saved[trait.external_name]
        if view.shape != tensor.shape or view.dtype != tensor.dtype:
            raise RuntimeError(f"{trait.external_name} was saved as {view.dtype}{list(view.shape)}, the model "
                               f"holds {tensor.dtype}{list(tensor.shape)}")
        return view

    _replace(model, mapped)
