"""From generated token ids to streamed text: UTF-8 safe deltas, and stop strings cut exactly.

Byte-level BPE tokens can end in the middle of a character, so text is released only once
it decodes cleanly; and text that may be the start of a stop string waits until it is not.
"""

from __future__ import annotations

from typing import Sequence

from tokenizers import Tokenizer

# Prompt tokens decoded ahead of the first output token, so that decoders which treat the
# first token specially (a stripped leading space) see the output in context, as vLLM does.
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Decodes a window [prefix_offset, end) of the ids each step, never the whole output.

    `prefix_text` is the decoding of [prefix_offset, read_offset), already emitted; the new
    text is what the window adds to it, released once it does not end in a partial character.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # decoded lazily after the offsets move
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._chunks)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (often "", e.g. mid-character)."""
        self._ids.append(int(token_id))
        prefix = self._prefix()
        new = self._decode(self._ids[self._prefix_offset :])
        if len(new) <= len(prefix) or new.endswith(_REPLACEMENT):
            return ""
        return self._advance(new[len(prefix) :])

    def flush(self) -> str:
        """The text still held at the end (with U+FFFD if the model really produced bad bytes)."""
        if self._read_offset == len(self._ids):
            return ""
        prefix = self._prefix()
        new = self._decode(self._ids[self._prefix_offset :])
        return self._advance(new[len(prefix) :])

    def _prefix(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        return self._prefix_text

    def _advance(self, delta: str) -> str:
        # The old read position starts the next window; keep only the ids the window needs.
        del self._ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self._prefix_text = None
        if delta:
            self._chunks.append(delta)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


class _StopAutomaton:
    """Aho-Corasick over the stop strings: each character of text is one step, however many
    strings there are. A state's depth is the longest suffix of the text so far that begins
    some stop string: exactly what must be held back."""

    def __init__(self, patterns: Sequence[str]):
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]
        self.fail = [0]
        self.match: list[str | None] = [None]  # the longest stop string ending at a state
        for pattern in patterns:
            state = 0
            for ch in pattern:
                nxt = self.goto[state].get(ch)
                if nxt is None:
                    nxt = len(self.goto)
                    self.goto[state][ch] = nxt
                    self.goto.append({})
                    self.depth.append(self.depth[state] + 1)
                    self.fail.append(0)
                    self.match.append(None)
                state = nxt
            self.match[state] = pattern
        queue = list(self.goto[0].values())
        for state in queue:  # breadth first: a state's fail link is shallower, so already final
            for ch, child in self.goto[state].items():
                queue.append(child)
                self.fail[child] = self.step(self.fail[state], ch)
                if self.match[child] is None:
                    self.match[child] = self.match[self.fail[child]]

    def step(self, state: int, ch: str) -> int:
        while state and ch not in self.goto[state]:
            state = self.fail[state]
        return self.goto[state].get(ch, 0)


class StopChecker:
    """Finds the first stop string to complete in streamed text, across deltas, and holds
    back whatever could still be the start of one. The work per character does not grow with
    the number of stop strings.

    With `include_stop` (vLLM's include_stop_str_in_output) the text ends with the stop string
    instead of before it, so nothing needs holding back: text that may begin one is part of
    the output either way.

        emit, stopped = checker.feed(delta)   # stream `emit`; on `stopped`, finish the sequence
        tail = checker.finish()               # at the end without a stop: the held text
    """

    def __init__(self, stop: Sequence[str] = (), include_stop: bool = False):
        self.stop = [s for s in stop if s]
        self.include_stop = include_stop
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text
        self._automaton = _StopAutomaton(self.stop) if self.stop else None
        self._state = 0
        self._held = ""
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """All text released so far: once stopped, the output cut right before the stop string
        (right after it, with `include_stop`)."""
        return "".join(self._chunks)

    def feed(self, delta: str, may_stop: bool = True) -> tuple[str, bool]:
        """Add decoded text; return (text safe to stream now, whether a stop string matched).
        With `may_stop` false (min_tokens not reached yet) a stop string completed in `delta`
        is text like any other, though one begun in it may still complete in a later delta."""
        if self.stopped:
            return "", True
        automaton = self._automaton
        if automaton is None:
            return self._emit(delta), False
        # Unless the stop string is included, `_held` is exactly the text the automaton's state
        # stands for: a match ends in `delta` and starts inside `buf`.
        buf = self._held + delta
        state = self._state
        for offset, ch in enumerate(delta):
            state = automaton.step(state, ch)
            found = automaton.match[state]
            if found is not None and may_stop:  # the first stop string to complete (the longest, if several)
                end = len(self._held) + offset + 1
                self.stopped, self.matched, self._held = True, found, ""
                return self._emit(buf[: end if self.include_stop else end - len(found)]), True
        self._state = state
        hold = 0 if self.include_stop else automaton.depth[state]
        self._held = buf[len(buf) - hold :] if hold else ""
        return self._emit(buf[: len(buf) - hold]), False

    def finish(self) -> str:
        """Release the held text (nothing if a stop string matched)."""
        held, self._held = self._held, ""
        self._state = 0
        return "" if self.stopped else self._emit(held)

    def _emit(self, text: str) -> str:
        if text:
            self._chunks.append(text)
        return text
