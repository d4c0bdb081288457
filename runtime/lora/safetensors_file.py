"""A .safetensors file's tensors as float32 numpy arrays, without torch (the server has none):
F32, F16 and BF16, the types PEFT saves adapters in."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
_MOST_HEADER_BYTES = 100 * 2**20


class SafetensorsError(ValueError):
    """A file that is not a readable safetensors file of float tensors."""


def read_float_tensors(path: Path) -> dict[str, np.ndarray]:
    data = Path(path).read_bytes()
    if len(data) < 8:
        raise SafetensorsError(f"{path} is too short to be a safetensors file")
    (header_bytes,) = struct.unpack("<Q", data[:8])
    if header_bytes > min(_MOST_HEADER_BYTES, len(data) - 8):
        raise SafetensorsError(f"{path}: its header length ({header_bytes} bytes) runs past the file")
    try:
        header = json.loads(data[8:8 + header_bytes])
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise SafetensorsError(f"{path}: its header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: its header is not a JSON object")
    body = memoryview(data)[8 + header_bytes:]
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = _DTYPES[entry["dtype"]], list(entry["shape"]), entry["data_offsets"]
        except KeyError:
            raise SafetensorsError(f"{path}: tensor {name} is {entry.get('dtype')!r}, not F32, F16 or BF16") from None
        except (TypeError, ValueError):
            raise SafetensorsError(f"{path}: tensor {name} has a malformed entry") from None
        count = int(np.prod(shape)) if shape else 1
        if not 0 <= begin <= end <= len(body) or end - begin != count * dtype.itemsize:
            raise SafetensorsError(f"{path}: tensor {name}'s bytes do not match its shape {shape}")
        raw = np.frombuffer(body[begin:end], dtype=dtype).reshape(shape)
        if entry["dtype"] == "BF16":  # the top half of a float32
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        tensors[name] = raw.astype(np.float32)
    return tensors
