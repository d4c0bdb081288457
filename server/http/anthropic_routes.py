"""Anthropic's Messages API: POST /v1/messages, whole or as Anthropic's server-sent events, and
POST /v1/messages/count_tokens.

A request becomes the chat request it amounts to and runs through /v1/chat/completions' own
planning (the chat template, tools and the grammar of a forced call, structured output, reasoning),
so the two routes render, sample and parse a conversation alike; only the shapes differ:
- `system` (a string or text blocks) is a system message first;
- a user's `tool_result` blocks are `tool` messages (before the user's text), each answering a
  `tool_use` block of an earlier assistant message, whose `tool_use` blocks are its `tool_calls`,
  as chat templates expect them; earlier `thinking` blocks are left out, as chat templates
  leave earlier turns' thinking out;
- a final assistant message is continued (Anthropic's prefill), as continue_final_message does;
- tools' `input_schema` are function parameters; tool_choice auto/any/tool/none is
  auto/required/named/none, so `any` and `tool` force a call by grammar;
- `thinking` disabled is `enable_thinking: false` for the template; with `--reasoning-parser`
  the reply's thinking comes back as a `thinking` block (its budget is not enforced: thinking
  counts toward max_tokens, as Anthropic's does);
- `output_config.format` (or the beta's `output_format`) is a JSON schema's grammar.
A max_tokens past the rest of the context is cut to it, and a reply that fills the context
stops with `model_context_window_exceeded`, as Anthropic's newer models do. Errors are
Anthropic's shape (server/errors.py).
"""

from __future__ import annotations

import itertools
import json
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from kiln.runtime.errors import InvalidRequestError

from ..errors import anthropic_error, failure_of, fields_named
from ..generation import Choice, Generation, Usage, admit
from ..protocol import (AnthropicCountTokensRequest, AnthropicMessage, AnthropicMessagesRequest, AnthropicText,
                        AnthropicToolResult, AnthropicToolUse, ChatCompletionRequest, ChatMessage, ResponseFormat)
from ..tool_calls import StreamedContent, ToolCall
from ..tool_calls import parse as parse_tool_calls
from .openai_routes import ChatRun, plan_chat, submit_chat
from .streaming import one_reply, sse

router = APIRouter()

# The fields that chat's machinery names in its errors, as this API calls them.
_OWN_NAMES = {"stop": "stop_sequences", "response_format": "output_config.format", "prompt": "messages"}
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


@router.post("/v1/messages")
async def create_message(body: AnthropicMessagesRequest, request: Request):
    state = request.app.state
    admit(state.service, state.settings, body.model)
    if body.temperature is not None and not 0 <= body.temperature <= 1:
        raise InvalidRequestError(f"temperature must be in [0, 1], got {body.temperature}", param="temperature")
    if body.top_k is not None and body.top_k < 0:  # 0, as unset, cuts nothing
        raise InvalidRequestError(f"top_k must be >= 0, got {body.top_k}", param="top_k")
    message_id = f"msg_{uuid.uuid4().hex}"
    with fields_named(_OWN_NAMES):
        run = await plan_chat(state.service, state.settings, as_chat(body), fit_context=True)
        generation = await submit_chat(state, run, message_id)
    one_call = body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use
    view = MessageView(message_id, body.model or state.settings.model_name, run, body.max_tokens, one_call)
    return await one_reply(request, generation, view, body.stream)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: AnthropicCountTokensRequest, request: Request):
    """The prompt's tokens, as the Messages route would render it (tools and system included)."""
    state = request.app.state
    admit(state.service, state.settings, body.model)
    with fields_named(_OWN_NAMES):
        run = await plan_chat(state.service, state.settings, as_chat(body), fit_context=True)
    return {"input_tokens": len(run.prompt.ids)}


# -- the request, as chat ----------------------------------------------------------------------
def as_chat(body: AnthropicCountTokensRequest) -> ChatCompletionRequest:
    """The chat request this one amounts to."""
    messages = []
    if body.system is not None and (system := text_of(body.system)):
        messages.append(ChatMessage(role="system", content=system))
    called: set[str] = set()  # the ids of the tool_use blocks met so far
    for index, message in enumerate(body.messages):
        messages += chat_messages(message, index, called)
    fields: dict = {"tools": chat_tools(body), "tool_choice": chat_tool_choice(body), "chat_template_kwargs": None}
    thinking = body.thinking
    if thinking is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": thinking.type != "disabled"}
        fields["include_reasoning"] = thinking.display != "omitted"
    # The last message an assistant's: the reply goes on from it, as Anthropic's prefill does. One
    # with nothing to go on from (no text, no calls) is the optional empty final message Anthropic's
    # API accepts: the reply is a new turn.
    continuing = body.messages[-1].role == "assistant"
    if continuing and len(messages) > 1 and not (messages[-1].content or "").strip() and \
            not getattr(messages[-1], "tool_calls", None):
        messages.pop()
        continuing = False
    fields.update(add_generation_prompt=not continuing, continue_final_message=continuing)
    if isinstance(body, AnthropicMessagesRequest):
        fields.update(max_tokens=body.max_tokens, stop=body.stop_sequences, temperature=body.temperature,
                      top_p=body.top_p, top_k=body.top_k, response_format=response_format(body),
                      user=body.metadata.user_id if body.metadata is not None else None)
    return ChatCompletionRequest(model=body.model, messages=messages, **fields)


def text_of(content: list[AnthropicText] | str) -> str:
    return content if isinstance(content, str) else "\n".join(block.text for block in content)


def chat_messages(message: AnthropicMessage, index: int, called: set[str]) -> list[ChatMessage]:
    """One Anthropic message as chat messages: a user's tool results first, each a `tool`
    message; an assistant's text and its calls as one message. `called` holds the ids of the
    earlier messages' calls, which a result must answer, and takes this message's."""
    if isinstance(message.content, str):
        return [ChatMessage(role=message.role, content=message.content)]
    texts, calls, results = [], [], []
    for number, block in enumerate(message.content):
        where = f"messages.{index}.content.{number}"
        if isinstance(block, AnthropicText):
            texts.append(block.text)
        elif isinstance(block, AnthropicToolUse):
            if message.role != "assistant":
                raise InvalidRequestError(f"{where}: tool_use blocks belong in the assistant's messages",
                                          param="messages")
            called.add(block.id)
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif isinstance(block, AnthropicToolResult):
            if message.role != "user":
                raise InvalidRequestError(f"{where}: tool_result blocks belong in the user's messages",
                                          param="messages")
            if block.tool_use_id not in called:  # as Anthropic's: a result answers a call made before it
                raise InvalidRequestError(f"{where}: tool_use_id {block.tool_use_id!r} matches no tool_use block of "
                                          "an earlier assistant message", param="messages")
            result = text_of(block.content)  # a failed call's result says so: templates have no field for it
            results.append(ChatMessage(role="tool", tool_call_id=block.tool_use_id,
                                       content=f"Error: {result}" if block.is_error else result))
        # thinking blocks: an earlier turn's, which the template leaves out
    text = "\n".join(texts)
    if message.role == "assistant":
        return [ChatMessage(role="assistant", content=text, **({"tool_calls": calls} if calls else {}))]
    return results + ([ChatMessage(role="user", content=text)] if texts or not results else [])


def chat_tools(body: AnthropicCountTokensRequest) -> list[dict] | None:
    """Client tools as OpenAI's function tools; a hosted tool (web search, code execution...) is
    Anthropic's to run, not a model's to call, so it is refused by name."""
    if not body.tools:
        return None
    functions = []
    for index, tool in enumerate(body.tools):
        if tool.type not in (None, "custom"):
            raise InvalidRequestError(f"tools.{index}: {tool.type!r} is one of Anthropic's hosted tools, which this "
                                      "server does not run; declare client tools (name, description, "
                                      "input_schema)", param="tools")
        if tool.input_schema is None:
            raise InvalidRequestError(f"tools.{index}.input_schema: Field required", param="tools")
        function = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            function["description"] = tool.description
        functions.append({"type": "function", "function": function})
    return functions


def chat_tool_choice(body: AnthropicCountTokensRequest):
    choice = body.tool_choice
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise InvalidRequestError("tool_choice of type tool needs the tool's name", param="tool_choice")
        return {"type": "function", "function": {"name": choice.name}}
    return _TOOL_CHOICES[choice.type]


def response_format(body: AnthropicMessagesRequest) -> ResponseFormat | None:
    given = [f for f in (body.output_config.format if body.output_config else None, body.output_format) if f]
    if len(given) > 1:
        raise InvalidRequestError("give the output format once: output_config.format or output_format",
                                  param="output_format")
    if not given:
        return None
    return ResponseFormat(type="json_schema", json_schema={"name": "output", "schema": given[0].json_schema})


# -- the reply, as Anthropic shows it ----------------------------------------------------------
def usage_of(usage: Usage) -> dict:
    """Anthropic counts the prompt's tokens read from the cache apart from the rest."""
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": usage.cached_tokens}


def tool_use(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": json.loads(call.arguments)}


def thinking_block(text: str) -> dict:
    return {"type": "thinking", "thinking": text, "signature": ""}


class MessageView:
    """One reply as Anthropic shows it: the whole message, or the events that build it."""

    def __init__(self, message_id: str, model: str, run: ChatRun, max_tokens: int, one_call: bool = False):
        self.id, self.model, self.run, self.max_tokens = message_id, model, run, max_tokens
        self.most_calls = 1 if one_call else None  # disable_parallel_tool_use: the first call alone

    def message(self, content: list[dict], stop_reason: str | None, stop_sequence: str | None, usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    def stop(self, finish_reason: str | None, stop_reason, called: bool, output_tokens: int) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence): a call made, the length reached (max_tokens, or the
        context when max_tokens was cut to it), a stop sequence met, or the model's end of turn."""
        if called:
            return "tool_use", None
        if finish_reason == "length":
            return ("max_tokens" if output_tokens >= self.max_tokens else "model_context_window_exceeded"), None
        if isinstance(stop_reason, str):
            return "stop_sequence", stop_reason
        return "end_turn", None

    def whole(self, choice: Choice, usage: Usage) -> dict:
        fields = self.run.reasoning.message_fields(choice.text)
        text, thought = fields["content"] or "", fields.get("reasoning_content")
        calls = []
        if self.run.parser is not None:  # calls are read from the answer, never from the reasoning
            content, calls = parse_tool_calls(text, self.run.parser)
            text, calls = (content or "") if calls else text, calls[:self.most_calls]
        if self.run.reasoning.thinking:  # the answer begins at its first word, not the blank lines after thinking
            text = text.lstrip()
        blocks = [thinking_block(thought)] if thought else []
        blocks += [{"type": "text", "text": text}] if text or not (blocks or calls) else []
        blocks += [tool_use(call) for call in calls]
        stop_reason, stop_sequence = self.stop(choice.finish_reason, choice.stop_reason, bool(calls),
                                               len(choice.token_ids))
        return self.message(blocks, stop_reason, stop_sequence, usage_of(usage))

    async def stream(self, generation: Generation) -> AsyncIterator[bytes]:
        """message_start; each content block started, its deltas, stopped; message_delta with the
        stop reason and usage; message_stop. Thinking and text open as they arrive; text that may
        be a tool call is held back, and the calls come last, each as one input_json_delta."""
        index = itertools.count()
        open_block: dict = {}  # the block being written: its kind and index

        def event(kind: str, **fields) -> bytes:
            return sse({"type": kind, **fields}, event=kind)

        def close() -> list[bytes]:
            if not open_block:
                return []
            sent = [event("content_block_stop", index=open_block["index"])]
            open_block.clear()
            return sent

        def start(block: dict) -> list[bytes]:
            sent = close()
            open_block.update(kind=block["type"], index=next(index))
            return [*sent, event("content_block_start", index=open_block["index"], content_block=block)]

        def write(kind: str, text: str) -> list[bytes]:
            sent = [] if open_block.get("kind") == kind else \
                start(thinking_block("") if kind == "thinking" else {"type": "text", "text": ""})
            delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else \
                {"type": "text_delta", "text": text}
            return [*sent, event("content_block_delta", index=open_block["index"], delta=delta)]

        prompt_tokens = len(self.run.prompt.ids)
        yield event("message_start", message=self.message(
            [], None, None, {"input_tokens": prompt_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
                             "cache_read_input_tokens": 0}))
        yield event("ping")
        reasoning, parser = self.run.reasoning, self.run.parser
        splitter = reasoning.splitter() if reasoning.parser is not None else None
        held = StreamedContent(parser) if parser is not None else None
        finish, stop_reason, calls, output_tokens = None, None, [], 0
        answering = False  # whether the answer's first words have come
        events = generation.events()
        try:
            async for _, update in events:
                if (error := failure_of(update)) is not None:
                    yield event("error", error=anthropic_error(error)["error"])
                    return
                output_tokens += len(update.token_ids)
                thought, text = splitter.feed(update.text) if splitter is not None else ("", update.text)
                if splitter is not None and update.finish_reason:
                    tail_thought, tail_text = splitter.finish()
                    thought, text = thought + tail_thought, text + tail_text
                if held is not None:
                    text = held.feed(text)
                    if update.finish_reason:
                        tail, calls = held.finish()
                        text, calls = text + tail, calls[:self.most_calls]
                if reasoning.thinking and not answering:  # as in the whole message: from its first word
                    text = text.lstrip()
                    answering = bool(text)
                pieces = (("thinking", thought if reasoning.include_reasoning else ""), ("text", text))
                for kind, piece in pieces:
                    for chunk in write(kind, piece) if piece else []:
                        yield chunk
                if update.finish_reason:
                    finish, stop_reason = update.finish_reason, update.stop_reason
        finally:
            await events.aclose()
        for call in calls:
            block = tool_use(call)
            for chunk in start({**block, "input": {}}):
                yield chunk
            yield event("content_block_delta", index=open_block["index"],
                        delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
        if next(index) == 0:  # nothing written: the message still has its (empty) text
            yield event("content_block_start", index=0, content_block={"type": "text", "text": ""})
            yield event("content_block_stop", index=0)
        for chunk in close():
            yield chunk
        reason, sequence = self.stop(finish, stop_reason, bool(calls), output_tokens)
        yield event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                    usage=usage_of(generation.usage()))
        yield event("message_stop")
