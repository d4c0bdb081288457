"""Structured output: a request's constraint (a JSON schema, any JSON object, a regex, a
choice of strings, a grammar) enforced on the logits at every step, with llguidance.

Why llguidance: it runs on numpy with no torch (xgrammar's Python side needs torch), its
masks take tens of microseconds a token, and it reads a `tokenizers` tokenizer.json
directly. It is an optional dependency (the `structured` extra); without it, a request
that asks for structured output gets a clear 400.

A constraint is compiled once per distinct request (`GrammarCompiler` keeps an LRU of
compiled grammars); each sequence gets its own matcher, which the sampler asks for the
allowed tokens before each choice and tells the chosen token after it.
"""

from __future__ import annotations

import importlib.util
import json
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .errors import InvalidRequestError

# The kinds a request may ask for, as llguidance's grammar_from() names the formats.
KINDS = {"json": "json_schema", "json_object": "json_schema", "regex": "regex", "choice": "choice",
         "grammar": "grammar", "lark": "lark"}
_ANY_JSON_OBJECT = '{"type": "object"}'


def grammar_engine_installed() -> bool:
    return importlib.util.find_spec("llguidance") is not None


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match: `kind` (a key of KINDS) and its text (a JSON
    schema or choice list as JSON text, a regex, a Lark or GBNF grammar); `param` is the
    request field it came from, for errors."""

    kind: str
    text: str
    param: str = "response_format"

    @classmethod
    def of(cls, kind: str, value, param: str) -> "Constraint":
        """From a request field's value (a schema may be a dict, a choice a list)."""
        if kind == "json_object":
            return cls(kind, _ANY_JSON_OBJECT, param)
        if kind in ("json", "choice") and not isinstance(value, str):
            value = json.dumps(value)
        if not isinstance(value, str) or not value:
            raise InvalidRequestError(f"{param} must be a non-empty {'string' if kind != 'choice' else 'list'}",
                                      param=param)
        if kind == "choice":
            choices = json.loads(value)
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
                raise InvalidRequestError(f"{param} must be a non-empty list of strings", param=param)
        return cls(kind, value, param)


class GrammarCompiler:
    """Turns Constraints into matchers for one tokenizer; compiled grammars are cached."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int], cache_size: int = 256):
        import llguidance

        self._llguidance = llguidance
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=list(eos_token_ids) or None)
        self._compiled: OrderedDict[Constraint, str] = OrderedDict()
        self._cache_size = cache_size

    def grammar(self, constraint: Constraint) -> str:
        """The checked grammar text; InvalidRequestError (400) naming the field if it is not one."""
        if constraint in self._compiled:
            self._compiled.move_to_end(constraint)
            return self._compiled[constraint]
        llguidance = self._llguidance
        try:
            if KINDS[constraint.kind] == "json_schema":
                # Compact separators unless the schema's own x-guidance says otherwise: free
                # whitespace lets a model pad its JSON without end.
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    constraint.text, defaults={"whitespace_flexible": False})
            else:
                grammar = llguidance.grammar_from(KINDS[constraint.kind], constraint.text)
        except (ValueError, TypeError) as error:
            raise InvalidRequestError(f"{constraint.param}: {error}", param=constraint.param) from None
        problem = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if problem:
            raise InvalidRequestError(f"{constraint.param}: {problem.splitlines()[0]}", param=constraint.param)
        self._compiled[constraint] = grammar
        if len(self._compiled) > self._cache_size:
            self._compiled.popitem(last=False)
        return grammar

    def matcher(self, constraint: Constraint) -> "TokenMatcher":
        return TokenMatcher(self._llguidance.LLMatcher(self.tokenizer, self.grammar(constraint), log_level=0),
                            self.vocab_size)


class TokenMatcher:
    """One sequence's place in its grammar: which tokens may come next, and the ones taken."""

    def __init__(self, matcher, vocab_size: int):
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        self._matcher = matcher
        self._fill = fill_next_token_bitmask
        self._bitmask = allocate_token_bitmask(1, vocab_size)
        self._bits = np.arange(32, dtype=np.uint32)
        self.vocab_size = vocab_size

    def allowed(self) -> np.ndarray:
        """A boolean [vocab] mask of the tokens the grammar allows next."""
        self._fill(self._matcher, self._bitmask, 0)
        words = self._bitmask[0].view(np.uint32)
        return ((words[:, None] >> self._bits) & 1).astype(bool).reshape(-1)[: self.vocab_size]

    def mask_logits(self, logits: np.ndarray) -> np.ndarray:
        """A copy of `logits` with every token the grammar forbids at -inf."""
        masked = np.array(logits, dtype=np.float32)
        masked[~self.allowed()] = -np.inf
        return masked

    def accept(self, token: int) -> None:
        self._matcher.consume_token(int(token))

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (the text must end here)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None
