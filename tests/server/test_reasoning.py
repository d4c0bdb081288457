"""The reasoning parsers without a server: whole replies split as vLLM's deepseek_r1 and qwen3
parsers split them, the same replies streamed in pieces cut at every character boundary (never
a tag, or part of one, in either field), when a request's reply begins in its reasoning, and
how many of its tokens the reasoning took."""

from __future__ import annotations

import itertools

import pytest

from kiln.server.reasoning import PARSERS, ReasoningParser, reasoning_fields, reasoning_parser
from kiln.server.settings import ServerSettings

# reply -> (reasoning, content), for both parsers when the reply begins in the reasoning.
WHOLE = {
    "<think>\nFirst, 2+2.\n</think>\n\nIt is 4.": ("\nFirst, 2+2.\n", "\n\nIt is 4."),  # the model opens it
    "First, 2+2.</think>It is 4.": ("First, 2+2.", "It is 4."),  # the template opened it
    " \n<think>Hm.</think>Yes.": ("Hm.", "Yes."),  # whitespace before the tag goes with it
    "Still thinking when max_tokens came": ("Still thinking when max_tokens came", None),
    "Done.</think>": ("Done.", None),
    "</think>Straight to it.": (None, "Straight to it."),
    "<think></think>Nothing to think.": (None, "Nothing to think."),
    "a</think>b</think>c": ("a", "b</think>c"),  # the first end tag ends it
    "x <think> y</think>z": ("x <think> y", "z"),  # only an opening tag is dropped
    "cut at </thi": ("cut at </thi", None),  # a tag never finished is text
    "<thi": ("<thi", None),
    "  ": ("  ", None),
    "": (None, None),
}


@pytest.mark.parametrize("name", sorted(PARSERS))
@pytest.mark.parametrize("reply", list(WHOLE))
def test_whole_replies_split_as_vllm_splits_them(name, reply):
    assert PARSERS[name].split(reply) == WHOLE[reply]


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_without_thinking_the_reply_is_all_content(name):
    for reply in WHOLE:
        assert PARSERS[name].split(reply, thinking=False) == (None, reply)


def streamed(parser: ReasoningParser, pieces: list[str], thinking: bool = True) -> tuple[list[str], list[str]]:
    """What each piece released, reasoning and content, the last piece finishing the reply."""
    splitter = parser.splitter(thinking)
    reasoning, content = [], []
    for index, piece in enumerate(pieces):
        thought, text = splitter.feed(piece)
        if index == len(pieces) - 1:
            tail_thought, tail_text = splitter.finish()
            thought, text = thought + tail_thought, text + tail_text
        reasoning.append(thought)
        content.append(text)
    return reasoning, content


def cuts(text: str, pieces: int):
    """`text` cut into `pieces` pieces at every choice of character boundaries (empty pieces included)."""
    for bounds in itertools.combinations_with_replacement(range(len(text) + 1), pieces - 1):
        edges = (0, *bounds, len(text))
        yield [text[a:b] for a, b in itertools.pairwise(edges)]


@pytest.mark.parametrize("name", sorted(PARSERS))
@pytest.mark.parametrize("reply", [r for r in WHOLE if r])
def test_streaming_at_every_boundary_gives_the_whole_split(name, reply):
    parser = PARSERS[name]
    reasoning, content = parser.split(reply)
    pieces_to_try = [list(reply)]  # a character at a time
    pieces_to_try += cuts(reply, 2)
    if len(reply) <= 16:
        pieces_to_try += cuts(reply, 3)
    for pieces in pieces_to_try:
        thoughts, texts = streamed(parser, pieces)
        # The same text as whole: so no tag, nor a piece of one sent before it was known, is in a field.
        assert ("".join(thoughts) or None, "".join(texts) or None) == (reasoning, content), pieces
        first_content = next((i for i, t in enumerate(texts) if t), len(texts))
        assert not any(thoughts[first_content + 1:]), pieces  # once the answer began, no more reasoning


def test_a_tag_split_across_tokens_is_held_until_it_is_known():
    splitter = PARSERS["qwen3"].splitter()
    assert splitter.feed("<") == ("", "")  # may open the reasoning
    assert splitter.feed("think>") == ("", "")  # it did: dropped
    assert splitter.feed("Because </") == ("Because ", "")  # may end it
    assert splitter.feed("th") == ("", "")
    assert splitter.feed("ink>") == ("", "")  # the end tag alone: nothing to send
    assert splitter.feed("\n\nSo: yes") == ("", "\n\nSo: yes")
    assert splitter.finish() == ("", "")
    other = PARSERS["deepseek_r1"].splitter()
    assert other.feed("a </th") == ("a ", "") and other.feed("e end") == ("</the end", "")  # not the tag after all
    assert other.feed("</think") == ("", "") and other.finish() == ("</think", "")


def test_which_replies_begin_in_their_reasoning():
    qwen3, deepseek = PARSERS["qwen3"], PARSERS["deepseek_r1"]
    opened = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    closed = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    plain = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    earlier = "<|im_start|>assistant\n<think>a</think>b<|im_end|>\n<|im_start|>user\nMore<|im_end|>\n" + opened
    for parser in (qwen3, deepseek):
        assert parser.thinks(opened) and parser.thinks(plain) and parser.thinks(earlier)
        assert not parser.thinks(closed)  # the template closed the block: thinking is off (vLLM's prompt check)
    # Qwen3's enable_thinking: false turns it off even where the template does not show it; DeepSeek's does not read it.
    assert not qwen3.thinks(plain, {"enable_thinking": False}) and qwen3.thinks(plain, {"enable_thinking": True})
    assert deepseek.thinks(opened, {"enable_thinking": False})


def test_the_reasoning_counts_the_tokens_up_to_the_end_tag():
    parser = PARSERS["qwen3"]
    assert parser.reasoning_tokens(["<think>", "Hm", ".", "</think>", "\n\n", "Yes"]) == 4
    assert parser.reasoning_tokens(["Hm", "</", "thin", "k>", "Yes"]) == 4  # a tag of several tokens
    assert parser.reasoning_tokens(["Hm", "..."]) == 2 and parser.reasoning_tokens([]) == 0


def test_parsers_are_found_by_name_and_an_unknown_one_names_the_choices():
    assert reasoning_parser(None) is None and reasoning_parser("qwen3") is PARSERS["qwen3"]
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        reasoning_parser("deepseek")
    with pytest.raises(ValueError, match="unknown reasoning parser 'r1'"):
        ServerSettings(reasoning_parser="r1")
    assert reasoning_fields("x") == {"reasoning_content": "x", "reasoning": "x"}
