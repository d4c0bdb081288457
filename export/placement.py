"""Where a multi-device module puts things, read back from its MLIR (the export writes the
placement as affinities on arguments and parameter globals: runtime/device_layout.py)."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np

# A device's symbol, in text (`@__device_1`) or in bytecode, whose string table holds it without the `@`.
_DEVICE = re.compile(r'__device_(\d+)')
_PARAMETER_GLOBAL = re.compile(
    r'util\.global private @\S+(?: \{stream\.affinity = #hal\.device\.promise<@"?__device_(\d+)"?>\})?'
    r' = #flow\.parameter\.named<[^>]*> : tensor<([^>]*)>')
_ELEMENT_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "i64": 8, "i32": 4, "i8": 1}


def device_count(module_text: str) -> int:
    """How many logical devices a module places work on: 1 + the highest `__device_N` it names
    (its text, or its bytecode read as Latin-1)."""
    return max((int(n) for n in _DEVICE.findall(module_text)), default=0) + 1


def parameter_bytes_by_device(module_text: str) -> dict[int, int]:
    """The bytes of the parameters each device loads (a global with no affinity is device 0's)."""
    totals: Counter[int] = Counter()
    for device, tensor_type in _PARAMETER_GLOBAL.findall(module_text):
        *dims, element = tensor_type.split("x")
        totals[int(device or 0)] += int(np.prod([int(d) for d in dims])) * _ELEMENT_BYTES[element]
    return dict(totals)
