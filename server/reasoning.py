"""Reasoning output (`kiln serve --reasoning-parser`): what a reasoning model thinks between
`<think>` and `</think>`, split from its answer, as vLLM and SGLang return it: the thinking in
`reasoning_content`, the answer in `content`.

The split reads text, with the tags matched as strings, so it needs nothing from the tokenizer;
while a reply streams, a tail that may be the start of a tag is held back until it is known, so
neither field ever shows part of a tag. Tool calls and structured output apply to the answer:
the routes parse calls from the content alone, and a grammar starts after the end tag
(runtime/grammar.py's `Constraint.after`).

The parsers, by vLLM's names (vllm/reasoning/), with vLLM's current behaviour:
- "deepseek_r1": the chat template opens `<think>` itself, so the reply starts in the
  reasoning (a `<think>` the model writes anyway is dropped); it ends at `</think>`, and a
  reply that never closes it is all reasoning (cut short by max_tokens, say).
- "qwen3": the same, and `chat_template_kwargs: {"enable_thinking": false}` turns reasoning off
  for the request (vLLM's Qwen3ReasoningParser reads that flag; Qwen3's template then writes an
  empty, closed think block into the prompt).
Either way, a prompt whose last think tag is `</think>` has closed the block before the reply
began (Qwen3's and DeepSeek-V3.1's templates with thinking off), and the whole reply is the answer
(vLLM's `prompt_is_reasoning_end`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.runtime.grammar import Constraint


THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    """How a model's replies mark their reasoning."""

    name: str
    start: str = THINK_START
    end: str = THINK_END
    honours_enable_thinking: bool = False  # chat_template_kwargs' enable_thinking false turns it off

    def thinks(self, prompt: str, template_kwargs: dict[str, Any] | None = None) -> bool:
        """Whether the reply to this rendered prompt begins in the reasoning: not when the
        request turned thinking off, nor when the prompt's last think tag closes the block."""
        if self.honours_enable_thinking and (template_kwargs or {}).get("enable_thinking") is False:
            return False
        closed = prompt.rfind(self.end) > prompt.rfind(self.start)
        return not closed

    def splitter(self, thinking: bool = True) -> ReasoningSplitter:
        return ReasoningSplitter(self.start, self.end, thinking)

    def split(self, text: str, thinking: bool = True) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole reply; None where there is none. Without thinking the
        reply is all content, as given (empty included); with it, an empty content is None, as
        vLLM returns a reply that stops right after `</think>`."""
        if not thinking:
            return None, text
        splitter = self.splitter()
        reasoning, content = splitter.feed(text)
        tail_reasoning, tail_content = splitter.finish()
        return (reasoning + tail_reasoning) or None, (content + tail_content) or None

    def reasoning_tokens(self, token_texts: list[str]) -> int:
        """How many of a reply's tokens (each one's own text) belong to its reasoning: those up to
        the one that completes the end tag, or all of them when it never comes."""
        tail = ""  # the text before this token, as much as a tag split across tokens needs
        for count, text in enumerate(token_texts, 1):
            window = tail + text
            if self.end in window:
                return count
            tail = window[-(len(self.end) - 1):]
        return len(token_texts)


PARSERS: dict[str, ReasoningParser] = {
    "deepseek_r1": ReasoningParser("deepseek_r1"),
    "qwen3": ReasoningParser("qwen3", honours_enable_thinking=True),
}


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser of that name; None for none; ValueError naming the choices for another."""
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}: choose from {', '.join(PARSERS)}")
    return PARSERS[name]


class ReasoningSplitter:
    """One reply's text, fed as it streams, split into reasoning and content.

    It starts in the reasoning (or, without thinking, in the content), drops one `<think>` the
    reply may open with (after whitespace), and moves to the content after the first `</think>`.
    A tail that may still become a tag is held, and released by `finish` as plain text if it
    never does."""

    _OPENING, _REASONING, _CONTENT = "opening", "reasoning", "content"

    def __init__(self, start: str = THINK_START, end: str = THINK_END, thinking: bool = True):
        self.start, self.end = start, end
        self._phase = self._OPENING if thinking else self._CONTENT
        self._held = ""

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) that may go out now, either possibly empty."""
        text, self._held = self._held + delta, ""
        reasoning = ""
        if self._phase == self._OPENING:
            opened = text.lstrip()
            if opened.startswith(self.start):
                text, self._phase = opened[len(self.start):], self._REASONING
            elif self.start.startswith(opened):  # only whitespace, or the tag's beginning, so far
                self._held = text
                return "", ""
            else:
                self._phase = self._REASONING
        if self._phase == self._REASONING:
            at = text.find(self.end)
            if at < 0:
                keep = _partial_suffix(text, self.end)
                self._held = text[len(text) - keep:] if keep else ""
                return text[:len(text) - keep], ""
            reasoning, text, self._phase = text[:at], text[at + len(self.end):], self._CONTENT
        return reasoning, text

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) still held once the reply has ended: a partial tag is just text."""
        held, self._held = self._held, ""
        return ("", held) if self._phase == self._CONTENT else (held, "")


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a beginning of `tag` (shorter than it)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


class ReplyReasoning:
    """One request's reply, as the parser divides it: whether it begins in the reasoning (the
    request may turn thinking off, or its prompt close the think block), and so where its
    structured-output grammar starts and what its message holds."""

    def __init__(self, parser: ReasoningParser | None, prompt: str, template_kwargs: dict[str, Any] | None = None,
                 include_reasoning: bool = True):
        self.parser = parser
        self.thinking = parser is not None and parser.thinks(prompt, template_kwargs)
        self.include_reasoning = include_reasoning  # vLLM's field: false leaves the reasoning out

    def constrain_answer(self, constraint: Constraint | None) -> Constraint | None:
        """The constraint, applied after the reasoning when the reply begins in it: structured
        output binds the answer, never the thinking (vLLM's rule)."""
        if constraint is None or not self.thinking:
            return constraint
        return constraint.after(self.parser.end)

    def splitter(self) -> ReasoningSplitter:
        return self.parser.splitter(self.thinking)

    def message_fields(self, text: str) -> dict:
        """A finished reply's message fields: its content, and its reasoning where a parser is set."""
        if self.parser is None:
            return {"content": text}
        reasoning, content = self.parser.split(text, self.thinking)
        return {"content": content, **reasoning_fields(reasoning if self.include_reasoning else None)}


def reasoning_fields(text: str | None) -> dict:
    """A message's (or a delta's) reasoning under both names clients read: `reasoning_content`
    (SGLang's, DeepSeek's API's) and `reasoning` (vLLM's current name)."""
    return {"reasoning_content": text, "reasoning": text}
