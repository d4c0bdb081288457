"""The one place a sequence's end is decided: once per token it takes, whatever its mode.

Every token a step gives a sequence, sampled, kept from a draft or committed on a canvas,
passes through `Stopping.take`, which appends it, turns it into text and says whether the
sequence ends there: a grammar at a dead end, an EOS or stop token, a stop string completed
in the text, a grammar complete, max_tokens or the context reached, or the end its mode
reports (a diffusion canvas full). Aborts and failures end a sequence from outside a step
(`Stopping.drop`). Beam search ends hypotheses inside its own rule (runtime/beam_search),
with the end tokens this module names.

It owns each sequence's detokenizer and stop-string checker, because a stop string is found
in text: the output processor only formats what this module decided.
"""

from __future__ import annotations

from dataclasses import dataclass

from .detokenizer import IncrementalDetokenizer, StopChecker
from .request import Request, Sequence
from .sampling import SamplingParams


@dataclass(frozen=True)
class Finish:
    """How a sequence ended: "stop" on an EOS or stop token (`stop_token`), a stop string
    (`stop_string`) or a completed grammar (neither), "length", or "error" where its grammar
    allows no token to continue (`error` says why; `stop_token` is then the end token the
    grammar forced, not text)."""

    reason: str
    stop_token: int | None = None
    stop_string: str | None = None
    error: str | None = None

    @property
    def stop_reason(self) -> str | int | None:
        """What OpenAI-style APIs report as the stop: the string or token that ended it."""
        return self.stop_string if self.stop_string is not None else self.stop_token


@dataclass(frozen=True)
class TakenToken:
    """One token taken: the text it releases (what follows a stop string held back, and the
    stop string too unless the request includes it), and the sequence's end if it ends here."""

    text: str
    finish: Finish | None


class _TextState:
    """One sequence's text so far: its detokenizer and its stop-string checker."""

    def __init__(self, seq: Sequence, tokenizer):
        params = seq.params
        self.detokenizer = IncrementalDetokenizer(tokenizer, seq.prompt_ids,
                                                  skip_special_tokens=params.skip_special_tokens)
        self.stop_checker = StopChecker(params.stop, params.include_stop_str_in_output)


class Stopping:
    def __init__(self, tokenizer, eos_token_ids=(), max_seq_len: int | None = None):
        """`max_seq_len`: the context a sequence may fill (None: its mode bounds its length)."""
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_seq_len = max_seq_len
        self._texts: dict[int, _TextState] = {}

    def add(self, request: Request) -> None:
        for seq in request.sequences:
            self._texts[seq.seq_id] = _TextState(seq, self.tokenizer)

    def drop(self, seq: Sequence) -> None:
        """Forget a sequence ended from outside a step (or by its beam search)."""
        self._texts.pop(seq.seq_id, None)

    def end_tokens(self, params: SamplingParams) -> frozenset[int]:
        """The tokens that end a sequence of these params (not part of its text)."""
        eos = self.eos_token_ids if not params.ignore_eos else frozenset()
        return eos | frozenset(params.stop_token_ids)

    def take(self, seq: Sequence, token: int, mode_end: Finish | None = None,
             counts_max_tokens: bool = True) -> TakenToken:
        """Append a token to `seq` and decide whether it ends there. `mode_end`: the end its mode
        reports after this token, applied when no rule ends it first; `counts_max_tokens`: whether
        max_tokens and the context bound it (a diffusion canvas has its own length)."""
        seq.append(token)
        finish = self._token_rule(seq, token, counts_max_tokens) or mode_end
        state = self._texts[seq.seq_id]
        # An EOS or stop token ends the text without being part of it.
        delta = "" if finish is not None and finish.stop_token is not None else state.detokenizer.add(token)
        # As min_tokens holds back the end tokens, it holds back the stop strings: none ends the
        # text before it has that many tokens (vLLM's rule: from the min_tokens-th on).
        may_stop = seq.generated >= seq.params.min_tokens
        text, stopped = state.stop_checker.feed(delta, may_stop)
        if not stopped and finish is not None:
            # Release what the detokenizer and the stop checker still hold.
            tail, stopped = state.stop_checker.feed(state.detokenizer.flush(), may_stop)
            text += tail
            if not stopped:
                text += state.stop_checker.finish()
        if stopped:
            finish = Finish("stop", stop_string=state.stop_checker.matched)
        if finish is not None:
            del self._texts[seq.seq_id]
        return TakenToken(text, finish)

    def _token_rule(self, seq: Sequence, token: int, counts_max_tokens: bool) -> Finish | None:
        params, matcher = seq.params, seq.matcher
        if matcher is not None and matcher.error is not None:
            # The grammar hit a dead end: the text cannot be completed, so it never says "stop".
            return Finish("error", token, error=f"{params.constraint.param}: no output can satisfy it "
                                                f"({matcher.error})")
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return Finish("stop", token)
        if matcher is not None and matcher.finished:
            return Finish("stop")  # the grammar is complete: its last token is part of the text
        if counts_max_tokens and (seq.generated >= params.max_tokens or
                                  (self.max_seq_len is not None and len(seq.tokens) >= self.max_seq_len)):
            return Finish("length")
        return None
