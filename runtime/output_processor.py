"""From a step's tokens to what callers read: text, stop strings, logprobs, Events.

The one owner of each sequence's detokenizer and stop-string checker. It changes no
sequence's state: a stop string it finds is handed back, and the scheduler finishes
that sequence.
"""

from __future__ import annotations

import numpy as np

from .detokenizer import IncrementalDetokenizer, StopChecker
from .request import Event, Request, Sequence, TokenLogprob
from .sampling import SampleResult, compute_logprobs_rows
from .scheduler import Finish


class _SequenceText:
    """One sequence's text state: its detokenizer, its stop checker, its prompt logprobs so far."""

    def __init__(self, seq: Sequence, tokenizer):
        params = seq.params
        self.detokenizer = IncrementalDetokenizer(tokenizer, seq.prompt_ids,
                                                  skip_special_tokens=params.skip_special_tokens)
        self.stop_checker = StopChecker(params.stop)
        # Prompt logprobs by position while the prompt is prefilled; None once sent (or never wanted).
        wanted = seq.index == 0 and params.prompt_logprobs is not None
        self.prompt_logprobs: dict[int, TokenLogprob] | None = {} if wanted else None

    def take_prompt_logprobs(self, prompt_len: int) -> list[TokenLogprob | None] | None:
        """The prompt's logprobs in order, once (after its prefill); None afterwards."""
        found, self.prompt_logprobs = self.prompt_logprobs, None
        if found is None:
            return None
        return [None] + [found.get(position) for position in range(1, prompt_len)]


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, _SequenceText] = {}

    def add(self, request: Request) -> None:
        for seq in request.sequences:
            self._texts[seq.seq_id] = _SequenceText(seq, self.tokenizer)

    def record_prompt_logprobs(self, seq: Sequence, start: int, logits: np.ndarray) -> None:
        """Logits [L, V] at positions start.. score prompt tokens start+1..: keep those, by position."""
        state = self._texts[seq.seq_id]
        if state.prompt_logprobs is None:
            return
        count = min(len(logits), seq.prompt_len - 1 - start)
        if count <= 0:
            return
        targets = seq.tokens[start + 1 : start + 1 + count]
        rows = compute_logprobs_rows(logits[:count], targets, seq.params.prompt_logprobs)
        for offset, (token, (logprob, top)) in enumerate(zip(targets, rows)):
            state.prompt_logprobs[start + 1 + offset] = TokenLogprob(token, logprob, top)

    def token(self, seq: Sequence, sample: SampleResult, finish: Finish | None) -> bool:
        """Emit the event for a token the scheduler appended (and maybe finished on).

        Returns True when a stop string ended the text here: the sequence must finish.
        """
        state = self._texts[seq.seq_id]
        token = sample.token_id
        # An EOS or stop token ends the text without being part of it.
        delta = "" if finish is not None and finish.stop_token is not None else state.detokenizer.add(token)
        text, stopped = state.stop_checker.feed(delta)
        reason = "stop" if stopped else (finish.reason if finish else None)
        stop_reason = state.stop_checker.matched if stopped else (finish.stop_token if finish else None)
        if reason is not None and not stopped:
            # Release what the detokenizer and the stop checker still hold.
            tail, stopped = state.stop_checker.feed(state.detokenizer.flush())
            text += tail
            if stopped:
                reason, stop_reason = "stop", state.stop_checker.matched
            else:
                text += state.stop_checker.finish()
        logprobs = [] if sample.logprob is None else [TokenLogprob(token, sample.logprob, sample.top_logprobs or {})]
        # The last event carries the last token and the reason together.
        error = finish.error if finish is not None and reason == finish.reason else None
        seq.emit(Event(seq.index, text=text, token_ids=[token], logprobs=logprobs,
                       prompt_logprobs=state.take_prompt_logprobs(seq.prompt_len),
                       finish_reason=reason, stop_reason=None if error else stop_reason, error=error,
                       error_param=seq.params.constraint.param if error else None))
        if reason is not None:
            del self._texts[seq.seq_id]
        return stopped

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """The last event of a sequence ended from outside a step: aborted, or failed. (A beam
        search's sequences past its n are slots, never seen by the caller.)"""
        if self._texts.pop(seq.seq_id, None) is not None and seq.index < seq.params.n:
            seq.emit(Event(seq.index, finish_reason=reason, error=error))

    def beams_finished(self, request: Request, hypotheses) -> None:
        """A beam search's result, the best first: each hypothesis whole, in one event each."""
        for seq in request.sequences:
            self._texts.pop(seq.seq_id, None)
        skip = request.params.skip_special_tokens
        for index, hypothesis in enumerate(hypotheses):
            request.sequences[index].emit(Event(
                index, text=self.tokenizer.decode(hypothesis.tokens, skip_special_tokens=skip),
                token_ids=list(hypothesis.tokens), finish_reason=hypothesis.finish_reason,
                stop_reason=hypothesis.stop_token, cumulative_logprob=hypothesis.logprob))
        for index in range(len(hypotheses), request.params.n):  # fewer hypotheses than asked: none is lost
            request.sequences[index].emit(Event(index, finish_reason="stop"))
