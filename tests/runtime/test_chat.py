"""Chat templates rendered: the generation prompt, template keywords, and a final message left
open to be continued (transformers' continue_final_message, which vLLM uses)."""

from __future__ import annotations

import pytest

from kiln.runtime.chat import ChatTemplateError, render_chat_template

from tests.tiny_model import CHATML_TEMPLATE


CONFIG = {"chat_template": CHATML_TEMPLATE}
# A template that trims what it writes, as many do: the message's trailing whitespace is gone.
TRIMMING = CHATML_TEMPLATE.replace("message['content']", "message['content'] | trim")


def render(messages, template=None, **options) -> str:
    return render_chat_template(CONFIG, messages, template=template, **options)


def test_the_generation_prompt_and_template_keywords_reach_the_template():
    chat = [{"role": "user", "content": "Hi"}]
    assert render(chat) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert render(chat, add_generation_prompt=False) == "<|im_start|>user\nHi<|im_end|>\n"
    greeting = "{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}"
    assert render(chat, template=greeting, greeting="Hello: ") == "Hello: Hi"


def test_the_final_message_is_left_open_to_continue():
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "It is"}]
    closed = render(chat, add_generation_prompt=False)
    assert closed.endswith("It is<|im_end|>\n")
    assert render(chat, add_generation_prompt=False, continue_final_message=True) == closed[: -len("<|im_end|>\n")]
    # Trailing whitespace stays where the template keeps it, and goes where it trims it.
    spaced = [chat[0], {"role": "assistant", "content": "It is "}]
    assert render(spaced, add_generation_prompt=False, continue_final_message=True).endswith("assistant\nIt is ")
    assert render(spaced, TRIMMING, add_generation_prompt=False, continue_final_message=True).endswith(
        "assistant\nIt is")
    # Text parts are continued as their joined text; the cut is at the last place the text is written.
    parts = [{"role": "user", "content": "It is"},
             {"role": "assistant", "content": [{"type": "text", "text": "It is"}]}]
    assert render(parts, add_generation_prompt=False, continue_final_message=True).endswith(
        "<|im_start|>assistant\nIt is")


def test_a_final_message_with_no_text_or_not_written_cannot_be_continued():
    with pytest.raises(ChatTemplateError, match="no text|needs text"):
        render([{"role": "assistant", "content": " "}], add_generation_prompt=False, continue_final_message=True)
    hidden = "{% for m in messages %}{{ m.role }};{% endfor %}"
    with pytest.raises(ChatTemplateError, match="does not write the final message"):
        render([{"role": "assistant", "content": "x"}], hidden, add_generation_prompt=False,
               continue_final_message=True)
