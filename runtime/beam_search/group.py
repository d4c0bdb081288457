"""One beam search's state: its beams, the hypotheses they ended, and the choice made each step.

Kept apart from the scheduler so the rule is plain data in and out: every live beam's
log-probabilities for its next token go in once all of them have them (beams step together),
and out come, for each beam slot, the beam it continues from and the token it takes. A slot
that continues another beam than its own is forked by the scheduler: its pages are dropped,
the parent's full pages are shared through the prefix cache, and only the parent's last,
partial page is recomputed, never copied.

The scoring is Hugging Face's: a hypothesis's score is its summed log-probability divided by
its length to the power `length_penalty`; EOS candidates ranked among the best `width` end
a hypothesis; the search stops when `width` hypotheses are done and no live beam can do
better at its current length, or when the beams reach max_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..request import RequestState, Sequence


@dataclass
class Hypothesis:
    tokens: list[int]  # generated tokens (an ending EOS not included)
    logprob: float  # summed log-probability of the generated tokens (and the EOS that ended it)
    finish_reason: str  # "stop" (EOS or a stop token) or "length"
    stop_token: int | None = None
    score: float = 0.0


@dataclass(frozen=True)
class Choice:
    """One beam slot's next state: continue the beam in `parent` slot with `token`."""

    parent: int
    token: int
    logprob: float  # the new summed log-probability


@dataclass
class BeamGroup(RequestState):
    """A request's beams: sequence i is beam slot i. Its live beams are admitted as the search
    expands to them and decode together, in one step."""

    width: int
    length_penalty: float
    live: int = 1  # beam slots in use: 1 until the prompt's logits are first expanded
    logprobs: list[float] = field(default_factory=list)  # summed log-probability per live slot
    finished: list[Hypothesis] = field(default_factory=list)
    reports: dict[int, np.ndarray] = field(default_factory=dict)  # slot -> this step's log-probabilities
    done: bool = False

    def __post_init__(self):
        self.logprobs = [0.0]

    def can_start(self, seq: Sequence) -> bool:
        return seq.index < self.live

    def gang(self, seq: Sequence) -> list[Sequence]:
        return seq.request.sequences[: self.live]

    def score(self, logprob: float, length: int) -> float:
        return logprob / max(1, length) ** self.length_penalty

    def report(self, slot: int, logits: np.ndarray) -> bool:
        """Record a live slot's next-token logits; True once every live slot has reported."""
        x = np.asarray(logits, np.float64)
        top = x.max()
        self.reports[slot] = x - (top + np.log(np.exp(x - top).sum()))
        return len(self.reports) == self.live

    def step(self, generated: list[list[int]], ends: frozenset[int], max_tokens: int) -> list[Choice]:
        """Expand every live beam, end the hypotheses that EOS (or max_tokens) ends, and choose
        the next live beams. `generated`: each live slot's generated tokens so far. Returns
        the choices for the new live slots, best first (empty when the search is done)."""
        length = len(generated[0]) + 1  # every live beam has the same length
        candidates = []
        for slot in range(self.live):
            row = self.reports[slot]
            best = np.argpartition(row, -2 * self.width)[-2 * self.width:] if row.size > 2 * self.width \
                else np.arange(row.size)
            candidates += [(self.logprobs[slot] + float(row[t]), slot, int(t)) for t in best]
        self.reports = {}
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        chosen: list[Choice] = []
        for rank, (logprob, slot, token) in enumerate(candidates):
            if token in ends:
                if rank < self.width:  # an EOS among the best ends a hypothesis; below them it is dropped
                    self._end(generated[slot], logprob, "stop", token)
                continue
            chosen.append(Choice(slot, token, logprob))
            if len(chosen) == self.width:
                break
        if length >= max_tokens:
            for choice in chosen:
                self._end(generated[choice.parent] + [choice.token], choice.logprob, "length")
            chosen = []
        elif chosen and len(self.finished) >= self.width:
            worst = min(h.score for h in self.finished)
            if self.score(chosen[0].logprob, length) <= worst:
                chosen = []
        self.done = not chosen
        self.live = len(chosen)
        self.logprobs = [c.logprob for c in chosen]
        return chosen

    def ranked(self, count: int) -> list[Hypothesis]:
        return sorted(self.finished, key=lambda h: -h.score)[:count]

    def _end(self, tokens: list[int], logprob: float, reason: str, stop_token: int | None = None) -> None:
        length = len(tokens) + (1 if stop_token is not None else 0)
        self.finished.append(Hypothesis(list(tokens), logprob, reason, stop_token, self.score(logprob, length)))
