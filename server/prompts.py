"""Text and chat messages → token ids, for every route, with what a client got wrong as a 400.

Both steps run on client input (a template renders client messages; the tokenizer refuses
text that is not valid Unicode), so their failures are the client's, not the server's.
Both run on a worker thread, never on the event loop: a megabyte prompt takes the
tokenizer about a second, which no other request's tokens should wait for. Text over
the size limit is refused before either step.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kiln.runtime.chat import ChatTemplateError, render_chat_template
from kiln.runtime.errors import InvalidRequestError
from kiln.runtime.service import GenerateService

from .protocol import ChatMessage

# Keywords render_chat_template sets itself; chat_template_kwargs may not replace them.
_TEMPLATE_RESERVED = {"messages", "add_generation_prompt", "template", "tokenizer_config", "bos_token", "eos_token"}


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


def render_chat(service: GenerateService, messages: list[ChatMessage], template: str | None,
                add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None) -> str:
    extra = {k: v for k, v in (template_kwargs or {}).items() if k not in _TEMPLATE_RESERVED}
    try:
        return render_chat_template(service.tokenizer_config, [m.model_dump(exclude_none=True) for m in messages],
                                    add_generation_prompt=add_generation_prompt, template=template, **extra)
    except ChatTemplateError:
        raise
    except Exception as error:  # the template met values it cannot handle: the request's, not ours
        raise InvalidRequestError(f"the chat template cannot render these messages: {error}", param="messages") from None


async def chat_ids(service: GenerateService, messages: list[ChatMessage], template: str | None, limit: int,
                   add_special_tokens: bool, add_generation_prompt: bool = True,
                   template_kwargs: dict[str, Any] | None = None) -> list[int]:
    size = sum(len(str(m.content or "")) for m in messages)
    if size > limit:
        raise InvalidRequestError(f"messages have {size} characters: the server tokenizes at most {limit}",
                                  param="messages")
    text = await asyncio.to_thread(render_chat, service, messages, template, add_generation_prompt, template_kwargs)
    return await encode(service, text, limit, add_special_tokens=add_special_tokens, param="messages")
