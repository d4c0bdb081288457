"""Adaptive parallel decoding (APD, Israel et al. 2025): a diffusion LM drafts left to right and
a small autoregressive model with the same tokenizer verifies.

Each round the diffusion model computes a window from the first open position up to
`max_lookahead` tokens further (attending to nothing beyond it) and drafts every position
in it; the verifier (any autoregressive export with start positions) scores the draft in
one prefill call. The draft is accepted up to its first position where it differs from a
sample of the mixture `R * logits_diffusion + (1 - R) * logits_verifier` (the same noise
drawing both), and that position takes the mixture's sample, as speculative decoding's
correction does: so R = 1 keeps the diffusion model's left-to-right output and R = 0 is
exactly the verifier's. With `kv_window` W, the diffusion pass recomputes only the last W
committed positions and the window; the K/V before them stay in the pages.
"""

from __future__ import annotations

import numpy as np

from ..request import SequenceModeState
from .canvas import Window


class ApdCanvas(SequenceModeState):
    def __init__(self, prompt_ids, length: int, mask_token_id: int, logits_shift: int, temperature: float,
                 rng: np.random.Generator, mixture_weight: float, kv_window: int | None, max_lookahead: int | None):
        self.mask = mask_token_id
        self.shift = logits_shift
        self.temperature = temperature
        self.rng = rng
        self.mixture_weight = mixture_weight
        self.kv_window = kv_window
        self.max_lookahead = max_lookahead
        self.prompt_len = len(prompt_ids)
        self.tokens = np.full(self.prompt_len + length, mask_token_id, np.int64)
        self.tokens[: self.prompt_len] = prompt_ids
        self.current = self.prompt_len  # the first open position: everything before it is committed
        self.verifier_valid = 0  # positions whose K/V the verifier's pages hold for the committed tokens
        self.forward_passes = 0  # the diffusion model's (the verifier's calls are counted apart)
        self.verifier_passes = 0
        self.committed_per_pass: list[int] = []
        self.last_pass_kind = "apd"
        self._previous_current = self.current
        self._draft: np.ndarray | None = None  # drafted tokens for current..right, awaiting the verifier
        self._draft_logits: np.ndarray | None = None
        self._noise: np.ndarray | None = None

    @property
    def done(self) -> bool:
        return self.current >= len(self.tokens)

    @property
    def awaiting_verifier(self) -> bool:
        return self._draft is not None

    def committed_prefix(self) -> int:
        return self.current - self.prompt_len

    @property
    def pass_kind(self) -> str:
        return "apd"

    # -- the diffusion pass -------------------------------------------------------------
    @property
    def right(self) -> int:
        end = len(self.tokens)
        return end if self.max_lookahead is None else min(self.current + self.max_lookahead, end)

    @property
    def left(self) -> int:
        """The first position the next diffusion pass recomputes: all, or from the positions
        committed last round (their K/V were a mask's) and the kv_window - 1 before them."""
        if self.kv_window is None or self.forward_passes == 0:
            return 0
        return max(0, self._previous_current - self.kv_window + 1)

    def window(self) -> Window:
        left, right = self.left, self.right
        return Window(left, self.tokens[left:right].copy(), right)

    @property
    def needs_logits(self) -> bool:
        return True  # the mixture needs the diffusion model's whole distribution

    def commit(self, logits: np.ndarray, unconditional=None, summarized: bool = False) -> int:
        """Draft the window's open positions from the diffusion logits; the verifier decides next."""
        right = self.right
        positions = np.arange(self.current, right)
        rows = np.array(logits[positions - self.shift - self.left], dtype=np.float64)
        self._draft_logits = rows.copy()  # finite, for the mixture
        rows[:, self.mask] = -np.inf
        self._noise = None if self.temperature == 0 else -np.log(-np.log(self.rng.random(rows.shape)))
        self._draft = self._sample(rows)
        self.forward_passes += 1
        return 0

    def _sample(self, logits: np.ndarray) -> np.ndarray:
        if self._noise is None:
            return logits.argmax(axis=-1)
        return (logits / self.temperature + self._noise[:, : logits.shape[1]]).argmax(axis=-1)

    # -- the verifier's pass ------------------------------------------------------------
    def verifier_window(self) -> Window:
        """The draft written into the verifier's pages from the first position it lacks; its
        logits at row j predict position start + j + 1 (the verifier is autoregressive)."""
        start = min(self.verifier_valid, self.current - 1)
        draft = self.tokens[: self.right].copy()
        draft[self.current :] = self._draft
        return Window(start, draft[start:], len(draft))

    def accept(self, verifier_logits: np.ndarray) -> int:
        """Commit the agreeing prefix of the draft and the mixture's token where they first differ."""
        start = min(self.verifier_valid, self.current - 1)
        count = len(self._draft)
        rows = np.asarray(verifier_logits[self.current - 1 - start : self.current - 1 - start + count], np.float64)
        vocab = min(rows.shape[1], self._draft_logits.shape[1])
        weight = self.mixture_weight
        mixture = weight * self._draft_logits[:, :vocab] + (1.0 - weight) * rows[:, :vocab]
        if self.mask < vocab:
            mixture[:, self.mask] = -np.inf
        target = self._sample(mixture)
        disagree = np.flatnonzero(target != self._draft)
        accepted = count if not disagree.size else int(disagree[0]) + 1
        chosen = self._draft[:accepted].copy()
        if disagree.size:
            chosen[-1] = target[accepted - 1]  # the correction: the mixture's token
        self.tokens[self.current : self.current + accepted] = chosen
        self._previous_current = self.current
        self.current += accepted
        self.verifier_valid = self.current - 1  # the last token's K/V may be a rejected draft's
        self.verifier_passes += 1
        self.committed_per_pass.append(accepted)
        self._draft = self._draft_logits = self._noise = None
        return accepted
