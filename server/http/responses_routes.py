"""OpenAI's Responses API: POST /v1/responses, whole or as its named server-sent events.

A request becomes the chat request it amounts to (`instructions` as a system message first,
then the input's messages) and runs through /v1/chat/completions' prompt building, sampling
parameters and structured output, so the two routes render and sample a conversation alike;
only the answer's shape differs. With `--reasoning-parser`, the model's thinking comes first as a
`reasoning` output item (its text a `reasoning_text` part), as OpenAI's reasoning models return it,
and the answer after it as the `message`. Nothing is stored (what `store: false` means), so whatever
needs a stored response (previous_response_id, conversation, background) is a 400, and so are
function tools, which /v1/chat/completions serves.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from kiln.runtime.errors import InvalidRequestError
from kiln.runtime.sampling import SamplingParams

from ..errors import failure_of, fields_named
from ..generation import Choice, Generation, Usage, adapter_of, admit, rest_of_context
from ..logprobs import TokenText
from ..params import format_constraint, openai_params
from ..protocol import ChatCompletionRequest, ChatMessage, ResponsesInputMessage, ResponsesRequest, ResponsesTextFormat
from ..reasoning import ReplyReasoning, reasoning_parser
from .openai_routes import chat_prompt
from .streaming import one_reply, sse

router = APIRouter()

METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's limits
# The fields that chat's machinery names in its errors, as this API calls them.
_OWN_NAMES = {"max_tokens": "max_output_tokens", "messages": "input", "prompt": "input"}


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    state = request.app.state
    service, settings = state.service, state.settings
    admit(service, settings, body.model)
    refuse_unsupported(body)
    text_format = body.text.format if body.text is not None else ResponsesTextFormat()
    chat = as_chat(body)
    with fields_named(_OWN_NAMES):
        rendered = await chat_prompt(service, chat, settings, tools=None)
        prompt = rendered.ids
        max_tokens = body.max_output_tokens if body.max_output_tokens is not None else rest_of_context(service, prompt)
        params = openai_params(chat, max_tokens, model_defaults=service.generation_defaults,
                               lora=adapter_of(service, body.model))
        reasoning = ReplyReasoning(reasoning_parser(settings.reasoning_parser), rendered.text)
        params.constraint = reasoning.constrain_answer(
            format_constraint(text_format.type, text_format.json_schema, "text.format"))
        view = ResponseView(body, text_format, body.model or settings.model_name, params, reasoning, state.token_text)
        generation = await Generation(service, settings, state.metrics, [prompt], [params], [view.id]).submit()
    return await one_reply(request, generation, view, body.stream)


def refuse_unsupported(body: ResponsesRequest) -> None:
    if body.previous_response_id is not None:
        raise InvalidRequestError("previous_response_id cannot be continued: this server stores no responses (as "
                                  "with store false); send the whole conversation as input",
                                  param="previous_response_id")
    if body.conversation is not None:
        raise InvalidRequestError("conversation is not supported: this server stores no conversations; send the "
                                  "whole conversation as input", param="conversation")
    if body.background:
        raise InvalidRequestError("background responses are not supported: this server stores no responses to "
                                  "fetch later", param="background")
    if body.tools:
        raise InvalidRequestError("function tools are not supported on /v1/responses: /v1/chat/completions "
                                  "supports tools and tool_choice", param="tools")
    if body.tool_choice not in (None, "none", "auto"):
        raise InvalidRequestError("tool_choice needs tools, which /v1/responses does not support",
                                  param="tool_choice")
    metadata = body.metadata or {}
    if len(metadata) > METADATA_PAIRS:
        raise InvalidRequestError(f"metadata holds at most {METADATA_PAIRS} pairs, got {len(metadata)}",
                                  param="metadata")
    for key, value in metadata.items():
        if len(key) > METADATA_KEY_CHARS or len(value) > METADATA_VALUE_CHARS:
            raise InvalidRequestError(f"metadata keys have at most {METADATA_KEY_CHARS} characters and values at "
                                      f"most {METADATA_VALUE_CHARS} (key {key[:METADATA_KEY_CHARS]!r})",
                                      param="metadata")


def as_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request this one amounts to (its sampling fields; the route sets max_tokens)."""
    messages = [] if body.instructions is None else [ChatMessage(role="system", content=body.instructions)]
    items = [ResponsesInputMessage(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    for item in items:
        content = item.content if isinstance(item.content, str) else \
            [{"type": "text", "text": part.text} for part in item.content]
        messages.append(ChatMessage(role=item.role, content=content))
    if not messages:
        raise InvalidRequestError("input holds no message (and there are no instructions)", param="input")
    return ChatCompletionRequest(model=body.model, messages=messages, temperature=body.temperature,
                                 top_p=body.top_p, user=body.user)


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_text(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


# Per output item kind: its content part, and the events that stream its text (output_text's
# carry logprobs, reasoning_text's do not).
_PARTS = {"message": output_text, "reasoning": reasoning_text}
_TEXT_EVENTS = {"message": ("response.output_text.delta", "response.output_text.done", {"logprobs": []}),
                "reasoning": ("response.reasoning_text.delta", "response.reasoning_text.done", {})}


def usage_of(usage: Usage, reasoning_tokens: int = 0) -> dict:
    """The run's usage in this API's words (a diffusion LM's forward passes beside, as on chat)."""
    chat = usage.to_json()
    extra = {key: chat[key] for key in ("forward_passes", "tokens_per_forward", "canvas_tokens") if key in chat}
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens, **extra}


class ResponseView:
    """One response as OpenAI shows it: the whole object, or the events that build it."""

    def __init__(self, body: ResponsesRequest, text_format: ResponsesTextFormat, model: str,
                 params: SamplingParams, reasoning: ReplyReasoning | None = None, token_text: TokenText | None = None):
        self.id, self.message_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.model = model
        # The reasoning parser, where the reply begins in its reasoning; None: all of it is the message.
        self.reasoning_parser = reasoning.parser if reasoning is not None and reasoning.thinking else None
        self.token_text = token_text
        # What the request set, echoed as OpenAI does (sampling values as used, defaults included).
        self.echoed = {
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": None, "store": False,
            "temperature": params.temperature, "top_p": params.top_p,
            "text": {"format": text_format.model_dump(by_alias=True, exclude_none=True)},
            "tool_choice": body.tool_choice or "auto", "tools": [], "truncation": "disabled", "user": body.user,
        }

    def response(self, status: str, output: list[dict], usage: dict | None = None, error: dict | None = None) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "model": self.model, "output": output, "usage": usage, **self.echoed}

    def message(self, text: str | None, status: str) -> dict:
        """The output message; None text: not begun (no content part yet)."""
        return self.item("message", text, status)

    def item(self, kind: str, text: str | None, status: str) -> dict:
        """An output item: the `message`, or the `reasoning` before it; None text: no part yet."""
        content = [] if text is None else [_PARTS[kind](text)]
        if kind == "reasoning":
            return {"type": "reasoning", "id": self.item_id(kind), "summary": [], "content": content, "status": status}
        return {"type": "message", "id": self.item_id(kind), "status": status, "role": "assistant", "content": content}

    def item_id(self, kind: str) -> str:
        return self.reasoning_id if kind == "reasoning" else self.message_id

    def reasoning_tokens(self, token_ids: list[int]) -> int:
        if self.reasoning_parser is None or self.token_text is None:
            return 0
        return self.reasoning_parser.reasoning_tokens([self.token_text.text(t) for t in token_ids])

    def whole(self, choice: Choice, usage: Usage) -> dict:
        status = status_of(choice.finish_reason)
        if self.reasoning_parser is None:
            return self.response(status, [self.message(choice.text, status)], usage_of(usage))
        reasoning, content = self.reasoning_parser.split(choice.text)
        output = []
        if reasoning is not None:  # its status is the response's when the reply never got past it
            output.append(self.item("reasoning", reasoning, status if content is None else "completed"))
        output.append(self.message(content or "", status))
        return self.response(status, output, usage_of(usage, self.reasoning_tokens(choice.token_ids)))

    async def stream(self, generation: Generation) -> AsyncIterator[bytes]:
        """The events that build the response: each output item added, its text in deltas, done. The
        message is opened at once; with reasoning, items open as their text arrives (the reasoning
        first, closed when the answer begins)."""
        number = itertools.count()
        output: list[dict] = []  # the items done
        writing: dict = {}  # the item open now: its kind and text so far

        def event(kind: str, **fields) -> bytes:
            return sse({"type": kind, "sequence_number": next(number), **fields}, event=kind)

        def part_of_open_item() -> dict:
            return {"item_id": self.item_id(writing["kind"]), "output_index": len(output), "content_index": 0}

        def begin(kind: str) -> list[bytes]:
            writing.update(kind=kind, text="")
            return [event("response.output_item.added", output_index=len(output),
                          item=self.item(kind, None, "in_progress")),
                    event("response.content_part.added", **part_of_open_item(), part=_PARTS[kind](""))]

        def write(kind: str, text: str) -> list[bytes]:
            sent = []
            if writing.get("kind") != kind:
                sent = (end("completed") if writing else []) + begin(kind)
            writing["text"] += text
            delta_kind, _, extra = _TEXT_EVENTS[kind]
            return [*sent, event(delta_kind, **part_of_open_item(), delta=text, **extra)]

        def end(status: str) -> list[bytes]:
            kind, text = writing["kind"], writing["text"]
            _, done_kind, extra = _TEXT_EVENTS[kind]
            item = self.item(kind, text, status)
            sent = [event(done_kind, **part_of_open_item(), text=text, **extra),
                    event("response.content_part.done", **part_of_open_item(), part=_PARTS[kind](text)),
                    event("response.output_item.done", output_index=len(output), item=item)]
            output.append(item)
            writing.clear()
            return sent

        yield event("response.created", response=self.response("in_progress", []))
        yield event("response.in_progress", response=self.response("in_progress", []))
        splitter = self.reasoning_parser.splitter() if self.reasoning_parser is not None else None
        if splitter is None:
            for chunk in begin("message"):
                yield chunk
        finish, token_ids = None, []
        events = generation.events()
        try:
            async for _, update in events:
                if (error := failure_of(update)) is not None:
                    failure = {"code": "server_error", "message": error.message}
                    yield event("response.failed", response=self.response("failed", [], error=failure))
                    return
                token_ids += update.token_ids
                thought, text = splitter.feed(update.text) if splitter is not None else ("", update.text)
                if splitter is not None and update.finish_reason:
                    tail_thought, tail_text = splitter.finish()
                    thought, text = thought + tail_thought, text + tail_text
                for kind, piece in (("reasoning", thought), ("message", text)):
                    for chunk in write(kind, piece) if piece else []:
                        yield chunk
                finish = update.finish_reason or finish
        finally:
            await events.aclose()
        status = status_of(finish)
        if writing.get("kind") != "message":  # a reply that never left its reasoning still has a message
            for chunk in (end(status) if writing else []) + begin("message"):
                yield chunk
        for chunk in end(status):
            yield chunk
        usage = usage_of(generation.usage(), self.reasoning_tokens(token_ids))
        yield event(f"response.{status}", response=self.response(status, output, usage))
