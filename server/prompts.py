"""Text and chat messages → token ids, for every route, with what a client got wrong as a 400.

Both steps run on client input (a template renders client messages; the tokenizer refuses
text that is not valid Unicode), so their failures are the client's, not the server's.
Both run on a worker thread, never on the event loop: a megabyte prompt takes the
tokenizer about a second, which no other request's tokens should wait for. Text over
the size limit is refused before either step.
"""

from __future__ import annotations

import asyncio
from typing import Any, NamedTuple

from kiln.runtime.chat import ChatTemplateError, render_chat_template
from kiln.runtime.errors import InvalidRequestError
from kiln.runtime.service import GenerateService

from .protocol import ChatCompletionRequest, ChatMessage, TokenizeRequest

# Keywords render_chat_template sets itself; chat_template_kwargs may not replace them.
_TEMPLATE_RESERVED = {"messages", "add_generation_prompt", "continue_final_message", "template", "tokenizer_config",
                      "bos_token", "eos_token"}


class ChatEnding(NamedTuple):
    """How a rendered chat ends: with the header of a new assistant message, or inside the last one."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False


NEW_TURN = ChatEnding()  # the usual ending: the header of the assistant's reply


def chat_ending(body: ChatCompletionRequest | TokenizeRequest) -> ChatEnding:
    """A chat request's add_generation_prompt and continue_final_message (vLLM's fields), checked.

    Continuing the final message renders without a generation prompt: asking for both is a 400,
    as in vLLM, when the request sets add_generation_prompt true itself (its default gives way).
    Only an assistant's message can be continued."""
    if not body.continue_final_message:
        return ChatEnding(body.add_generation_prompt)
    if body.add_generation_prompt and "add_generation_prompt" in body.model_fields_set:
        raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true: the first "
                                  "continues the last message, the second starts a new one",
                                  param="continue_final_message")
    if body.messages and body.messages[-1].role != "assistant":
        raise InvalidRequestError(f"continue_final_message continues the final message, which must be the "
                                  f"assistant's, not the {body.messages[-1].role!r}'s",
                                  param="continue_final_message")
    return ChatEnding(False, True)


async def encode(service: GenerateService, text: str, limit: int, add_special_tokens: bool = True,
                 param: str = "prompt") -> list[int]:
    """Token ids of `text`, refused (400) over `limit` characters or when it is not valid Unicode."""
    if len(text) > limit:
        raise InvalidRequestError(f"{param} has {len(text)} characters: the server tokenizes at most {limit}",
                                  param=param)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidRequestError(f"{param} is not valid Unicode: {error.reason} at character {error.start}",
                                  param=param) from None
    return await asyncio.to_thread(service.encode, text, add_special_tokens)


class PromptForms(NamedTuple):
    """A prompt field's inputs, as OpenAI's /v1/completions and /v1/embeddings take them: texts,
    or lists of token ids (one list given bare counts as one input)."""

    texts: list[str] | None
    token_lists: list[list[int]] | None


def prompt_forms(value, param: str, most: int) -> PromptForms:
    """A 400 naming `param` for a value that is none of a string, strings, token ids or lists of
    them (or is empty), or holds more than `most` inputs."""
    if isinstance(value, str):
        forms = PromptForms([value], None)
    elif value and all(isinstance(p, str) for p in value):
        forms = PromptForms(list(value), None)
    elif value and all(isinstance(p, int) for p in value):
        forms = PromptForms(None, [list(value)])
    elif value and all(isinstance(p, list) for p in value):
        forms = PromptForms(None, list(value))
    else:
        raise InvalidRequestError(f"{param} must be a string, a list of strings or token ids, and not empty",
                                  param=param)
    count = len(forms.texts if forms.texts is not None else forms.token_lists)
    if count > most:
        raise InvalidRequestError(f"at most {most} {param}s per request, got {count}", param=param)
    return forms


def render_chat(service: GenerateService, messages: list[ChatMessage], template: str | None,
                ending: ChatEnding = NEW_TURN, template_kwargs: dict[str, Any] | None = None) -> str:
    extra = {k: v for k, v in (template_kwargs or {}).items() if k not in _TEMPLATE_RESERVED}
    try:
        return render_chat_template(service.tokenizer_config, [m.model_dump(exclude_none=True) for m in messages],
                                    add_generation_prompt=ending.add_generation_prompt, template=template,
                                    continue_final_message=ending.continue_final_message, **extra)
    except ChatTemplateError:
        raise
    except Exception as error:  # the template met values it cannot handle: the request's, not ours
        raise InvalidRequestError(f"the chat template cannot render these messages: {error}", param="messages") from None


class ChatPrompt(NamedTuple):
    """A conversation rendered by the chat template, and its token ids."""

    text: str
    ids: list[int]


async def chat_prompt_of(service: GenerateService, messages: list[ChatMessage], template: str | None, limit: int,
                         add_special_tokens: bool, ending: ChatEnding = NEW_TURN,
                         template_kwargs: dict[str, Any] | None = None) -> ChatPrompt:
    size = sum(len(str(m.content or "")) for m in messages)
    if size > limit:
        raise InvalidRequestError(f"messages have {size} characters: the server tokenizes at most {limit}",
                                  param="messages")
    text = await asyncio.to_thread(render_chat, service, messages, template, ending, template_kwargs)
    return ChatPrompt(text, await encode(service, text, limit, add_special_tokens=add_special_tokens, param="messages"))


async def chat_ids(service: GenerateService, messages: list[ChatMessage], template: str | None, limit: int,
                   add_special_tokens: bool, ending: ChatEnding = NEW_TURN,
                   template_kwargs: dict[str, Any] | None = None) -> list[int]:
    prompt = await chat_prompt_of(service, messages, template, limit, add_special_tokens, ending, template_kwargs)
    return prompt.ids
