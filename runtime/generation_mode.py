"""A generation mode: how one kind of request turns a step's output into tokens.

Plain decoding (runtime/decoding), beam search (runtime/beam_search), speculative decoding
(runtime/speculative), diffusion LMs (runtime/diffusion) and embeddings (runtime/embedding) each
implement this interface in a package of their own, so the batcher's step is the same whatever the mode:

    schedule (the scheduler) -> prepare (each mode) -> execute -> update (each row's mode)
    -> take each token (runtime/finishing: the one place a sequence ends) -> emit

A request takes the first mode that accepts it, which checks what it asks (`check`) before it
is submitted; its rows in any batch are updated by that mode. What a mode keeps per request is
a `request.RequestState` of its own (the scheduler asks it which sequences may start and which
step together); per sequence, a `request.SequenceModeState` (a diffusion canvas).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .batch import Batch, Phase
from .sampling import SampleResult, SamplingParams

if TYPE_CHECKING:
    from .executor import Executor
    from .finishing import Finish
    from .request import Request, Sequence


@dataclass(frozen=True)
class Advance:
    """What a step gave one sequence: the tokens it takes, in order (each may end it), and the
    end its mode reports after the last of them (with no tokens: at once)."""

    seq: Sequence
    samples: list[SampleResult]
    end: Finish | None = None
    embedding: np.ndarray | None = None  # what an embedding ends with, in place of tokens


@dataclass(frozen=True)
class SearchDone:
    """A search over several sequences that ended together: each result's tokens whole, best
    first (runtime.beam_search.Hypothesis), for sequences 0.. of the request."""

    request: Request
    results: list = field(default_factory=list)


StepOutcome = Advance | SearchDone


@dataclass(frozen=True)
class Footprint:
    """What a request holds once running: the tokens each of its sequences may fill (prompt and
    output), in `copies` sets of pages side by side (beams, a guidance twin)."""

    tokens: int
    copies: int = 1


class GenerationMode(ABC):
    name: str
    # Whether max_tokens and the context bound its sequences' length (else the mode does).
    counts_max_tokens: bool = True

    def accepts(self, params: SamplingParams) -> bool:
        """Whether this mode generates a request of these params (modes are asked in order)."""
        return True

    @abstractmethod
    def check(self, prompt_len: int, params: SamplingParams) -> Footprint:
        """InvalidRequestError naming the field for what this mode cannot honour (defaults it
        fills in are set on `params`); what the request will hold otherwise."""

    def start(self, request: Request) -> None:
        """Give a submitted request (its sequences made) its state in this mode."""

    def executors(self) -> dict[Phase, Executor]:
        """Batches of these phases run on another model than the server's (an APD verifier)."""
        return {}

    async def prepare(self, batch: Batch) -> Batch:
        """The batch to run in place of the scheduler's (speculative decoding adds drafts)."""
        return batch

    @abstractmethod
    def update(self, batch: Batch, rows: list[int], seqs: list[Sequence | None],
               logits: list[np.ndarray | None]) -> list[StepOutcome]:
        """Read the model's output for this mode's `rows` of a batch that has run (their K/V
        already counted by the scheduler): the tokens each sequence takes, or a search's end."""


def last_position(row_logits: np.ndarray) -> np.ndarray:
    """A row's next-token logits: its last position's where the batch returned every position's."""
    return row_logits[-1] if row_logits.ndim == 2 else row_logits
