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


def check_call_for_call(program, reference, prompts: list[list[int]], tolerance: float,
                        decode_batches=(4, 4, 4, 4)):
    """Prefill `prompts` in one batch of 4 (a padded row where fewer) through the compiled
    `program`, then a greedy decode step at each of `decode_batches` (the first rows that fit),
    every call's logits against the eager `reference`'s same call: relative error < tolerance.
    Returns the driver, for calls of the test's own after."""
    from tests.paged_driver import PagedDriver, relative_error

    driver = PagedDriver(program)
    seqs = driver.new_sequences(len(prompts), 64)
    logits = driver.prefill(seqs, prompts, batch=4)
    eager = [EagerSequence(reference) for _ in prompts]
    tokens = []
    for row, prompt in enumerate(prompts):
        want = eager[row].run(prompt)
        assert relative_error(logits[row, : len(prompt)], want) < tolerance
        tokens.append(int(want[-1].argmax()))
    lengths = [len(p) for p in prompts]
    for batch in decode_batches:
        rows = range(min(batch, len(prompts)))
        got = driver.decode([seqs[r] for r in rows], [tokens[r] for r in rows], [lengths[r] for r in rows], batch=batch)
        for row in rows:
            want = eager[row].run([tokens[row]])[0]
            assert relative_error(got[row, 0], want) < tolerance
            tokens[row], lengths[row] = int(want.argmax()), lengths[row] + 1
    return driver
