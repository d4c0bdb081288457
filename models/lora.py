"""LoRA adapters applied per row inside the compiled functions (punica's and S-LoRA's batched
LoRA): each adapted linear layer adds (x · A[slot]ᵀ) · B[slot]ᵀ to its output, where `slot` is
the row's adapter slot and A, B the stacked weights of every slot (runtime/lora/weights.py's
layout: A [layers, slots + 1, rank, in], Bᵀ [layers, slots + 1, rank, out], slot 0 zeros).

The slots and the stacked weights are the functions' arguments, not parameters, so an adapter is
loaded by writing its slot: no recompile. `attach_lora` wraps a built model's target layers (after
quantization: the delta runs in float32 beside whatever the base layer stores) around one shared
`LoraInputs`, which each traced function binds to its arguments before running the model. An
export with the CPU kernels gives the layers a kernel reading each row's slot in place
(export/lora_kernel.py); the model's own form gathers every row's weights.
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


def gathered_delta(x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [N, T, in] -> float32 [N, T, out]: each row through its slot's A [slots, rank, in] then
    Bᵀ [slots, rank, out], the rows' weights gathered out of the stacks."""
    low = torch.matmul(x.float(), a[slots].transpose(1, 2))  # [N, T, r]
    return torch.matmul(low, b_t[slots])


class LoraLinear(nn.Module):
    """`base` (a linear layer of any storage) plus its row's adapter's delta; `delta_kernel`, when
    given, computes it from the stacked weights whole (export/lora_kernel.py's contract)."""

    def __init__(self, base: nn.Module, inputs: LoraInputs, layer: int, module: str, delta_kernel=None):
        super().__init__()
        self.base = base
        self.inputs = inputs
        self.layer = layer
        self.module = module
        self.delta_kernel = delta_kernel

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, T, in] -> [N, T, out]: each row through its slot's A then B."""
        a, b_t = self.inputs.weights[self.module]
        if self.delta_kernel is not None:
            return self.delta_kernel(x.float(), a, b_t, self.inputs.slots, self.layer).to(x.dtype)
        return gathered_delta(x, a[self.layer], b_t[self.layer], self.inputs.slots).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.delta(x)

    @property
    def out_features(self) -> int:
        return self.base.out_features


def attach_lora(model: nn.Module, modules: tuple[str, ...], delta_kernel=None) -> LoraInputs:
    """Wrap each decoder layer's `modules` (of TARGET_MODULES) in a LoraLinear (computing its
    delta through `delta_kernel` where given), in place; the inputs they share, for the traced
    functions to bind."""
    inputs = LoraInputs(tuple(modules))
    for index, layer in enumerate(model.model.layers):
        for block in (layer.self_attn, layer.mlp):
            for name in modules:
                base = getattr(block, name, None)
                if base is not None:
                    setattr(block, name, LoraLinear(base, inputs, index, name, delta_kernel))
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
    """Zero tensors of the stacked weights' shapes, A then Bᵀ per module: the traced examples."""
    out = []
    for fin, fout in lora_shapes(config, modules).values():
        out += [torch.zeros(config.num_hidden_layers, slots + 1, rank, fin),
                torch.zeros(config.num_hidden_layers, slots + 1, rank, fout)]
    return out
