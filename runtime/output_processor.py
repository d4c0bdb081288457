"""From what a step decided to what callers read: Events, with their text, logprobs and ends.

It decides nothing: the text a token releases and whether the sequence ends there come
from runtime/finishing.py. It keeps each sequence's prompt logprobs while its prompt is
prefilled, and sends them with the first event.
"""

from __future__ import annotations

import numpy as np

from .batch import Batch, Phase
from .finishing import TakenToken
from .request import Event, Request, Sequence, TokenLogprob
from .sampling import SampleResult, compute_logprobs_rows


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # Prompt logprobs by position while a prompt is prefilled (sequence 0 of requests that
        # ask for them), until sent.
        self._prompt_logprobs: dict[int, dict[int, TokenLogprob]] = {}

    def add(self, request: Request) -> None:
        if request.params.prompt_logprobs is not None and request.sequences:
            self._prompt_logprobs[request.sequences[0].seq_id] = {}

    def record_prompt_logprobs(self, batch: Batch, seqs: list[Sequence | None], logits: list) -> None:
        """Keep the prompt logprobs a prefill's rows with every position's logits score."""
        if batch.phase is not Phase.PREFILL:
            return
        for seq, start, full, row_logits in zip(seqs, batch.starts, batch.full_logits, logits):
            if seq is not None and full and row_logits is not None:
                self._record(seq, start, row_logits)

    def _record(self, seq: Sequence, start: int, logits: np.ndarray) -> None:
        """Logits [L, V] at positions start.. score prompt tokens start+1..: keep those, by position."""
        found = self._prompt_logprobs.get(seq.seq_id)
        if found is None:
            return
        count = min(len(logits), seq.prompt_len - 1 - start)
        if count <= 0:
            return
        targets = seq.tokens[start + 1 : start + 1 + count]
        rows = compute_logprobs_rows(logits[:count], targets, seq.params.prompt_logprobs)
        for offset, (token, (logprob, top)) in enumerate(zip(targets, rows)):
            found[start + 1 + offset] = TokenLogprob(token, logprob, top)

    def _take_prompt_logprobs(self, seq: Sequence) -> list[TokenLogprob | None] | None:
        """The prompt's logprobs in order, once (after its prefill); None afterwards."""
        found = self._prompt_logprobs.pop(seq.seq_id, None)
        if found is None:
            return None
        return [None] + [found.get(position) for position in range(1, seq.prompt_len)]

    def token(self, seq: Sequence, sample: SampleResult, taken: TakenToken) -> None:
        """The event for a token a sequence took: its text, its logprob, and its end if it ended."""
        finish = taken.finish
        logprobs = [] if sample.logprob is None else \
            [TokenLogprob(sample.token_id, sample.logprob, sample.top_logprobs or {})]
        error = finish.error if finish is not None else None
        seq.emit(Event(seq.index, text=taken.text, token_ids=[sample.token_id], logprobs=logprobs,
                       prompt_logprobs=self._take_prompt_logprobs(seq),
                       finish_reason=finish.reason if finish is not None else None,
                       stop_reason=finish.stop_reason if finish is not None and not error else None,
                       error=error, error_param=seq.params.constraint.param if error else None))

    def finish(self, seq: Sequence, reason: str, error: str | None = None, embedding=None) -> None:
        """The last event of a sequence that ended without a token (aborted, failed, a full
        canvas, an embedding computed). A beam search's sequences past its n are slots, never
        seen by the caller."""
        self._prompt_logprobs.pop(seq.seq_id, None)
        if seq.index < seq.params.n:
            seq.emit(Event(seq.index, finish_reason=reason, error=error, embedding=embedding))

    def search_finished(self, request: Request, hypotheses) -> None:
        """A search's results (runtime.beam_search.Hypothesis), the best first: each whole, in one
        event each."""
        skip = request.params.skip_special_tokens
        for index, hypothesis in enumerate(hypotheses):
            request.sequences[index].emit(Event(
                index, text=self.tokenizer.decode(hypothesis.tokens, skip_special_tokens=skip),
                token_ids=list(hypothesis.tokens), finish_reason=hypothesis.finish_reason,
                stop_reason=hypothesis.stop_token, cumulative_logprob=hypothesis.logprob))
        for index in range(len(hypotheses), request.params.n):  # fewer hypotheses than asked: none is lost
            request.sequences[index].emit(Event(index, finish_reason="stop"))
