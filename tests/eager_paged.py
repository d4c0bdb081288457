"""An eager model's paged forward driven one call at a time, as the compiled functions run it."""

from __future__ import annotations

import numpy as np
import torch


class EagerSequence:
    """One sequence through the eager model's paged forward, call for call as the compiled
    functions run it: a prefill of several tokens widens the weights, a decode step of one
    token (and prefill_last's output head over one position) takes them narrow."""

    def __init__(self, model, pages: int = 8, cache_dtype=torch.float32):
        self.model, self.length = model, 0
        self.cache = model.allocate_cache(pages + 1, cache_dtype)
        self.table = torch.arange(1, pages + 1).view(1, -1)

    def _forward(self, tokens: list[int]) -> torch.Tensor:
        start, self.length = self.length, self.length + len(tokens)
        return self.model.forward_paged(torch.tensor([tokens]), torch.tensor([start]), torch.tensor([self.length]),
                                        self.table, self.cache)

    def run(self, tokens: list[int]) -> np.ndarray:
        """Every new position's logits [T, V]."""
        with torch.no_grad():
            return self.model.logits(self._forward(tokens))[0].numpy()

    def run_last(self, tokens: list[int]) -> np.ndarray:
        """The last new position's logits [V], as prefill_last computes them."""
        with torch.no_grad():
            return self.model.logits(self._forward(tokens)[:, -1:])[0, 0].numpy()
