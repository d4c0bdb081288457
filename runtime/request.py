"""A request and the sequences it generates, each carrying its own state.

A `Request` is what a caller submits (prompt ids, sampling parameters, priority);
it owns `n` `Sequence`s, one per completion. The scheduler moves sequences
between waiting and running; the batcher appends tokens and emits `Event`s
onto the request's queue, which the caller reads through GenerateService.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from .kvcache.base import PageAllocation
from .sampling import SamplingParams, make_generator

_arrivals = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not holding pages
    RUNNING = "running"  # holding pages: prefilling or decoding
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)  # alternatives: token id -> logprob


@dataclass
class Event:
    """What one step produced for one sequence (index), sent to the caller."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or token that ended it
    error: str | None = None
    # With params.prompt_logprobs, on sequence 0's first event: one per prompt token (None for the first).
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class Completion:
    """One sequence's output, accumulated from its Events (offline API and server alike)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None

    def add(self, event: Event) -> None:
        self.text += event.text
        self.token_ids.extend(event.token_ids)
        self.logprobs.extend(event.logprobs)
        if event.finish_reason:
            self.finish_reason, self.stop_reason, self.error = event.finish_reason, event.stop_reason, event.error


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    priority: int = 0  # lower is served first, as in vLLM
    arrival: float = field(default_factory=time.monotonic)
    events: asyncio.Queue = field(default_factory=asyncio.Queue, repr=False)
    sequences: list["Sequence"] = field(default_factory=list, repr=False)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (first sequence)
    first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(s.status is SequenceStatus.FINISHED for s in self.sequences)


class Sequence:
    """One completion: its tokens, its pages, its progress through prefill and decode."""

    def __init__(self, request: Request, index: int, leader: "Sequence | None" = None):
        self.request = request
        self.index = index
        self.order = next(_arrivals)  # tie-breaker: earlier arrivals first
        self.prompt_len = len(request.prompt_ids)
        self.tokens: list[int] = list(request.prompt_ids)
        self.status = SequenceStatus.WAITING
        self.allocation: PageAllocation | None = None
        self.computed = 0  # tokens whose K/V are in the cache
        # A sibling of an n > 1 request waits for its leader's prefill, then reuses its pages.
        self.leader = leader
        seed = request.params.seed
        self.rng: np.random.Generator = make_generator(seed, index)
        self.logprobs: list[TokenLogprob] = []
        # Prompt logprobs by position while the prompt is prefilled; None once sent (or never wanted).
        wanted = index == 0 and request.params.prompt_logprobs is not None
        self.prompt_logprobs: dict[int, TokenLogprob] | None = {} if wanted else None
        self.finish_reason: str | None = None
        self.preemptions = 0
        self.last_served = 0  # when it was last in a decode batch (the scheduler's counter)
        # Filled in by the batcher: incremental detokenizer and stop-string checker.
        self.detokenizer = None
        self.stop_checker = None

    # -- where the sequence stands ------------------------------------------------------
    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def prefill_target(self) -> int:
        """Tokens that prefill must write: all but the last once a token has been sampled.

        A fresh sequence prefills its whole prompt and samples from the last logits; a
        preempted one recomputes everything but its last sampled token, which the next
        decode step then feeds.
        """
        return len(self.tokens) - 1 if self.output_ids else len(self.tokens)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prefill must compute every prompt position (no prefix reuse) and keep their logits."""
        return self.prompt_logprobs is not None

    def take_prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """The prompt's logprobs in order, once (after its prefill); None afterwards."""
        found, self.prompt_logprobs = self.prompt_logprobs, None
        if found is None:
            return None
        return [None] + [found.get(position) for position in range(1, self.prompt_len)]

    @property
    def in_prefill(self) -> bool:
        return self.computed < self.prefill_target

    @property
    def priority_key(self) -> tuple:
        return (self.request.priority, self.order)

    def can_start(self) -> bool:
        leader = self.leader
        return leader is None or leader.status is SequenceStatus.FINISHED or (
            leader.status is SequenceStatus.RUNNING and not leader.in_prefill
        )

    def emit(self, event: Event) -> None:
        self.request.events.put_nowait(event)
