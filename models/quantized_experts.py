"""A mixture's stacked experts stored narrow, as its dense weights are (models/quantize.py).

Experts hold most of a mixture's bytes (Qwen3-30B-A3B: 29 of its 30 B parameters), so experts kept
in float32 beside quantized attention would forfeit what quantizing is for: the model's size. Each
expert's [N, K] weight is held in the form QuantizedWeight gives a dense one (int8 rows, blocks with
their scales and offsets, 4-bit values two a byte), the E forms stacked on a leading axis; a GGUF's
own blocks are taken as stored. Where the model is given a kernel that takes the experts in place
(`matmul.experts_blocks`, the CPU kernels'), every token goes through it, a decode step's and a
prefill's: its input quantized per block of 32, as a dense weight's in a decode step, times its k
chosen experts read where they lie, nothing widened and no expert multiplied that the token did
not choose. The kernel takes the forms the one-row kernels
take (4-bit blocks, int8 blocks of 32 with or without offsets, Q6_K's halves of 16, int8 rows);
where a projection's experts are of another (bf16), or no such kernel is given (GPU builds), the
graph widens them to float32 where it multiplies: a decode step only the k experts each token
chose (reading k experts' bytes a token, what bounds the step), a prefill every expert.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .gguf_blocks import BlockWeight
from .quantize import BLOCK, blocks_of_input, eager_weight_matmul, stored_form, unpack_nibbles, widened

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class QuantizedExperts(nn.Module):
    """Stacked experts (gate, up [E, I, H]; down [E, H, I]) as stored forms: for each projection,
    values [E, N, K] ([E, N, K / 2] when `packed`), `<name>_scale` ([E, N] int8 rows, [E, K / block, N]
    blocks; None for bf16) and `<name>_offset` ([E, K / block, N] or None). The float module's
    `chosen` / `every` contract (models/llama.py's Experts), in float32."""

    def __init__(self, forms: dict[str, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, bool]],
                 in_place=None):
        super().__init__()
        self.packed, self.in_place = {}, in_place
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

    def _kernel_form(self, name: str) -> dict | None:
        """How the in-place kernel takes projection `name`'s experts (its keyword arguments), or
        None where it does not: the forms a dense weight's one-token product takes the block
        kernels for (models/quantize.py's `weight_product`)."""
        values, scale, offset = (getattr(self, f"{name}{part}") for part in ("", "_scale", "_offset"))
        k = values.shape[-1] * (2 if self.packed[name] else 1)
        if scale is None or k % BLOCK:
            return None
        if self.packed[name]:
            return {"packed": True}
        if scale.dim() == 2:  # int8 rows: each block takes its row's scale
            return {}
        group = k // scale.shape[-2]
        if group == BLOCK:
            return {}
        return {"half_blocks": True} if group == BLOCK // 2 and offset is None else None

    @property
    def reads_in_place(self) -> bool:
        """Whether `chosen_product` runs: a kernel takes every projection's experts where they lie."""
        return self.in_place is not None and all(self._kernel_form(name) is not None for name in self.packed)

    def chosen_product(self, name: str, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """x times the experts `chosen` [M, k] picked of projection `name`, read where they lie
        (where `reads_in_place`): float32 [M, k, N]. x is [M, K] (each row times its k experts) or
        [M, k, K] (one row for each choice)."""
        tokens, k = chosen.shape
        rows = x.reshape(-1, x.shape[-1])
        row_of = torch.arange(rows.shape[0]).view(tokens, -1).expand(tokens, k)
        pairs = torch.stack((chosen.reshape(-1), row_of.reshape(-1)), dim=-1)
        q, scale, sums = blocks_of_input(rows)
        values, w_scale, w_offset = (getattr(self, f"{name}{part}") for part in ("", "_scale", "_offset"))
        out = self.in_place(q, scale, values, w_scale, None if w_offset is None else sums, w_offset, pairs=pairs,
                            **self._kernel_form(name))
        # A prefill's pair count is dynamic, and a kernel's result size is the tracer's unknown:
        # it is the pairs' own.
        torch._check(out.shape[0] == pairs.shape[0])
        return out.view(tokens, k, -1)


def quantize_experts(experts: nn.Module, mode: str, blocks_of: Callable[[str], BlockWeight | None],
                     load: Callable | None = None, prefix: str = "", matmul=eager_weight_matmul) -> QuantizedExperts:
    """`experts` (models/llama.py's Experts) stored as `mode` says, a projection at a time: where
    `blocks_of(name)` gives a GGUF's blocks of all E experts (rows expert by expert), they are taken
    as stored. `load(module, prefix, skip=...)`, for a model built on the meta device, makes the one
    float stack quantized next, which is let go once it is. `matmul.experts_blocks`, where the
    model's kernel offers it, takes the experts in place."""
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
    return QuantizedExperts(forms, getattr(matmul, "experts_blocks", None))
