"""A .safetensors file read without torch (the server has none): its header alone, then any one
tensor on request, so a checkpoint larger than memory is read a weight at a time.

Float tensors (F32, F16, BF16) come back as float32; integer and bool tensors as stored.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_FLOATS = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"), "F64": np.dtype("<f8")}
_OTHERS = {"I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
           "U8": np.dtype("u1"), "BOOL": np.dtype("?")}
_MOST_HEADER_BYTES = 100 * 2**20


class SafetensorsError(ValueError):
    """A file that is not a readable safetensors file."""


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor lies in its file: its type's name as the header gives it, its shape, and
    its bytes' offsets from the file's start."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def is_float(self) -> bool:
        return self.dtype in _FLOATS


def read_header(path: Path) -> dict[str, StoredTensor]:
    """Every tensor of the file by name, each checked to lie within the file at its shape's size;
    nothing of the tensors' bytes is read."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as file:
        head = file.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path} is too short to be a safetensors file")
        (header_bytes,) = struct.unpack("<Q", head)
        if header_bytes > min(_MOST_HEADER_BYTES, size - 8):
            raise SafetensorsError(f"{path}: its header length ({header_bytes} bytes) runs past the file")
        text = file.read(header_bytes)
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise SafetensorsError(f"{path}: its header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: its header is not a JSON object")
    body, body_bytes = 8 + header_bytes, size - 8 - header_bytes
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            kind, shape, (begin, end) = entry["dtype"], tuple(int(n) for n in entry["shape"]), entry["data_offsets"]
            dtype = (_FLOATS | _OTHERS)[kind]
        except KeyError:
            raise SafetensorsError(f"{path}: tensor {name} has a type Kiln does not read ({entry.get('dtype')!r})") \
                from None
        except (TypeError, ValueError, AttributeError):
            raise SafetensorsError(f"{path}: tensor {name} has a malformed entry") from None
        count = int(np.prod(shape)) if shape else 1
        if (not isinstance(begin, int) or not isinstance(end, int) or not 0 <= begin <= end <= body_bytes
                or end - begin != count * dtype.itemsize or min(shape, default=0) < 0):
            raise SafetensorsError(f"{path}: tensor {name}'s bytes do not match its shape {list(shape)}")
        tensors[name] = StoredTensor(kind, shape, body + begin, body + end)
    return tensors


def read_tensor(path: Path, stored: StoredTensor) -> np.ndarray:
    """One tensor from its file: a float one as float32 (made in place from the mapped bytes: no
    copy of the file's tensor is kept beside it), any other as stored."""
    dtype = (_FLOATS | _OTHERS)[stored.dtype]
    if stored.end == stored.begin:
        return np.zeros(stored.shape, np.float32 if stored.is_float else dtype)
    count = (stored.end - stored.begin) // dtype.itemsize
    raw = np.memmap(path, dtype=dtype, mode="r", offset=stored.begin, shape=(count,))
    if stored.dtype == "BF16":  # the top half of a float32, little-endian
        out = np.zeros(count, np.float32)
        out.view(np.uint16).reshape(count, 2)[:, 1] = raw
    else:
        out = np.array(raw, dtype=np.float32 if stored.is_float else dtype)
    return out.reshape(stored.shape)


def read_float_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a file of float tensors (F32, F16, BF16: the types PEFT saves adapters in),
    as float32."""
    header = read_header(path)
    for name, stored in header.items():
        if stored.dtype not in ("F32", "F16", "BF16"):
            raise SafetensorsError(f"{path}: tensor {name} is {stored.dtype!r}, not F32, F16 or BF16")
    return {name: read_tensor(path, stored) for name, stored in header.items()}
