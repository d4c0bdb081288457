"""Plain decoding as a generation mode: each row that samples (a completed prompt, a decode
row) takes one token from its last position's logits, through the sampler (penalties,
grammars, logprobs)."""

from __future__ import annotations

import numpy as np

from ..batch import Batch
from ..errors import InvalidRequestError
from ..generation_mode import Advance, Footprint, GenerationMode, StepOutcome, last_position
from ..request import Sequence
from ..sampling import SampleResult, Sampler, SamplingParams


def autoregressive_footprint(prompt_len: int, params: SamplingParams) -> Footprint:
    """One token a step, up to max_tokens, in one set of pages; a diffusion LM's options refused."""
    if params.diffusion is not None:
        first = params.diffusion.first_given()
        raise InvalidRequestError(f"{first} applies only to diffusion models; this model is autoregressive",
                                  param=first)
    return Footprint(prompt_len + params.max_tokens)


class PlainDecoding(GenerationMode):
    name = "decoding"

    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def check(self, prompt_len: int, params: SamplingParams) -> Footprint:
        return autoregressive_footprint(prompt_len, params)

    def update(self, batch: Batch, rows: list[int], seqs: list[Sequence | None],
               logits: list[np.ndarray | SampleResult | None]) -> list[StepOutcome]:
        """A row the compiled sampler chose for (runtime/decoding/device_sampling.py) comes as its
        token; the rest as logits, sampled here."""
        sampling = [i for i in rows if batch.samples[i]]
        on_host = [i for i in sampling if not isinstance(logits[i], SampleResult)]
        chosen = dict(zip(on_host, self.sampler.sample_rows([last_position(logits[i]) for i in on_host],
                                                            [seqs[i] for i in on_host])))
        return [Advance(seqs[i], [chosen[i] if i in chosen else logits[i]]) for i in sampling]
