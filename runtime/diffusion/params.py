"""What a request may ask of a diffusion LM, checked, and the plan it resolves to.

The names are LLaDA's and Fast-dLLM's (`steps`, `block_length`, `remasking`, `threshold`,
`cfg_scale`) with Dream's confidence rules; dfastllm's and dlmserve's spellings are
accepted by the server as aliases of these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from ..errors import InvalidRequestError

REMASKING = ("low_confidence", "random")
CONFIDENCE = ("top1", "margin", "entropy")
CACHE_MODES = ("none", "prefix", "dual")
DEFAULT_BLOCK_LENGTH = 32  # Fast-dLLM's default; shorter outputs are one block
DEFAULT_CANVAS_TOKENS = 128  # LLaDA's gen_length: where a route would give the rest of the context


@dataclass(frozen=True)
class DiffusionParams:
    steps: int | None = None  # forward passes of the fixed schedule (None: one token per step)
    block_length: int | None = None  # None: DEFAULT_BLOCK_LENGTH, or max_tokens if shorter
    remasking: str = "low_confidence"  # which masked positions a step commits: most confident, or random
    confidence: str = "top1"  # low_confidence's measure: top-1 probability, top1 - top2, or -entropy
    threshold: float | None = None  # Fast-dLLM: commit every position at least this confident (None: schedule)
    cache: str = "none"  # "none": whole sequence each pass; "prefix" / "dual": K/V reused within a block
    cfg_scale: float = 0.0  # classifier-free guidance (LLaDA), with cache "none" only
    # APD (with a verifier loaded): R, the diffusion model's weight in the mixture that
    # verifies its draft; W, committed positions recomputed each round (None: all); M, the
    # most positions drafted per round (None: the rest of the canvas).
    apd_mixture_weight: float | None = None
    apd_kv_window: int | None = None
    apd_max_lookahead: int | None = None

    def first_given(self) -> str:
        """The first option set away from its default: the field a refusal of them names."""
        return next((f.name for f in fields(self) if getattr(self, f.name) != f.default), "steps")

    @property
    def apd(self) -> bool:
        return self.apd_mixture_weight is not None

    def plan(self, max_tokens: int) -> "DiffusionPlan":
        """Check every field against max_tokens; InvalidRequestError naming the first at fault."""
        for name in ("steps", "block_length"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}", param=name)
        for name, allowed in (("remasking", REMASKING), ("confidence", CONFIDENCE), ("cache", CACHE_MODES)):
            if getattr(self, name) not in allowed:
                raise InvalidRequestError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}",
                                          param=name)
        if self.threshold is not None and not (_finite(self.threshold) and 0.0 <= self.threshold <= 1.0):
            raise InvalidRequestError(f"threshold must be in [0, 1], got {self.threshold!r}", param="threshold")
        if not _finite(self.cfg_scale) or self.cfg_scale < 0:
            raise InvalidRequestError(f"cfg_scale must be a number >= 0, got {self.cfg_scale!r}", param="cfg_scale")
        if self.cfg_scale and self.cache != "none":
            raise InvalidRequestError("cfg_scale needs cache \"none\": guidance reruns the prompt masked every pass",
                                      param="cfg_scale")
        if self.apd or self.apd_kv_window is not None or self.apd_max_lookahead is not None:
            return self._apd_plan(max_tokens)
        block = self.block_length or min(DEFAULT_BLOCK_LENGTH, max_tokens)
        blocks = -(-max_tokens // block)
        steps = self.steps if self.steps is not None else blocks * block
        if steps % blocks:
            raise InvalidRequestError(f"steps ({steps}) must be a multiple of the number of blocks ({blocks}: "
                                      f"max_tokens {max_tokens} in blocks of {block})", param="steps")
        return DiffusionPlan(block, blocks, steps // blocks, self)

    def _apd_plan(self, max_tokens: int) -> "DiffusionPlan":
        if not self.apd:
            raise InvalidRequestError("apd_kv_window and apd_max_lookahead need apd_mixture_weight",
                                      param="apd_mixture_weight")
        if not (_finite(self.apd_mixture_weight) and 0.0 <= self.apd_mixture_weight <= 1.0):
            raise InvalidRequestError(f"apd_mixture_weight must be in [0, 1], got {self.apd_mixture_weight!r}",
                                      param="apd_mixture_weight")
        for name in ("apd_kv_window", "apd_max_lookahead"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InvalidRequestError(f"{name} must be a positive integer, got {value!r}", param=name)
        # APD drafts left to right in its own windows: the block and cache options do not apply.
        for name, unused in (("steps", None), ("block_length", None), ("threshold", None), ("cache", "none"),
                             ("cfg_scale", 0.0), ("remasking", "low_confidence"), ("confidence", "top1")):
            if getattr(self, name) != unused:
                raise InvalidRequestError(f"{name} does not apply with APD (apd_mixture_weight)", param=name)
        return DiffusionPlan(max_tokens, 1, max_tokens, self)


@dataclass(frozen=True)
class DiffusionPlan:
    """A checked request: blocks of `block_length` tokens, `steps_per_block` passes each (fixed schedule)."""

    block_length: int
    blocks: int
    steps_per_block: int
    params: DiffusionParams

    @property
    def canvas_length(self) -> int:
        """The tokens generated: max_tokens rounded up to whole blocks."""
        return self.block_length * self.blocks


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
