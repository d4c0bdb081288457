"""Prompt-lookup drafting: the tokens that followed the sequence's last n-gram where it
appeared before (in the prompt or the output so far).

Free to compute and right whenever the output copies its input (editing, extraction,
code), which is where it pays; with no match there is no draft and the row decodes plainly.
"""

from __future__ import annotations

import numpy as np


class PromptLookup:
    def __init__(self, max_ngram: int = 4, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup needs 1 <= min n-gram <= max n-gram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix
        n-gram (max_ngram down to min_ngram) of `tokens`; [] when none recurs."""
        if k <= 0 or len(tokens) < self.min_ngram + 1:
            return []
        sequence = np.asarray(tokens, np.int64)
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            pattern = sequence[-n:]
            # Every window that ends before the last token: its continuation is known.
            windows = np.lib.stride_tricks.sliding_window_view(sequence[:-1], n)
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            if hits.size:
                follow = int(hits[-1]) + n
                return [int(t) for t in sequence[follow : follow + k]]
        return []
