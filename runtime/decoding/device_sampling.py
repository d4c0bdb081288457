"""Which batches the compiled sampler (sample_bs<N>, export/device_sampling.py) chooses tokens for.

A batch goes to it whole or not at all: every row that samples must be a plain decoding row the
host sampler would treat only with temperature, top-k, top-p and min-p (Sampler.device_settings),
and the export must have a sampler of the batch's size after a function that returns only last
logits. Each such row's one uniform number is drawn here, from its own generator, where the host
sampler would have drawn it, so a seeded request takes the same tokens either way.
"""

from __future__ import annotations

from dataclasses import replace

from ..batch import Batch, Phase
from ..contract import Capabilities
from ..request import Sequence
from ..sampling import Sampler
from .mode import PlainDecoding

# A row that samples nothing (a prompt chunk before its last): greedy, its token never read.
_IDLE_ROW = (0.0, 0, 1.0, 0.0, 0.0)


class DeviceSampling:
    def __init__(self, abi: Capabilities, sampler: Sampler):
        self.abi = abi
        self.sampler = sampler

    def plan(self, batch: Batch, seqs: list[Sequence | None]) -> Batch:
        """`batch` with device_sampling filled in where the compiled sampler can choose its tokens."""
        if not self._fits(batch):
            return batch
        settings = []
        for seq, samples in zip(seqs, batch.samples):
            if not samples:
                settings.append(None)
                continue
            if seq is None or seq.request.mode != PlainDecoding.name:
                return batch
            row = self.sampler.device_settings(seq)
            if row is None:
                return batch
            settings.append(row)
        # A greedy row draws nothing, as on the host.
        rows = tuple(_IDLE_ROW if row is None else (*row, float(seq.rng.random()) if row[0] else 0.0)
                     for row, seq in zip(settings, seqs))
        return replace(batch, device_sampling=rows)

    def _fits(self, batch: Batch) -> bool:
        if batch.batch_size not in self.abi.sample_batch_sizes or not any(batch.samples) or any(batch.full_logits):
            return False
        if batch.phase is Phase.DECODE:
            return True
        return batch.phase is Phase.PREFILL and self.abi.prefill_function(batch.batch_size, False)[1]
