"""Render a conversation with the model's chat template (tokenizer_config.json's, in jinja2).

HF templates expect `messages`, `add_generation_prompt`, the special tokens by
name and `raise_exception`; content may be a string or a list of text parts. With
`continue_final_message` the conversation ends inside its last message, for the model to
go on with it (a prefilled answer), as transformers' apply_chat_template does it.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import InvalidRequestError


class ChatTemplateError(InvalidRequestError):
    """No template, or the template rejected the conversation."""

    def __init__(self, message: str):
        super().__init__(message, param="messages")


def _raise(message: str):
    raise ChatTemplateError(message)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = _raise
    environment.filters["tojson"] = lambda value, indent=None: __import__("json").dumps(value, indent=indent, ensure_ascii=False)
    return environment.from_string(source)


def _token_text(value: Any) -> str:
    if isinstance(value, dict):
        return value.get("content", "")
    return value or ""


def flatten_content(content: Any) -> str:
    """OpenAI content: a string, or a list of parts of which only text parts are understood."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                texts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                texts.append(part)
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatTemplateError(f"message content of type {kind!r} is not supported: only text")
        return "".join(texts)
    raise ChatTemplateError("message content must be a string or a list of text parts")


def render_chat_template(
    tokenizer_config: dict,
    messages: list[dict],
    add_generation_prompt: bool = True,
    template: str | None = None,
    continue_final_message: bool = False,
    **extra: Any,
) -> str:
    source = template or tokenizer_config.get("chat_template")
    if isinstance(source, list):  # several named templates: take the default one
        source = next((t["template"] for t in source if t.get("name") == "default"), source[0]["template"])
    if not source:
        raise ChatTemplateError("this model has no chat template: use the completions API or pass a template")
    normalized = [{**m, "content": flatten_content(m.get("content"))} for m in messages]
    try:
        rendered = _compile(source).render(
            messages=normalized,
            add_generation_prompt=add_generation_prompt,
            bos_token=_token_text(tokenizer_config.get("bos_token")),
            eos_token=_token_text(tokenizer_config.get("eos_token")),
            **extra,
        )
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as error:
        raise ChatTemplateError(f"the chat template failed: {error}") from None
    return cut_after_final_message(rendered, normalized[-1]["content"]) if continue_final_message else rendered


def cut_after_final_message(rendered: str, final: str) -> str:
    """The rendered chat up to the end of the final message's text, so what the template wrote
    after it (the end of the turn) is gone and the model continues the message instead.

    The text is found from the end of the chat; a template may trim the message's whitespace,
    so it is looked for stripped, and kept with its trailing whitespace only where the
    template kept it too (transformers' rule)."""
    if not final.strip():
        raise ChatTemplateError("continue_final_message needs text to continue in the final message; to start "
                                "a new assistant message, use add_generation_prompt instead")
    at = rendered.rfind(final.strip())
    if at < 0:
        raise ChatTemplateError("continue_final_message: the chat template does not write the final message's "
                                "text as given, so there is no place to continue it from")
    kept = final.lstrip()
    if rendered[at:at + len(kept)] == kept:
        return rendered[:at + len(kept)]
    return rendered[:at + len(final.strip())]
