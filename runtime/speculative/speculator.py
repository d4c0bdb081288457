"""The speculator: between the scheduler's decision and the device call, drafts for a
decode batch's rows; after the call, which of them each row keeps.

It applies where it can pay: a decode batch no wider than `max_rows`, rows of requests that
speculative decoding runs (mode.py: no grammar to follow, no beams, no opt-out). The verify
call is a decode with a row per token (runtime/invocation.py), so the drafts share the widest
decode's rows. A row without a draft still rides along in the
verify call, feeding its one token; a batch in which no row has a draft stays a plain decode call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from ..batch import Batch, Phase
from ..invocation import InvocationError
from ..sampling import SampleResult, Sampler
from .acceptance import accept
from .draft_model import Draft, DraftModel
from .prompt_lookup import PromptLookup

SPECULATIVE = "speculative"  # the mode's name (mode.py), which the requests it runs carry

log = logging.getLogger("kiln.speculative")


@dataclass
class SpeculationCounters:
    steps: int = 0  # verify calls
    drafts: int = 0  # rows that carried a draft into a verify call
    draft_tokens: int = 0  # tokens proposed (and checked)
    accepted_tokens: int = 0  # of those, kept

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a drafted row gains per verify call: its kept drafts plus the model's own."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 0.0


class Speculator:
    def __init__(self, scheduler, num_tokens: int, vocab_size: int, lookup: PromptLookup | None = None,
                 draft_model: DraftModel | None = None, max_rows: int = 0):
        """`max_rows`: the widest decode batch drafted for (0: any the widest decode has room beside)."""
        if (lookup is None) == (draft_model is None):
            raise ValueError("a speculator drafts with prompt lookup or a draft model, one of them")
        self.scheduler = scheduler
        self.num_tokens = num_tokens
        widest = scheduler.config.decode_batch_sizes[-1] - 1  # a sequence and one draft token
        self.max_rows = min(max_rows, widest) if max_rows else widest
        self.vocab_size = vocab_size
        self.lookup = lookup
        self.draft_model = draft_model
        self.counters = SpeculationCounters()
        self._probs: dict[int, np.ndarray | None] = {}  # seq_id -> the draft's distributions, per verify call

    @property
    def method(self) -> str:
        return "ngram" if self.lookup is not None else "draft_model"

    async def extend(self, batch: Batch) -> Batch:
        """A decode batch with drafts (a SPECULATE batch), or the batch itself."""
        if batch.phase is not Phase.DECODE or batch.rows > self.max_rows:
            return batch
        seqs = self.scheduler.sequences_of(batch)
        eligible = [seq for seq in seqs if seq is not None and seq.request.mode == SPECULATIVE]
        if not eligible:
            return batch
        drafts = await self._propose(eligible)
        by_id = {seq.seq_id: draft for seq, draft in zip(eligible, drafts)}
        tokens = [by_id[seq.seq_id].tokens if seq is not None and seq.seq_id in by_id else [] for seq in seqs]
        verify = self.scheduler.speculative_batch(batch, tokens)
        if verify is batch:
            return batch
        self._probs = {}
        for seq_id, chunk in zip(verify.seq_ids, verify.tokens):
            draft = by_id.get(seq_id)
            if draft is not None and draft.probs is not None:
                self._probs[seq_id] = draft.probs[: len(chunk) - 1]
        return verify

    def verify(self, batch: Batch, rows: list[int], seqs: list, logits: list[np.ndarray | None],
               sampler: Sampler) -> list[list[SampleResult]]:
        """What each of `rows` keeps from a SPECULATE batch: its kept draft tokens and one of the
        model's own."""
        counters = self.counters
        counters.steps += 1
        kept = []
        for i in rows:
            seq, row_logits = seqs[i], logits[i]
            draft = list(batch.tokens[i][1:])
            results = accept(sampler, seq, row_logits, draft, self._probs.get(seq.seq_id))
            if draft:
                counters.drafts += 1
                counters.draft_tokens += len(draft)
                counters.accepted_tokens += len(results) - 1
            kept.append(results)
        self._probs = {}
        return kept

    async def _propose(self, seqs: list) -> list[Draft]:
        k = self.num_tokens
        if self.lookup is not None:
            drafts = [Draft(self.lookup.propose(seq.tokens, k), None) for seq in seqs]
        else:
            live = {seq.seq_id for seq in self.scheduler.running}
            try:
                drafts = await self.draft_model.propose(seqs, k, live)
            except Exception as error:  # the target decodes on without drafts
                if not isinstance(error, InvocationError):
                    log.exception("drafting failed")
                log.warning("the draft model failed, decoding without drafts this step: %s", error)
                self.draft_model.release_all()
                return [Draft([], None) for _ in seqs]
        return [_within_vocabulary(draft, self.vocab_size) for draft in drafts]


def _within_vocabulary(draft: Draft, vocab_size: int) -> Draft:
    """A draft model's vocabulary may be padded wider than the target's: cut the draft at
    the first token the target cannot take, and its distributions to the target's width."""
    tokens = draft.tokens
    cut = next((i for i, t in enumerate(tokens) if t >= vocab_size), len(tokens))
    probs = draft.probs
    if probs is not None:
        probs = probs[:cut, :vocab_size]
        if probs.shape[1] < vocab_size:
            probs = np.pad(probs, ((0, 0), (0, vocab_size - probs.shape[1])))
    return Draft(tokens[:cut], probs)
