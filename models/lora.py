"""LoRA adapters applied per row inside the compiled functions (punica's and S-LoRA's batched
LoRA): each adapted linear layer adds (x · A[slot]ᵀ) · B[slot]ᵀ to its output, where `slot` is
the row's adapter slot and A, B the stacked weights of every slot (runtime/lora/weights.py's
layout: A [layers, slots + 1, rank, in], B [layers, slots + 1, out, rank], slot 0 zeros).

The slots and the stacked weights are the functions' arguments, not parameters, so an adapter is
loaded by writing its slot: no recompile. `attach_lora` wraps a built model's target layers (after
quantization: the delta runs in float32 beside whatever the base layer stores) around one shared
`LoraInputs`, which each traced function binds to its arguments before running the model.
"""

from __future__ import annotations

import torch
from torch import nn

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraInputs:
    """What one call's adapted layers read: each row's slot [N] and, per module, (A, B)."""

    def __init__(self, modules: tuple[str, ...]):
        self.modules = modules
        self.slots: torch.Tensor | None = None
        self.weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def bind(self, slots: torch.Tensor, stacked: list[torch.Tensor]) -> None:
        """`stacked`: A then B for each module, in `modules`' order (the functions' argument order)."""
        self.slots = slots
        self.weights = {m: (stacked[2 * i], stacked[2 * i + 1]) for i, m in enumerate(self.modules)}


class LoraLinear(nn.Module):
    """`base` (a linear layer of any storage) plus its row's adapter's delta."""

    def __init__(self, base: nn.Module, inputs: LoraInputs, layer: int, module: str):
        super().__init__()
        self.base = base
        self.inputs = inputs
        self.layer = layer
        self.module = module

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, T, in] -> [N, T, out]: each row through its slot's A then B."""
        a, b = self.inputs.weights[self.module]
        slots = self.inputs.slots
        a_rows, b_rows = a[self.layer][slots], b[self.layer][slots]  # [N, r, in], [N, out, r]
        low = torch.matmul(x.float(), a_rows.transpose(1, 2))  # [N, T, r]
        return torch.matmul(low, b_rows.transpose(1, 2)).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.delta(x)

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight


def attach_lora(model: nn.Module, modules: tuple[str, ...]) -> LoraInputs:
    """Wrap each decoder layer's `modules` (of TARGET_MODULES) in a LoraLinear, in place; the
    inputs they share, for the traced functions to bind."""
    inputs = LoraInputs(tuple(modules))
    for index, layer in enumerate(model.model.layers):
        for block in (layer.self_attn, layer.mlp):
            for name in modules:
                base = getattr(block, name, None)
                if base is not None:
                    setattr(block, name, LoraLinear(base, inputs, index, name))
    return inputs


def lora_shapes(config, modules: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """Each module's (in, out) features in a model of `config`."""
    c = config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    every = {"q_proj": (c.hidden_size, q), "k_proj": (c.hidden_size, kv), "v_proj": (c.hidden_size, kv),
             "o_proj": (q, c.hidden_size), "gate_proj": (c.hidden_size, c.intermediate_size),
             "up_proj": (c.hidden_size, c.intermediate_size), "down_proj": (c.intermediate_size, c.hidden_size)}
    return {m: every[m] for m in modules}


def stacked_lora_examples(config, modules: tuple[str, ...], slots: int, rank: int) -> list[torch.Tensor]:
    """Zero tensors of the stacked weights' shapes, A then B per module: the traced examples."""
    out = []
    for fin, fout in lora_shapes(config, modules).values():
        out += [torch.zeros(config.num_hidden_layers, slots + 1, rank, fin),
                torch.zeros(config.num_hidden_layers, slots + 1, fout, rank)]
    return out
