"""An eager model's paged forward driven one call at a time, as the compiled functions run it."""

from __future__ import annotations

import numpy as np
import torch


class EagerSequence:
    """One sequence through the eager model's paged forward, call for call as the compiled
    functions run it: a prefill of several tokens widens the weights (or quantizes its rows,
    for 4-bit values the kernel holds two a byte), a decode step of one token (and
    prefill_last's output head over one position) takes them narrow."""

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


# Where a call's rows are quantized to int8 (a decode step's through the block kernels, a
# prefill's through the 4-bit one), a float32 rounding upstream (the compiled norm or attention
# summing otherwise than torch) may move one input value across an int8 step, about 1e-3 of that
# position's logits, and through its K/V a little of the later ones'. A wrong scale, offset or
# block moves every position, by far more.
ROUNDING_STEP = 1e-2


def _within_rounding(got: np.ndarray, want: np.ndarray, tolerance: float) -> bool:
    """Logits [T, V] of a prefill whose rows are quantized against the eager model's: every
    position within ROUNDING_STEP, and most (the median) within `tolerance`."""
    from tests.paged_driver import relative_error

    errors = [relative_error(g, w) for g, w in zip(got, want)]
    return max(errors) < ROUNDING_STEP and float(np.median(errors)) < tolerance


def quantizes_prefill_rows(model) -> bool:
    """Whether `model` holds 4-bit values two a byte, whose prefill rows the 4-bit kernel quantizes."""
    return any(getattr(module, "packed", None) is True for module in model.modules())


def check_call_for_call(program, reference, prompts: list[list[int]], tolerance: float,
                        decode_batches=(4, 4, 4, 4)):
    """Prefill `prompts` in one batch of 4 (a padded row where fewer) through the compiled
    `program`, then a greedy decode step at each of `decode_batches` (the first rows that fit),
    every call's logits against the eager `reference`'s same call: relative error < tolerance.
    Where the prefill's rows are quantized to int8 and a rounding step moved a position (see
    ROUNDING_STEP), that prefill is held to `_within_rounding` and the decode steps after it
    (reading its K/V) to ROUNDING_STEP. Returns the driver, for calls of the test's own after."""
    from tests.paged_driver import PagedDriver, relative_error

    quantized_inputs = quantizes_prefill_rows(reference)
    driver = PagedDriver(program)
    seqs = driver.new_sequences(len(prompts), 64)
    logits = driver.prefill(seqs, prompts, batch=4)
    eager = [EagerSequence(reference) for _ in prompts]
    tokens, rounded = [], False
    for row, prompt in enumerate(prompts):
        want = eager[row].run(prompt)
        got = logits[row, : len(prompt)]
        if relative_error(got, want) >= tolerance:
            assert quantized_inputs and _within_rounding(got, want, tolerance), f"prefill, row {row}"
            rounded = True
        tokens.append(int(want[-1].argmax()))
    lengths = [len(p) for p in prompts]
    step_tolerance = ROUNDING_STEP if rounded else tolerance
    for batch in decode_batches:
        rows = range(min(batch, len(prompts)))
        got = driver.decode([seqs[r] for r in rows], [tokens[r] for r in rows], [lengths[r] for r in rows], batch=batch)
        for row in rows:
            want = eager[row].run([tokens[row]])[0]
            assert relative_error(got[row, 0], want) < step_tolerance, f"decode at batch {batch}, row {row}"
            tokens[row], lengths[row] = int(want.argmax()), lengths[row] + 1
    return driver
