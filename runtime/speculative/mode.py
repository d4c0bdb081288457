"""Speculative decoding as a generation mode: decode batches get drafts before they run
(`prepare`), and a verify call's rows keep what the model agrees with. Its requests' prefill,
and decode steps the speculator leaves undrafted, sample as plain decoding does."""

from __future__ import annotations

import numpy as np

from ..batch import Batch, Phase
from ..decoding import PlainDecoding
from ..generation_mode import Advance, Footprint, GenerationMode, StepOutcome
from ..request import Sequence
from ..sampling import Sampler, SamplingParams
from .speculator import SPECULATIVE, Speculator


class SpeculativeDecoding(GenerationMode):
    name = SPECULATIVE

    def __init__(self, speculator: Speculator, sampler: Sampler):
        self.speculator = speculator
        self.sampler = sampler
        self._plain = PlainDecoding(sampler)

    def accepts(self, params: SamplingParams) -> bool:
        # A grammar's matcher follows one token at a time: drafting past it would need rollback.
        return params.speculative and params.constraint is None

    def check(self, prompt_len: int, params: SamplingParams) -> Footprint:
        return self._plain.check(prompt_len, params)

    async def prepare(self, batch: Batch) -> Batch:
        return await self.speculator.extend(batch)

    def update(self, batch: Batch, rows: list[int], seqs: list[Sequence | None],
               logits: list[np.ndarray | None]) -> list[StepOutcome]:
        if batch.phase is not Phase.SPECULATE:
            return self._plain.update(batch, rows, seqs, logits)
        kept = self.speculator.verify(batch, rows, seqs, logits, self.sampler)
        return [Advance(seqs[i], samples) for i, samples in zip(rows, kept)]
