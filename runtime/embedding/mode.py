"""Embeddings as a generation mode: a request with `pooling` set is prefilled through
embed_bs<N> (the scheduler gives its chunks their own calls) and ends once its last chunk has
run, with the pooled vector on its last event; it samples no token. Last-token pooling skips a
cached prefix as prefill does (the last token is always computed); mean and CLS pooling read
every position, so their prompts are computed whole (Sequence.computes_whole_prompt)."""

from __future__ import annotations

import numpy as np

from ..batch import Batch
from ..contract import Capabilities
from ..errors import InvalidRequestError
from ..finishing import Finish
from ..generation_mode import Advance, Footprint, GenerationMode, StepOutcome
from ..pooling import PooledState
from ..request import Request, Sequence
from ..sampling import SamplingParams


NO_EMBED_FUNCTIONS = ("this model was built without embedding functions: serve it with --embeddings (or a "
                      "`kiln build --embeddings` directory)")


class Embedding(GenerationMode):
    name = "embedding"
    counts_max_tokens = False

    def __init__(self, abi: Capabilities):
        self.abi = abi

    def accepts(self, params: SamplingParams) -> bool:
        return params.pooling is not None

    def check(self, prompt_len: int, params: SamplingParams) -> Footprint:
        abi = self.abi
        if not abi.embed_batch_sizes:
            raise InvalidRequestError(NO_EMBED_FUNCTIONS, param="model")
        if params.n != 1 or params.num_beams != 1 or params.prompt_logprobs is not None or params.constraint:
            raise InvalidRequestError("an embedding request generates nothing: n, beams, prompt logprobs and "
                                      "structured output do not apply", param="input")
        dimensions = params.pooling.dimensions
        if dimensions is not None and not 0 < dimensions <= abi.hidden_size:
            raise InvalidRequestError(f"dimensions must be between 1 and the model's {abi.hidden_size}, "
                                      f"got {dimensions}", param="dimensions")
        if prompt_len > abi.max_seq_len:
            raise InvalidRequestError(f"the input is {prompt_len} tokens, more than this model's context of "
                                      f"{abi.max_seq_len}", param="input")
        return Footprint(prompt_len)

    def start(self, request: Request) -> None:
        for seq in request.sequences:
            seq.mode_state = PooledState(request.params.pooling)

    def update(self, batch: Batch, rows: list[int], seqs: list[Sequence | None],
               hidden: list[np.ndarray | None]) -> list[StepOutcome]:
        outcomes = []
        for i in rows:
            if hidden[i] is None:  # a chunk before the last, under last-token pooling: nothing to keep
                continue
            state: PooledState = seqs[i].mode_state
            state.add_chunk(batch.starts[i], hidden[i])
            if batch.samples[i]:  # the prompt's last chunk
                outcomes.append(Advance(seqs[i], [], end=Finish("stop"), embedding=state.result(hidden[i])))
        return outcomes
