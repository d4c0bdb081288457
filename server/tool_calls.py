"""Tool calling on /v1/chat/completions: the request's tools checked, the grammar that forces a
call (`tool_choice` "required" or a named function), and the calls parsed out of the text.

Models write calls in their own format, which the chat template teaches them; two are common:
- "hermes" (Hermes, Qwen 2/2.5/3, SmolLM3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
- "llama3_json" (Llama 3.1-3.3): the object `{"name": ..., "parameters": {...}}` as the whole reply.
`--tool-call-parser auto` picks one from the template's text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from kiln.runtime.errors import InvalidRequestError
from kiln.runtime.grammar import MAX_NESTING, Constraint, nesting_depth
from kiln.runtime.schema_checks import admits_finite_value

PARSERS = ("auto", "hermes", "llama3_json")
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_HERMES_START = "<tool_call>"
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str

    def to_json(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Tools:
    """A request's tools and its tool_choice, checked: what the route needs from them."""

    functions: dict[str, dict]  # name -> its parameters' JSON schema
    choice: str  # "none", "auto", "required", or "function" (a named one)
    named: str | None = None
    declared: tuple = ()  # the tools as the request gave them, for the chat template

    @classmethod
    def of(cls, tools: list[Any] | None, tool_choice: Any) -> "Tools | None":
        if not tools:
            if tool_choice not in (None, "none", "auto"):
                raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
            return None
        functions = {}
        for index, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
            name = function.get("name") if isinstance(function, dict) else None
            if not isinstance(name, str) or not name:
                raise InvalidRequestError(f"tools[{index}] must be {{\"type\": \"function\", \"function\": "
                                          "{\"name\": ..., \"parameters\": {...}}}", param="tools")
            if name in functions:  # a call could not say which of the two it means
                raise InvalidRequestError(f"tools[{index}]: the name {name!r} is given twice; tool names must be "
                                          "unique", param="tools")
            parameters = function.get("parameters") or {"type": "object", "properties": {}}
            if not isinstance(parameters, dict):
                raise InvalidRequestError(f"tools[{index}].function.parameters must be a JSON schema object",
                                          param="tools")
            if nesting_depth(parameters) > MAX_NESTING:
                raise InvalidRequestError(f"tools[{index}].function.parameters is nested more than {MAX_NESTING} "
                                          "levels deep", param="tools")
            if not admits_finite_value(parameters):  # no call of it could ever be complete
                raise InvalidRequestError(f"tools[{index}].function.parameters: no finite JSON value satisfies "
                                          "this schema (a required property, item or $ref leads back to itself)",
                                          param="tools")
            functions[name] = parameters
        named = None
        if tool_choice is None:
            choice = "auto"
        elif tool_choice in ("none", "auto", "required"):
            choice = tool_choice
        elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
            choice, named = "function", tool_choice["function"].get("name")
            if named not in functions:
                raise InvalidRequestError(f"tool_choice names {named!r}, which is not among the tools",
                                          param="tool_choice")
        else:
            raise InvalidRequestError("tool_choice must be none, auto, required or {\"type\": \"function\", "
                                      "\"function\": {\"name\": ...}}", param="tool_choice")
        return cls(functions, choice, named, tuple(tools))

    @property
    def active(self) -> bool:
        """Whether the reply may hold calls (and is parsed for them)."""
        return self.choice != "none"

    def constraint(self, parser: str) -> Constraint | None:
        """The grammar of exactly one call, for "required" and a named function; None otherwise."""
        if self.choice not in ("required", "function"):
            return None
        names = [self.named] if self.named else list(self.functions)
        key = "parameters" if parser == "llama3_json" else "arguments"
        options = [{"type": "object", "properties": {"name": {"const": name}, key: self.functions[name]},
                    "required": ["name", key], "additionalProperties": False} for name in names]
        schema = {**(options[0] if len(options) == 1 else {"anyOf": options}),
                  "x-guidance": {"whitespace_flexible": False}}
        call = f"%json {json.dumps(schema)}"
        lark = f'start: "{_HERMES_START}\\n" call "\\n</tool_call>"\ncall: {call}' if parser == "hermes" else \
            f"start: {call}"
        return Constraint("lark", lark, "tool_choice")


def choose_parser(requested: str, chat_template: str | None) -> str:
    """The format to parse: as configured, or (auto) the one the chat template writes."""
    if requested != "auto":
        return requested
    template = chat_template or ""
    if _PYTHON_TAG in template or ("parameters" in template and _HERMES_START not in template):
        return "llama3_json"
    return "hermes"


def parse(text: str, parser: str) -> tuple[str | None, list[ToolCall]]:
    """(the content outside the calls, or None; the calls), from a whole reply."""
    if parser == "hermes":
        calls = [_call(body, "arguments") for body in _HERMES_CALL.findall(text)]
        calls = [c for c in calls if c is not None]
        if not calls:
            return text, []
        content = text[: text.index(_HERMES_START)].strip()
        return content or None, calls
    stripped = text.strip().removeprefix(_PYTHON_TAG).strip()
    calls = [_call(part, "parameters") for part in stripped.split(";") if part.strip()]
    if calls and all(c is not None for c in calls):
        return None, calls
    return text, []


def _call(body: str, key: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(key, value.get("arguments", value.get("parameters")))
    if arguments is None:  # a call of a function without parameters
        arguments = {}
    if isinstance(arguments, str):  # the object written out as JSON text, as OpenAI's API carries it
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):  # a call's arguments are an object (Anthropic's `input` must be)
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False), f"call_{uuid.uuid4().hex[:24]}")


class StreamedContent:
    """While a reply streams, what may go out as content now: the text before a call could
    start. Whatever may be a call is held until the end, when `parse` decides."""

    def __init__(self, parser: str):
        self.parser = parser
        self.text = ""
        self._sent = 0
        self._holding = False

    def feed(self, delta: str) -> str:
        self.text += delta
        if self._holding:
            return ""
        if self.parser == "llama3_json":
            head = self.text.lstrip()
            if not head:
                return ""
            if head[0] == "{" or _PYTHON_TAG.startswith(head[: len(_PYTHON_TAG)]):
                self._holding = True
                return ""
            ready = len(self.text)
        else:
            start = self.text.find(_HERMES_START, self._sent)
            if start >= 0:
                self._holding = True
                ready = start
            else:  # hold back a tail that may be the start of the marker
                ready = len(self.text)
                for cut in range(1, len(_HERMES_START)):
                    if self.text.endswith(_HERMES_START[:cut]):
                        ready = len(self.text) - cut
        out, self._sent = self.text[self._sent : ready], max(self._sent, ready)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet sent, the calls) once the reply is whole."""
        _, calls = parse(self.text, self.parser)
        if not calls:
            return self.text[self._sent :], []
        start = self.text.find(_HERMES_START) if self.parser == "hermes" else 0
        return self.text[self._sent : max(self._sent, start)], calls
