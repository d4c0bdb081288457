"""An embedding from a prompt's hidden states: pooling, Matryoshka truncation, normalisation.

The compiled embed_bs<N> returns the final hidden states (after the last norm) of each chunk a
row writes; what a request asks of them is plain data (`PoolingParams`), and the arithmetic is
here, on the host, in numpy, as sentence-transformers does it: pool, cut to `dimensions`, then
L2-normalise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import InvalidRequestError
from .request import SequenceModeState

POOLING_MODES = ("last", "mean", "cls")  # last token, mean over the prompt, first token


@dataclass(frozen=True)
class PoolingParams:
    mode: str = "last"
    normalize: bool = True
    dimensions: int | None = None  # keep the first this many (a Matryoshka model's cut); None: all

    def __post_init__(self):
        if self.mode not in POOLING_MODES:
            raise InvalidRequestError(f"pooling must be one of {', '.join(POOLING_MODES)}, got {self.mode!r}",
                                      param="pooling")

    @property
    def reads_every_position(self) -> bool:
        """Whether pooling reads positions before the last, so the whole prompt is computed (no
        cached prefix skipped) and each chunk's hidden states are kept."""
        return self.mode != "last"


class PooledState(SequenceModeState):
    """One sequence's pooling so far, over the chunks its prompt is written in."""

    def __init__(self, params: PoolingParams):
        self.params = params
        self.total: np.ndarray | None = None  # mean: the sum of the positions seen
        self.count = 0
        self.first: np.ndarray | None = None  # cls: position 0's

    def add_chunk(self, start: int, hidden: np.ndarray) -> None:
        """A chunk's hidden states [len(chunk), H] (its last position's [H] under last-token pooling)
        written from `start`; a chunk from 0 starts over (a sequence preempted and recomputed)."""
        if start == 0:
            self.total, self.count, self.first = None, 0, None
        if not self.params.reads_every_position:
            return
        hidden = np.asarray(hidden, np.float64)
        if start == 0:
            self.first = hidden[0]
        chunk_sum = hidden.sum(axis=0)
        self.total = chunk_sum if self.total is None else self.total + chunk_sum
        self.count += hidden.shape[0]

    def result(self, last_hidden: np.ndarray) -> np.ndarray:
        """The embedding, float32 [dimensions or H], once the prompt's last chunk has been added
        (`last_hidden`: that chunk's hidden states, or its last position's)."""
        params = self.params
        last_hidden = np.asarray(last_hidden, np.float64)
        if params.mode == "mean":
            vector = self.total / self.count
        elif params.mode == "cls":
            vector = self.first
        else:
            vector = last_hidden[-1] if last_hidden.ndim == 2 else last_hidden
        return finish_embedding(vector, params)


def finish_embedding(vector: np.ndarray, params: PoolingParams) -> np.ndarray:
    """Cut to params.dimensions, then L2-normalise if asked (sentence-transformers' order)."""
    vector = np.asarray(vector, np.float64)
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
    return vector.astype(np.float32)
