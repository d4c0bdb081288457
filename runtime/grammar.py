"""Structured output: a request's constraint (a JSON schema, any JSON object, a regex, a
choice of strings, a grammar) enforced on the logits at every step, with llguidance.

Why llguidance: it runs on numpy with no torch (xgrammar's Python side needs torch), its
masks take tens of microseconds a token, and it reads a `tokenizers` tokenizer.json
directly. It is an optional dependency (the `structured` extra); without it, a request
that asks for structured output gets a clear 400.

A constraint is compiled once per distinct request (`GrammarCompiler` keeps an LRU of
compiled grammars), off the event loop; each sequence gets its own matcher, a copy of the
compiled one, which the sampler asks for the allowed tokens before each choice and tells
the chosen token after it. A constraint may start after a marker (a reasoning model's
`</think>`): the text before it is free, the grammar applies to what follows.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .errors import InvalidRequestError, shown
from .schema_checks import admits_finite_value

# The kinds a request may ask for, as llguidance's grammar_from() names the formats.
KINDS = {"json": "json_schema", "json_object": "json_schema", "regex": "regex", "choice": "choice",
         "grammar": "grammar", "lark": "lark"}
_ANY_JSON_OBJECT = '{"type": "object"}'
# Deeper than any schema people write, shallow enough that encoding it never hits Python's
# recursion limit.
MAX_NESTING = 128


def grammar_engine_installed() -> bool:
    return importlib.util.find_spec("llguidance") is not None


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match: `kind` (a key of KINDS) and its text (a JSON
    schema or choice list as JSON text, a regex, a Lark or GBNF grammar); `param` is the
    request field it came from, for errors. With `starts_after`, the output is free until that
    text has been generated (the end of a reasoning block), and the grammar binds what follows."""

    kind: str
    text: str
    param: str = "response_format"
    starts_after: str = ""

    def after(self, marker: str) -> "Constraint":
        """This constraint, applied only once `marker` has been generated."""
        return dataclasses.replace(self, starts_after=marker)

    @property
    def grammar_key(self) -> "Constraint":
        """What the compiled grammar depends on: the same grammar is compiled once, wherever it starts."""
        return dataclasses.replace(self, starts_after="") if self.starts_after else self

    @classmethod
    def of(cls, kind: str, value, param: str) -> "Constraint":
        """From a request field's value (a schema may be a dict, a choice a list); a value of
        the wrong type, unreadable JSON or one nested past MAX_NESTING is a 400 naming `param`."""
        if kind == "json_object":
            return cls(kind, _ANY_JSON_OBJECT, param)
        if nesting_depth(value) > MAX_NESTING:
            raise InvalidRequestError(f"{param} is nested more than {MAX_NESTING} levels deep", param=param)
        if kind == "choice":
            return cls(kind, json.dumps(_choices(value, param)), param)
        if kind == "json" and isinstance(value, (dict, bool)):
            value = json.dumps(value)
        if not isinstance(value, str) or not value:
            expected = "a JSON schema (an object or its text)" if kind == "json" else "a non-empty string"
            raise InvalidRequestError(f"{param} must be {expected}, got {shown(value)}", param=param)
        if kind == "json":
            _schema_text(value, param)
        return cls(kind, value, param)


def nesting_depth(value, limit: int = MAX_NESTING) -> int:
    """How deep lists and dicts nest in `value` (0 for a scalar), counted without recursion
    and no further than limit + 1."""
    depth, level = 0, [value]
    while depth <= limit:
        containers = [item for item in level if isinstance(item, (list, dict))]
        if not containers:
            break
        depth += 1
        level = [child for item in containers for child in (item.values() if isinstance(item, dict) else item)]
    return depth


def _choices(value, param: str) -> list[str]:
    """A choice constraint's strings: a list, or a JSON list as text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            value = None
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise InvalidRequestError(f"{param} must be a non-empty list of strings", param=param)
    return value


def _schema_text(text: str, param: str) -> None:
    """A JSON schema given as text must read as JSON, within MAX_NESTING."""
    try:
        schema = json.loads(text)
    except RecursionError:
        raise InvalidRequestError(f"{param} is nested more than {MAX_NESTING} levels deep", param=param) from None
    except ValueError as error:
        raise InvalidRequestError(f"{param} is not JSON: {error}", param=param) from None
    if nesting_depth(schema) > MAX_NESTING:
        raise InvalidRequestError(f"{param} is nested more than {MAX_NESTING} levels deep", param=param)


class GrammarCompiler:
    """Turns Constraints into matchers for one tokenizer.

    Compiling a grammar and building its first matcher can take seconds (a choice among
    50,000 strings); llguidance lets go of the GIL meanwhile, so `compile` runs on a worker
    thread while the event loop goes on. What it built is cached by the constraint's
    content, refusals included, and each sequence's matcher is a copy of the cached one.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int], cache_size: int = 256):
        import llguidance

        self._llguidance = llguidance
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=list(eos_token_ids) or None)
        # constraint -> its first matcher (copied for each sequence), or why it was refused
        self._compiled: OrderedDict[Constraint, object] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()  # compile runs on worker threads; the cache is shared

    def compiled(self, constraint: Constraint) -> bool:
        """Whether `compile` would answer from the cache."""
        with self._lock:
            return constraint.grammar_key in self._compiled

    def compile(self, constraint: Constraint):
        """The constraint's first matcher, from the cache or built and checked now;
        InvalidRequestError (400) naming the field if no output could satisfy it."""
        constraint = constraint.grammar_key
        with self._lock:
            if constraint in self._compiled:
                self._compiled.move_to_end(constraint)
                found = self._compiled[constraint]
                if isinstance(found, InvalidRequestError):
                    raise found
                return found
        try:
            found = self._build(constraint)
        except InvalidRequestError as error:
            found = error
        with self._lock:
            self._compiled[constraint] = found
            if len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
        if isinstance(found, InvalidRequestError):
            raise found
        return found

    def _build(self, constraint: Constraint):
        llguidance, param = self._llguidance, constraint.param
        try:
            if KINDS[constraint.kind] == "json_schema":
                if not admits_finite_value(json.loads(constraint.text)):
                    raise InvalidRequestError(f"{param}: no finite JSON value satisfies this schema (a required "
                                              "property, item or $ref leads back to itself)", param=param)
                # Compact separators unless the schema's own x-guidance says otherwise: free
                # whitespace lets a model pad its JSON without end.
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    constraint.text, defaults={"whitespace_flexible": False})
            elif constraint.kind == "choice":
                # One regular expression, not a rule per string: the lexer takes any number of
                # strings, where the parser refuses rows past 2,000 alternatives.
                grammar = llguidance.grammar_from("regex", "|".join(map(_regex_literal, json.loads(constraint.text))))
            else:
                grammar = llguidance.grammar_from(KINDS[constraint.kind], constraint.text)
        except InvalidRequestError:
            raise  # already names the field (it is a ValueError too)
        except (ValueError, TypeError) as error:
            raise InvalidRequestError(f"{param}: {error}", param=param) from None
        problem = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if problem:
            raise InvalidRequestError(f"{param}: {first_line(problem)}", param=param)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():  # not one token can begin the output
            raise InvalidRequestError(f"{param}: no output can satisfy it ({first_line(matcher.get_error())})",
                                      param=param)
        return matcher

    def matcher(self, constraint: Constraint) -> "TokenMatcher | MatcherAfterMarker":
        matcher = TokenMatcher(self.compile(constraint).deep_copy(), self.vocab_size)
        if not constraint.starts_after:
            return matcher
        return MatcherAfterMarker(matcher, constraint.starts_after.encode(), self.tokenizer.decode_bytes)


_REGEX_SPECIALS = frozenset("\\.+*?()|[]{}^$#&-~")


def _regex_literal(text: str) -> str:
    """`text` as a regular expression matching exactly it (in llguidance's syntax)."""
    return "".join("\\" + c if c in _REGEX_SPECIALS else c for c in text)


def first_line(message: str, limit: int = 300) -> str:
    """The first line of a grammar engine's message (which goes on with its state and the whole
    grammar), cut to `limit` characters."""
    line = message.strip().splitlines()[0] if message.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


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
        return first_line(self._matcher.get_error()) if self._matcher.is_error() else None


class MatcherAfterMarker:
    """A TokenMatcher that starts once `marker` has been generated: until then every token is
    allowed (a reasoning model thinks in free text), and the grammar binds the answer after it.

    The marker is matched on the generated bytes, not on token ids, so it is found however
    the tokenizer splits it (one special token in Qwen3's and DeepSeek's vocabularies, several
    elsewhere). The grammar begins with the token after the one that completed the marker.
    """

    def __init__(self, matcher: TokenMatcher, marker: bytes, token_bytes: Callable[[list[int]], bytes]):
        self._matcher = matcher
        self._marker = marker
        self._token_bytes = token_bytes
        self._tail = b""  # the last bytes generated, up to the marker's length less one
        self.started = False
        self.vocab_size = matcher.vocab_size

    def allowed(self) -> np.ndarray:
        return self._matcher.allowed() if self.started else np.ones(self.vocab_size, dtype=bool)

    def mask_logits(self, logits: np.ndarray) -> np.ndarray:
        return self._matcher.mask_logits(logits) if self.started else logits

    def accept(self, token: int) -> None:
        if self.started:
            self._matcher.accept(token)
            return
        seen = self._tail + self._token_bytes([int(token)])
        if self._marker in seen:
            self.started, self._tail = True, b""
        else:
            self._tail = seen[-(len(self._marker) - 1):] if len(self._marker) > 1 else b""

    @property
    def finished(self) -> bool:
        return self.started and self._matcher.finished

    @property
    def error(self) -> str | None:
        return self._matcher.error if self.started else None
