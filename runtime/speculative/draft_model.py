"""Draft-model drafting: a small autoregressive export of the same tokenizer proposes k
tokens per sequence by decoding them, in a KV cache of its own.

The draft model keeps, per sequence, the tokens whose K/V its cache holds. Before each
round it catches up on what it has not seen (the prompt the first time, then the tokens
the target kept), in one prefill call whose last logits give the first draft token, and
decodes the other k - 1. Tokens the target refused are simply not counted: the next round
writes over their positions. Rows are batched by the draft's own exported sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..batch import Batch, Phase
from ..executor import Executor
from ..kvcache.base import PageAllocation
from ..kvcache.plain_cache import PlainPagedAttentionCache
from ..sampling import draw_from, probabilities
from ..scheduler import smallest_fitting


@dataclass
class _DraftState:
    """One sequence in the draft model's cache."""

    allocation: PageAllocation
    tokens: list[int] = field(default_factory=list)  # whose K/V the draft cache holds, in order
    last_round: int = 0  # for evicting the least recently drafted sequence


@dataclass
class Draft:
    tokens: list[int]
    probs: np.ndarray | None  # [len(tokens), V]: what each token was drawn from; None when greedy


class DraftModel:
    def __init__(self, executor: Executor, cache: PlainPagedAttentionCache, prefill_sizes: tuple[int, ...],
                 decode_sizes: tuple[int, ...], vocab_size: int):
        self.executor = executor
        self.cache = cache
        self.prefill_sizes = prefill_sizes
        self.decode_sizes = decode_sizes
        self.vocab_size = vocab_size
        self._states: dict[int, _DraftState] = {}
        self._round = 0

    async def propose(self, seqs: list, k: int, live_ids: set[int]) -> list[Draft]:
        """k draft tokens for each sequence (fewer, or none, where the draft cache is full).

        `live_ids`: the sequences still running; the others' pages go back first.
        """
        self._round += 1
        for seq_id in [s for s in self._states if s not in live_ids]:
            self._forget(seq_id)
        drafts = [Draft([], None) for _ in seqs]
        rows = [i for i, seq in enumerate(seqs) if self._make_room(seq, k)]
        if not rows:
            return drafts
        probs: dict[int, list[np.ndarray]] = {i: [] for i in rows}
        # First call: everything each row's draft cache lacks, up to and including its last token.
        feeds = {}
        for i in rows:
            state, tokens = self._states[seqs[i].seq_id], seqs[i].tokens
            kept = _common_prefix(state.tokens, tokens[:-1])
            del state.tokens[kept:]
            feeds[i] = (kept, tokens[kept:])
        await self._step(seqs, rows, feeds, drafts, probs)
        for _ in range(k - 1):
            feeds = {i: (len(seqs[i].tokens) + len(drafts[i].tokens) - 1, [drafts[i].tokens[-1]]) for i in rows}
            await self._step(seqs, rows, feeds, drafts, probs)
        for i in rows:
            if probs[i] and not seqs[i].params.greedy:
                drafts[i].probs = np.stack(probs[i])
        return drafts

    def release_all(self) -> None:
        for seq_id in list(self._states):
            self._forget(seq_id)

    # -- one call's worth of rows -----------------------------------------------------
    async def _step(self, seqs, rows, feeds, drafts, probs) -> None:
        """Feed each row's tokens, then draw its next draft token from the last logits."""
        decoding = [i for i in rows if len(feeds[i][1]) == 1]
        prefilling = [i for i in rows if len(feeds[i][1]) > 1]
        for phase, group, sizes in ((Phase.DECODE, decoding, self.decode_sizes),
                                    (Phase.PREFILL, prefilling, self.prefill_sizes)):
            for chunk in _chunks(group, sizes[-1]):
                batch = Batch(phase, smallest_fitting(sizes, len(chunk)), tuple(seqs[i].seq_id for i in chunk),
                              tuple(feeds[i][0] for i in chunk), tuple(tuple(feeds[i][1]) for i in chunk),
                              tuple(tuple(self._states[seqs[i].seq_id].allocation.pages) for i in chunk),
                              (True,) * len(chunk), (False,) * len(chunk))
                logits = await self.executor.run(batch)
                for i, row_logits in zip(chunk, logits):
                    self._states[seqs[i].seq_id].tokens.extend(feeds[i][1])
                    token, p = _choose(row_logits, seqs[i])
                    drafts[i].tokens.append(token)
                    if p is not None:
                        probs[i].append(p)

    # -- pages ------------------------------------------------------------------------
    def _make_room(self, seq, k: int) -> bool:
        """Pages for seq's tokens and k - 1 drafts, evicting sequences drafted longest ago."""
        needed = len(seq.tokens) + k - 1
        state = self._states.get(seq.seq_id)
        while True:
            if state is None:
                allocation = self.cache.acquire_pages_for_tokens([], extra_token_slots=needed)
                if allocation is not None:
                    state = self._states[seq.seq_id] = _DraftState(allocation)
            if state is not None and self.cache.extend_allocation(state.allocation, needed):
                state.last_round = self._round
                return True
            victims = [s for s, st in self._states.items() if st.last_round < self._round and s != seq.seq_id]
            if not victims:
                return False
            self._forget(min(victims, key=lambda s: self._states[s].last_round))

    def _forget(self, seq_id: int) -> None:
        state = self._states.pop(seq_id)
        self.cache.free_cache_pages(state.allocation)


def _choose(logits: np.ndarray, seq) -> tuple[int, np.ndarray | None]:
    """The draft token, and (sampling rows) the distribution it was drawn from."""
    params = seq.params
    if params.greedy:
        return int(np.argmax(logits)), None
    p = probabilities(logits, params)
    return draw_from(p, seq.rng), p


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    mismatch = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(mismatch[0])


def _chunks(items: list[int], size: int):
    for start in range(0, len(items), size):
        yield items[start : start + size]

