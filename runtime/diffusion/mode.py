"""Diffusion LMs as a generation mode: each pass commits positions of a sequence's canvas;
what is committed after its tokens without a gap is taken, left to right, as if sampled one
by one, and a full canvas ends it. With APD, the verifier's calls run on its own model."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..batch import Batch, Phase
from ..contract import Capabilities
from ..errors import InvalidRequestError
from ..executor import Executor
from ..finishing import Finish
from ..generation_mode import Advance, Footprint, GenerationMode, StepOutcome
from ..request import Request, Sequence
from ..sampling import SampleResult, SamplingParams
from .checks import check_diffusion_request
from .scheduler import DiffusionScheduler


@dataclass
class DiffusionCounters:
    # Passes by what they computed ("full", "prefix", "dual", "apd"), and how many passes
    # committed each number of positions (the tokens-per-forward histogram).
    forward_passes: dict = field(default_factory=dict)
    committed_per_pass: dict = field(default_factory=dict)


class DiffusionDecoding(GenerationMode):
    name = "diffusion"
    counts_max_tokens = False  # the canvas is max_tokens rounded up to whole blocks

    def __init__(self, scheduler: DiffusionScheduler, capabilities: Capabilities, verifier: Executor | None = None):
        """`verifier`, with APD: the autoregressive model that runs the scheduler's VERIFY batches."""
        self.scheduler = scheduler
        self.capabilities = capabilities
        self.verifier = verifier
        self.counters = DiffusionCounters()

    def check(self, prompt_len: int, params: SamplingParams) -> Footprint:
        if params.constraint is not None:
            raise InvalidRequestError("structured output is not available for diffusion models",
                                      param=params.constraint.param)
        if params.beam_search:
            raise InvalidRequestError("beam search is for autoregressive models", param="num_beams")
        plan = check_diffusion_request(params, self.capabilities)
        tokens = prompt_len + plan.canvas_length
        if plan.params.apd:
            verifier_cache = self.scheduler.verifier_cache
            if self.verifier is None:
                raise InvalidRequestError("apd_mixture_weight needs a server started with an APD verifier "
                                          "(--apd-verifier)", param="apd_mixture_weight")
            if verifier_cache.pages_for(tokens) > verifier_cache.page_pool.total:
                raise InvalidRequestError("the request needs more pages than the APD verifier's cache has",
                                          param="max_tokens")
        return Footprint(tokens, copies=2 if plan.params.cfg_scale else 1)

    def start(self, request: Request) -> None:
        params = request.params
        request.canvas_tokens = params.diffusion.plan(params.max_tokens).canvas_length

    def executors(self) -> dict[Phase, Executor]:
        return {Phase.VERIFY: self.verifier} if self.verifier is not None else {}

    def update(self, batch: Batch, rows: list[int], seqs: list[Sequence | None],
               logits: list[np.ndarray | None]) -> list[StepOutcome]:
        outcomes = []
        counters = self.counters
        for update in self.scheduler.commit(batch, logits):
            canvas = update.seq.mode_state
            kind, committed = canvas.last_pass_kind, canvas.committed_per_pass[-1]
            counters.forward_passes[kind] = counters.forward_passes.get(kind, 0) + 1
            counters.committed_per_pass[committed] = counters.committed_per_pass.get(committed, 0) + 1
            outcomes.append(Advance(update.seq, [SampleResult(token) for token in update.tokens],
                                    Finish("length") if update.canvas_done else None))
        return outcomes
