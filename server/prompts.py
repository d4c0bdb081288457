"""Text and chat messages → token ids, for every route, with what a client got wrong as a 400.

Both steps run on client input (a template renders client messages; the tokenizer refuses
text that is not valid Unicode), so their failures are the client's, not the server's.
"""

from __future__ import annotations

from typing import Any

from kiln.runtime.chat import ChatTemplateError, render_chat_template
from kiln.runtime.errors import InvalidRequestError
from kiln.runtime.service import GenerateService

from .protocol import ChatMessage

# Keywords render_chat_template sets itself; chat_template_kwargs may not replace them.
_TEMPLATE_RESERVED = {"messages", "add_generation_prompt", "template", "tokenizer_config", "bos_token", "eos_token"}


def encode(service: GenerateService, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidRequestError(f"{param} is not valid Unicode: {error.reason} at character {error.start}",
                                  param=param) from None
    return service.encode(text, add_special_tokens=add_special_tokens)


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


def chat_ids(service: GenerateService, messages: list[ChatMessage], template: str | None, add_special_tokens: bool,
             add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None) -> list[int]:
    text = render_chat(service, messages, template, add_generation_prompt, template_kwargs)
    return encode(service, text, add_special_tokens=add_special_tokens, param="messages")
