"""A request and the sequences it generates, each carrying its own state.

A `Request` is what a caller submits (prompt ids, sampling parameters, priority);
it owns `n` `Sequence`s, one per completion. A sequence's state moves

    WAITING -> PREFILL -> DECODE -> FINISHED      (preempted: back to WAITING)
    WAITING -> DENOISE -> FINISHED                 (a diffusion LM's canvas)

and only the scheduler moves it; the output processor turns its tokens into `Event`s
on the request's queue, which the caller reads through GenerateService.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .batch import Phase
from .kvcache.base import PageAllocation
from .sampling import SamplingParams, make_generator

if TYPE_CHECKING:
    from .grammar import MatcherAfterMarker, TokenMatcher

_sequence_ids = itertools.count()


class SequenceState(enum.Enum):
    WAITING = "waiting"  # queued, holding no pages
    PREFILL = "prefill"  # holding pages, its prompt (or, after preemption, its tokens) being written
    DECODE = "decode"  # holding pages, one token per step
    DENOISE = "denoise"  # holding pages for its whole canvas, filled in over forward passes
    FINISHED = "finished"  # pages given back, its last event sent

    @property
    def holds_pages(self) -> bool:
        return self in (SequenceState.PREFILL, SequenceState.DECODE, SequenceState.DENOISE)


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
    # The request field whose value made it fail (a structured output no token can continue),
    # where the client is at fault; None for a failure of the server's.
    error_param: str | None = None
    # With params.prompt_logprobs, on sequence 0's first event: one per prompt token (None for the first).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    embedding: np.ndarray | None = None  # an embedding request's result, on its last event
    cumulative_logprob: float | None = None  # beam search: the beam's summed log-probability


@dataclass
class Completion:
    """One sequence's output, accumulated from its Events (offline API and server alike)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    error_param: str | None = None
    cumulative_logprob: float | None = None

    def add(self, event: Event) -> None:
        self.text += event.text
        self.token_ids.extend(event.token_ids)
        self.logprobs.extend(event.logprobs)
        if event.cumulative_logprob is not None:
            self.cumulative_logprob = event.cumulative_logprob
        if event.finish_reason:
            self.finish_reason, self.stop_reason, self.error = event.finish_reason, event.stop_reason, event.error
            self.error_param = event.error_param


class RequestState:
    """A request's state in its generation mode (runtime/generation_mode.py). The default is
    plain decoding's: sequences are independent, and a sibling of an n > 1 request starts once
    its leader's prompt is cached, so it reuses those pages."""

    def can_start(self, seq: Sequence) -> bool:
        return seq.leader is None or seq.leader.state in (SequenceState.DECODE, SequenceState.FINISHED)

    def gang(self, seq: Sequence) -> list[Sequence]:
        """The sequences that decode with `seq` in one step, all of them or none."""
        return [seq]


class SequenceModeState:
    """A sequence's state in its generation mode, where the mode keeps one (a diffusion canvas)."""


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    priority: int = 0  # lower is served first, as in vLLM
    events: asyncio.Queue = field(default_factory=asyncio.Queue, repr=False)
    sequences: list[Sequence] = field(default_factory=list, repr=False)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (first sequence)
    forward_passes: int = 0  # a diffusion LM's passes over this request's sequences (its NFE)
    canvas_tokens: int = 0  # a diffusion LM's canvas per sequence: max_tokens rounded up to whole blocks
    # Structured output: one matcher per sequence.
    matchers: list[TokenMatcher | MatcherAfterMarker] = field(default_factory=list, repr=False)
    mode: str = ""  # the generation mode that runs it, named when submitted
    mode_state: RequestState = field(default_factory=RequestState, repr=False)
    # time.monotonic() when submitted, and when its first sequence was admitted to run: the
    # difference is its queue time (a metric the server reports).
    arrived_at: float = field(default_factory=time.monotonic)
    scheduled_at: float | None = None
    # A LoRA adapter's slot in the build (0: the base model), and the offset its tokens take in the
    # prefix cache's keys, so that its K/V are never shared with another adapter's (0: none).
    lora_slot: int = 0
    cache_salt: int = 0
    # Called once when its last sequence finishes (an adapter's slot let go).
    on_done: Callable[[], None] | None = field(default=None, repr=False)

    def cache_key(self, tokens: list[int]) -> list[int]:
        """`tokens` as the prefix cache keys them for this request."""
        return [token + self.cache_salt for token in tokens] if self.cache_salt else list(tokens)

    @property
    def finished(self) -> bool:
        return all(s.state is SequenceState.FINISHED for s in self.sequences)

    @property
    def unfinished(self) -> int:
        """Sequences still waiting or running."""
        return sum(1 for s in self.sequences if s.state is not SequenceState.FINISHED)

    def mark_scheduled(self) -> None:
        """A sequence of it was admitted to run: the first time ends its wait in the queue
        (a preempted sequence readmitted later does not move it)."""
        if self.scheduled_at is None:
            self.scheduled_at = time.monotonic()


class Sequence:
    """One completion: its tokens, its pages, its progress through prefill and decode."""

    def __init__(self, request: Request, index: int, leader: Sequence | None = None):
        self.request = request
        self.index = index
        self.seq_id = next(_sequence_ids)  # also the tie-breaker: earlier arrivals first
        self.prompt_len = len(request.prompt_ids)
        self.tokens: list[int] = list(request.prompt_ids)
        self.state = SequenceState.WAITING
        self.allocation: PageAllocation | None = None
        self.computed = 0  # tokens whose K/V are in the cache
        # A sibling of an n > 1 request waits for its leader's prefill, then reuses its pages.
        self.leader = leader
        self.rng: np.random.Generator = make_generator(request.params.seed, index)
        self.finish_reason: str | None = None
        self.preemptions = 0
        self.last_served = 0  # when it was last in a decode batch (the scheduler's counter)
        self.mode_state: SequenceModeState | None = None  # its mode's own (a diffusion canvas, once admitted)
        # Structured output: its grammar's matcher, which the sampler consults.
        self.matcher: TokenMatcher | MatcherAfterMarker | None = request.matchers[index] if request.matchers else None

    # -- where the sequence stands ------------------------------------------------------
    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_ids

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def generated(self) -> int:
        """Tokens sampled so far (len(output_ids) without the copy)."""
        return len(self.tokens) - self.prompt_len

    @property
    def prefill_target(self) -> int:
        """Tokens that prefill must write: all but the last once a token has been sampled.

        A fresh sequence prefills its whole prompt and samples from the last logits; a
        preempted one recomputes everything but its last sampled token, which the next
        decode step then feeds.
        """
        return len(self.tokens) - 1 if self.generated else len(self.tokens)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prefill must compute every prompt position (no prefix reuse) and keep their logits."""
        return self.index == 0 and self.request.params.prompt_logprobs is not None and not self.generated

    @property
    def computes_whole_prompt(self) -> bool:
        """Its prefill computes every prompt position, skipping no cached prefix: prompt logprobs
        read every position's logits, mean and CLS pooling every position's hidden states."""
        pooling = self.request.params.pooling
        return self.wants_prompt_logprobs or (pooling is not None and pooling.reads_every_position)

    @property
    def prefill_phase(self) -> Phase:
        """The call its prompt is written by: embed_bs<N> for an embedding, prefill otherwise."""
        return Phase.PREFILL if self.request.params.pooling is None else Phase.EMBED

    @property
    def priority_key(self) -> tuple:
        return (self.request.priority, self.seq_id)

    def can_start(self) -> bool:
        """Whether its mode lets it be admitted now (a sibling waits for its leader's prompt)."""
        return self.request.mode_state.can_start(self)

    def append(self, token: int) -> None:
        """Take a token. Its K/V are computed when it is fed, so K/V written past the token
        before it (a draft's rejected tail) no longer count."""
        self.tokens.append(token)
        self.computed = min(self.computed, len(self.tokens) - 1)

    def emit(self, event: Event) -> None:
        self.request.events.put_nowait(event)
