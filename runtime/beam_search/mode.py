"""Beam search as a generation mode: each beam's next-token logits are reported to its group;
once every live beam has reported, the group chooses, slots that continue another beam take
its tokens (their pages go back; the parent's full pages come back through the prefix cache),
and a finished search ends all its sequences with its best hypotheses."""

from __future__ import annotations

import numpy as np

from ..batch import Batch
from ..decoding import autoregressive_footprint
from ..errors import InvalidRequestError
from ..finishing import Stopping
from ..generation_mode import Footprint, GenerationMode, SearchDone, StepOutcome, last_position
from ..request import Request, Sequence
from ..sampling import SamplingParams
from ..scheduler import Scheduler
from .group import BeamGroup, Choice

# What beam search cannot honour, refused by name rather than ignored: field -> whether it is used.
_REFUSED = {
    "stop": lambda p: bool(p.stop), "logprobs": lambda p: p.logprobs is not None,
    "prompt_logprobs": lambda p: p.prompt_logprobs is not None, "min_tokens": lambda p: p.min_tokens > 0,
    "logit_bias": lambda p: bool(p.logit_bias), "constraint": lambda p: p.constraint is not None,
    "repetition_penalty": lambda p: p.repetition_penalty != 1.0,
    "presence_penalty": lambda p: p.presence_penalty != 0.0,
    "frequency_penalty": lambda p: p.frequency_penalty != 0.0,
}


class BeamSearch(GenerationMode):
    name = "beam_search"

    def __init__(self, scheduler: Scheduler, stopping: Stopping):
        self.scheduler = scheduler
        self.stopping = stopping

    def accepts(self, params: SamplingParams) -> bool:
        return params.beam_search

    def check(self, prompt_len: int, params: SamplingParams) -> Footprint:
        """Beams step together, in one decode call: the export and the engine must hold them all."""
        if params.n > params.num_beams:
            raise InvalidRequestError(f"n ({params.n}) must not exceed the beam width ({params.num_beams})",
                                      param="n")
        for name, used in _REFUSED.items():
            if used(params):
                param = params.constraint.param if name == "constraint" else name
                raise InvalidRequestError(f"{param} is not available with beam search", param=param)
        config = self.scheduler.config
        widest = min(config.decode_batch_sizes[-1], config.max_running)
        if params.num_beams > widest:
            raise InvalidRequestError(f"num_beams must be at most {widest} (the largest decode batch this server "
                                      "runs)", param="num_beams")
        return Footprint(autoregressive_footprint(prompt_len, params).tokens, copies=params.num_beams)

    def start(self, request: Request) -> None:
        request.mode_state = BeamGroup(request.params.num_beams, request.params.length_penalty)

    def update(self, batch: Batch, rows: list[int], seqs: list[Sequence | None],
               logits: list[np.ndarray | None]) -> list[StepOutcome]:
        outcomes = []
        for i in rows:
            if not batch.samples[i]:
                continue
            seq = seqs[i]
            request, group = seq.request, seq.request.mode_state
            if not group.report(seq.index, last_position(logits[i])):
                continue  # other beams of the search have yet to report
            params = request.params
            generated = [s.output_ids for s in request.sequences[: group.live]]
            choices = group.step(generated, self.stopping.end_tokens(params), params.max_tokens)
            self._continue(request, choices)
            if group.done:
                outcomes.append(SearchDone(request, group.ranked(params.n)))
        return outcomes

    def _continue(self, request: Request, choices: list[Choice]) -> None:
        """Each slot continues the beam its choice names with its token. A slot continuing another
        beam drops its pages and takes that beam's tokens; the parent's full pages, published
        first, come back to it through the prefix cache."""
        beams = request.sequences
        old = [list(b.tokens) for b in beams]
        for beam in beams:
            self.scheduler.publish(beam)
        for slot, choice in enumerate(choices):
            beam = beams[slot]
            if choice.parent == slot:
                beam.append(choice.token)
            else:
                self.scheduler.restart_from(beam, old[choice.parent] + [choice.token])
