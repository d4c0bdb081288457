"""A mixture's stacked experts stored narrow, as its dense weights are (models/quantize.py).

Experts hold most of a mixture's bytes (Qwen3-30B-A3B: 29 of its 30 B parameters), so experts kept
in float32 beside quantized attention would forfeit what quantizing is for: the model's size. Each
expert's [N, K] weight is held in the form QuantizedWeight gives a dense one (int8 rows, blocks with
their scales and offsets, 4-bit values two a byte), the E forms stacked on a leading axis; a GGUF's
own blocks are taken as stored. The graph widens them to float32 where it multiplies: a decode step
only the k experts each token chose (reading k experts' bytes a token, what bounds the step), a
prefill every expert. No hand-written kernel takes them: those take one weight for all their rows,
and here each row has weights of its own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .gguf_blocks import BlockWeight
from .quantize import stored_form, unpack_nibbles, widened

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class QuantizedExperts(nn.Module):
    """Stacked experts (gate, up [E, I, H]; down [E, H, I]) as stored forms: for each projection,
    values [E, N, K] ([E, N, K / 2] when `packed`), `<name>_scale` ([E, N] int8 rows, [E, K / block, N]
    blocks; None for bf16) and `<name>_offset` ([E, K / block, N] or None). The float module's
    `chosen` / `every` contract (models/llama.py's Experts), in float32."""

    def __init__(self, forms: dict[str, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, bool]]):
        super().__init__()
        self.packed = {}
        for name, (values, scale, offset, packed) in forms.items():
            self.register_parameter(name, nn.Parameter(values, requires_grad=False))
            for part, tensor in (("scale", scale), ("offset", offset)):
                self.register_parameter(f"{name}_{part}", None if tensor is None
                                        else nn.Parameter(tensor, requires_grad=False))
            self.packed[name] = packed

    def _widened(self, name: str, index) -> torch.Tensor:
        values, scale, offset = (getattr(self, f"{name}{part}") for part in ("", "_scale", "_offset"))
        if index is not None:
            values, scale, offset = (None if t is None else t[index] for t in (values, scale, offset))
        return widened(unpack_nibbles(values) if self.packed[name] else values, scale, offset)

    def chosen(self, name: str, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The experts `index` [M, k] picked of projection `name`, widened: [M, k, N, K]."""
        return self._widened(name, index).to(dtype)

    def every(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Every expert of projection `name`, widened: [E, N, K]."""
        return self._widened(name, None).to(dtype)


def quantize_experts(experts: nn.Module, mode: str, blocks_of: Callable[[str], BlockWeight | None],
                     load: Callable | None = None, prefix: str = "") -> QuantizedExperts:
    """`experts` (models/llama.py's Experts) stored as `mode` says, a projection at a time: where
    `blocks_of(name)` gives a GGUF's blocks of all E experts (rows expert by expert), they are taken
    as stored. `load(module, prefix, skip=...)`, for a model built on the meta device, makes the one
    float stack quantized next, which is let go once it is."""
    forms = {}
    for name in PROJECTIONS:
        blocks = blocks_of(name)
        if load is not None:
            load(experts, prefix, skip=tuple(p for p in PROJECTIONS if p != name or blocks is not None))
        stack = getattr(experts, name)
        count, rows = stack.shape[0], stack.shape[1]
        each = [stored_form(stack[j], mode, None if blocks is None else blocks.rows(j * rows, (j + 1) * rows),
                            pack=True) for j in range(count)]
        packed = {form[3] for form in each}
        assert len(packed) == 1, "the experts of one projection are stored alike"
        forms[name] = (*(None if each[0][i] is None else torch.stack([form[i] for form in each]) for i in range(3)),
                       packed.pop())
        experts._parameters[name] = nn.Parameter(torch.empty(stack.shape, device="meta"), requires_grad=False)
        del stack, each
    return QuantizedExperts(forms)
