"""Every slot's adapter weights, stacked as the compiled functions take them: per adapted module,
A [layers, slots + 1, max_rank, in] and Bᵀ [layers, slots + 1, max_rank, out] (slot 0 all zeros:
the base model; B transposed, so the kernel sums whole rows of it). An adapter of a lower rank is zero-padded, which adds nothing; a module it does not
adapt stays zero."""

from __future__ import annotations

import numpy as np

from .adapter import LoraAdapter, LoraShapes


class StackedLoraWeights:
    def __init__(self, shapes: LoraShapes, slots: int):
        self.shapes = shapes
        self.a = {m: np.zeros((shapes.layers, slots + 1, shapes.max_rank, fin), np.float32)
                  for m, (fin, _) in shapes.modules.items()}
        self.b = {m: np.zeros((shapes.layers, slots + 1, shapes.max_rank, fout), np.float32)
                  for m, (_, fout) in shapes.modules.items()}

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Slot `slot` holds `adapter` from now on (whatever it held before is gone)."""
        if slot < 1:
            raise ValueError("slot 0 is the base model's and stays zero")
        self.clear(slot)
        for (layer, module), (a, b) in adapter.weights.items():
            self.a[module][layer, slot, : a.shape[0]] = a
            self.b[module][layer, slot, : b.shape[1]] = b.T

    def clear(self, slot: int) -> None:
        for module in self.a:
            self.a[module][:, slot] = 0
            self.b[module][:, slot] = 0

    def delta(self, slot: int, layer: int, module: str, x: np.ndarray) -> np.ndarray:
        """What slot's adapter adds to `module`'s output for inputs x [..., in] (the reference the
        compiled functions are tested against)."""
        return (x @ self.a[module][layer, slot].T) @ self.b[module][layer, slot]
