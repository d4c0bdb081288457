"""One diffusion sequence: its prompt and canvas, which block and step it is at, and the
window its next forward pass computes.

The canvas is written block by block, left to right (LLaDA's semi-autoregressive blocks).
Within a block each pass commits some masked positions, by a fixed schedule or by
Fast-dLLM's threshold. The window depends on the cache mode:

- "none": every pass computes the whole sequence.
- "prefix": the first pass of a block computes the whole sequence and leaves every K/V in
  the pages; later passes compute from the block on and attend to the cached prefix.
- "dual": the same refresh, then only the block, attending to the cached prefix and suffix.

A model with shifted logits (Dream: output i predicts token i + 1) reads position p's
logits at p - 1, so its windows start one token before the block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..request import SequenceModeState
from .commit import choose, confidence, predict, summary_scores, transfer_schedule
from .params import DiffusionPlan


@dataclass(frozen=True)
class Window:
    """What the next pass computes: `tokens` written from `start`, attending to every key below `visible`."""

    start: int
    tokens: np.ndarray
    visible: int
    unconditional: np.ndarray | None = None  # classifier-free guidance: the same window, prompt masked

    @property
    def width(self) -> int:
        return len(self.tokens)


class Canvas(SequenceModeState):
    def __init__(self, prompt_ids, plan: DiffusionPlan, mask_token_id: int, logits_shift: int,
                 temperature: float, rng: np.random.Generator):
        self.plan = plan
        self.mask = mask_token_id
        self.shift = logits_shift
        self.temperature = temperature
        self.rng = rng
        self.prompt_len = len(prompt_ids)
        self.tokens = np.full(self.prompt_len + plan.canvas_length, mask_token_id, np.int64)
        self.tokens[: self.prompt_len] = prompt_ids
        self.block = 0
        self.step = 0  # passes made in the current block
        self.forward_passes = 0
        self.committed_per_pass: list[int] = []
        self.last_pass_kind = ""
        self._schedule = transfer_schedule(plan.block_length, plan.steps_per_block)

    # -- where it stands --------------------------------------------------------------
    @property
    def block_start(self) -> int:
        return self.prompt_len + self.block * self.plan.block_length

    @property
    def block_end(self) -> int:
        return self.block_start + self.plan.block_length

    @property
    def done(self) -> bool:
        return self.block >= self.plan.blocks

    @property
    def awaiting_verifier(self) -> bool:
        """Whether a pass awaits a verifier's (APD's canvas does): never here."""
        return False

    def committed_prefix(self) -> int:
        """Generated tokens committed without a gap: what may be streamed."""
        masked = np.flatnonzero(self.tokens[self.prompt_len :] == self.mask)
        return int(masked[0]) if masked.size else self.plan.canvas_length

    # -- the next pass ----------------------------------------------------------------
    @property
    def pass_kind(self) -> str:
        """What the next pass computes: "full" (the whole sequence), or a cached "prefix" / "dual" window."""
        return "full" if self.plan.params.cache == "none" or self.step == 0 else self.plan.params.cache

    def window(self) -> Window:
        length = self.tokens.size
        if self.pass_kind == "full":
            unconditional = None
            if self.plan.params.cfg_scale:
                unconditional = self.tokens.copy()
                unconditional[: self.prompt_len] = self.mask
            return Window(0, self.tokens.copy(), length, unconditional)
        start = self.block_start - self.shift
        end = self.block_end if self.pass_kind == "dual" else length
        return Window(start, self.tokens[start:end].copy(), length)

    @property
    def needs_logits(self) -> bool:
        """Whether a pass must return full logits; a greedy one without guidance reads only
        the per-position summary of denoise_top (contract.FunctionKind.DENOISE_TOP)."""
        return self.temperature > 0 or bool(self.plan.params.cfg_scale)

    def commit(self, logits: np.ndarray, unconditional: np.ndarray | None = None, summarized: bool = False) -> int:
        """Apply one pass's logits ([window width, V], as `window()` planned it), or with
        `summarized` its [window width, 4] greedy summary; returns how many positions it
        committed. Moves to the next block once this one is full."""
        kind = self.pass_kind
        window_start = 0 if kind == "full" else self.block_start - self.shift
        if unconditional is not None:
            scale = self.plan.params.cfg_scale
            logits = unconditional + (scale + 1.0) * (logits - unconditional)
        block = np.arange(self.block_start, self.block_end)
        masked = block[self.tokens[block] == self.mask]
        params = self.plan.params
        rows = logits[masked - self.shift - window_start]
        if summarized:
            tokens, scores = summary_scores(rows, params.confidence)
        else:
            rows = np.array(rows, dtype=np.float32)
            rows[:, self.mask] = -np.inf  # never "commit" a mask: the position would stay open forever
            tokens = predict(rows, self.temperature, self.rng)
            scores = confidence(rows, tokens, params.confidence)
        if params.remasking == "random":
            scores = self.rng.random(len(masked))
        count = None if params.threshold is not None else self._schedule[min(self.step, len(self._schedule) - 1)]
        chosen = choose(scores, count, params.threshold)
        self.tokens[masked[chosen]] = tokens[chosen]
        self.forward_passes += 1
        self.committed_per_pass.append(len(chosen))
        self.last_pass_kind = kind
        self.step += 1
        if not np.any(self.tokens[block] == self.mask):
            self.block += 1
            self.step = 0
        return len(chosen)
