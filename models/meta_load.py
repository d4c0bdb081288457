"""A model built on the meta device and filled in from a checkpoint one weight at a time.

Built as usual, a model holds every weight in float32 before any is quantized: 6 GB for a 1.5B
model, 32 GB at 8B, on a machine that may have neither. Built on the meta device, it holds
nothing; each weight is then made (models/lazy_arrays.py) and placed as its module is quantized
(models/quantize.py's `load`), so one float32 weight is alive at a time, and a weight kept in its
file's own blocks is never made in float32 at all.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch
from torch import nn

from .lazy_arrays import shape_of


def check_names(model: nn.Module, tensors: Mapping, optional: tuple[str, ...] = ()) -> None:
    """ValueError unless the checkpoint names exactly the model's parameters (`optional` ones may
    be in the checkpoint without a parameter: a tied output head)."""
    wanted = {name for name, _ in model.named_parameters()}
    given = set(tensors) - (set(optional) - wanted)
    missing, unexpected = sorted(wanted - given), sorted(given - wanted)
    if missing or unexpected:
        raise ValueError(f"weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def materialize(module: nn.Module, prefix: str, tensors: Mapping, dtype: torch.dtype,
                skip: tuple[str, ...] = ()) -> None:
    """Make `module`'s own parameters still on the meta device (not its children's, not those
    named in `skip`) from tensors[prefix + name], as `dtype`."""
    for name, parameter in list(module.named_parameters(recurse=False)):
        if not parameter.is_meta or name in skip:
            continue
        full = prefix + name
        if tuple(shape_of(tensors, full)) != tuple(parameter.shape):
            raise ValueError(f"{full} has shape {tuple(shape_of(tensors, full))}, the model's is {tuple(parameter.shape)}")
        value = torch.from_numpy(np.ascontiguousarray(tensors[full])).to(dtype)
        module._parameters[name] = nn.Parameter(value, requires_grad=parameter.requires_grad)


def load_streamed(build: Callable[[], nn.Module], tensors: Mapping, dtype: torch.dtype,
                  place: Callable[[nn.Module, Callable], nn.Module], optional: tuple[str, ...] = (),
                  spill: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """The model `build` makes, built on the meta device, its weights from `tensors` as `dtype`.
    `place(model, load)` replaces modules as it goes (quantizes them), calling
    `load(module, prefix, skip=names)` first for each, which makes its parameters but those named in
    `skip`; what it leaves on the meta device is made after it. `spill(model)`, if given, is
    called before each weight is made and at the end, so that what is made can leave memory as the
    model grows (export/parameter_file.py)."""
    with torch.device("meta"):
        model = build()
    check_names(model, tensors, optional)

    def load(module: nn.Module, prefix: str, skip: tuple[str, ...] = ()) -> None:
        if spill is not None:
            spill(model)
        materialize(module, prefix, tensors, dtype, skip=skip)

    model = place(model, load)
    for path, module in model.named_modules():
        materialize(module, f"{path}." if path else "", tensors, dtype)
    if spill is not None:
        spill(model)
    return model
