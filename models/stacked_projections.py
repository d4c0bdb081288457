"""Attention's Q, K and V projections stored as one weight, as the export writes them.

Decode multiplies x by the three weights at once (one matmul, two dispatches fewer a layer).
Concatenated in the traced graph, that weight is a constant expression IREE hoists into a
load-time copy for every function that traces it, or, unhoisted, a copy made on every call;
written as parameters of their own (weights, scales, offsets and biases concatenated along the
output features), the file holds it once and every function reads it there. Prefill multiplies
each projection's rows of it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .quantize import QuantizedLinear, same_blocks, unpack_nibbles, weight_product, widened


def _parameter(tensor: torch.Tensor, like: torch.Tensor) -> nn.Parameter:
    """A parameter placed where `like` is (a tensor/pipeline-parallel model's device trait)."""
    from iree.turbine.aot import DeviceTensorTrait

    parameter = nn.Parameter(tensor, requires_grad=False)
    device = DeviceTensorTrait.get(like)
    if device is not None:
        device.set(parameter)
    return parameter


class StackedLinear(nn.Module):
    """Linear layers over one input as one: float ones (nn.Linear) or quantized ones of one
    packing (QuantizedLinear), their tensors concatenated along N."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        first = layers[0]
        self.sizes = [layer.out_features for layer in layers]
        self.quantized = isinstance(first, QuantizedLinear)
        self.weight = _parameter(torch.cat([layer.weight for layer in layers]), first.weight)
        self.bias = None if first.bias is None else _parameter(torch.cat([layer.bias for layer in layers]), first.weight)
        self.scale = self.offset = None
        if self.quantized:
            self.matmul, self.packed = first.matmul, first.packed
            if first.scale is not None:
                # Row scales [N] and block scales and offsets [K / block, N] all run along N.
                self.scale = _parameter(torch.cat(same_blocks([layer.scale for layer in layers]), dim=-1), first.weight)
            if any(layer.offset is not None for layer in layers):  # a block type without offsets has zeros
                offsets = [torch.zeros_like(layer.scale) if layer.offset is None else layer.offset for layer in layers]
                self.offset = _parameter(torch.cat(same_blocks(offsets), dim=-1), first.weight)

    @staticmethod
    def stackable(layers: list[nn.Module]) -> bool:
        """Whether `layers` can be held as one: all float, or all quantized alike (4-bit values two
        a byte beside other blocks, a Q4_K q/k beside a Q6_K v, cannot share one weight)."""
        kinds = {type(layer) for layer in layers}
        if kinds == {nn.Linear}:
            return all((layer.bias is None) == (layers[0].bias is None) for layer in layers)
        if kinds != {QuantizedLinear}:
            return False
        first = layers[0]
        return all(layer.weight.dtype == first.weight.dtype and layer.packed == first.packed
                   and (layer.scale is None) == (first.scale is None)
                   and (layer.scale is None or layer.scale.dim() == first.scale.dim())
                   and (layer.bias is None) == (first.bias is None) for layer in layers)

    def tensors(self, rows: slice | None = None) -> tuple:
        """(weight, bias, scale, offset) of the stack, or of `rows` of it (one layer's output features)."""
        weight, bias, scale, offset = self.weight, self.bias, self.scale, self.offset
        if rows is None:
            return weight, bias, scale, offset
        return (weight[rows], None if bias is None else bias[rows],
                None if scale is None else scale[rows] if scale.dim() == 1 else scale[:, rows],
                None if offset is None else offset[:, rows])

    def product(self, x: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
        """x times the stacked weight, or `rows` of it."""
        weight, bias, scale, offset = self.tensors(rows)
        if not self.quantized:
            return F.linear(x, weight, bias)
        out = weight_product(x, weight, scale, self.matmul, offset, self.packed)
        return out if bias is None else out + bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x)


class StackedRows(nn.Module):
    """One layer of a StackedLinear: its output features' rows. The stack is its owner's module,
    held here outside the module tree so that its parameters are named (and written) once."""

    def __init__(self, stack: StackedLinear, index: int):
        super().__init__()
        self.__dict__["stack"] = stack
        self.index = index
        start = sum(stack.sizes[:index])
        self.rows = slice(start, start + stack.sizes[index])

    @property
    def out_features(self) -> int:
        return self.rows.stop - self.rows.start

    # The layer's own tensors, as views of the stack's, for what inspects a built model.
    @property
    def weight(self) -> torch.Tensor:
        return self.stack.tensors(self.rows)[0]

    @property
    def bias(self) -> torch.Tensor | None:
        return self.stack.tensors(self.rows)[1]

    @property
    def scale(self) -> torch.Tensor | None:
        return self.stack.tensors(self.rows)[2]

    @property
    def offset(self) -> torch.Tensor | None:
        return self.stack.tensors(self.rows)[3]

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this layer's rows stand for."""
        if not self.stack.quantized:
            return self.weight.float()
        values = unpack_nibbles(self.weight) if self.stack.packed else self.weight
        return widened(values, self.scale, self.offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stack.product(x, self.rows)


NAMES = ("q_proj", "k_proj", "v_proj")


def stack_attention_projections(model: nn.Module) -> int:
    """Hold every attention block's Q, K and V as one StackedLinear (`qkv_proj`), in place, where
    their storage allows; LoRA-wrapped projections keep their adapters around the stack's rows.
    Returns how many blocks were stacked."""
    from .llama import Attention

    stacked = 0
    for attention in [m for m in model.modules() if isinstance(m, Attention)]:
        layers = [getattr(attention, name) for name in NAMES]
        bases = [getattr(layer, "base", layer) for layer in layers]
        if not StackedLinear.stackable(bases):
            continue
        attention.qkv_proj = StackedLinear(bases)
        for index, (name, layer) in enumerate(zip(NAMES, layers)):
            rows = StackedRows(attention.qkv_proj, index)
            if layer is bases[index]:
                setattr(attention, name, rows)
            else:
                layer.base = rows
        stacked += 1
    return stacked
