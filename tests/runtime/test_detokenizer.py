"""runtime/detokenizer.py: UTF-8 safe incremental decoding and stop strings across deltas."""

from __future__ import annotations

import random

import pytest

from kiln.runtime.detokenizer import IncrementalDetokenizer, StopChecker
from tests.tiny_model import EOS_ID, IM_END_ID, make_tiny_tokenizer

TEXTS = [
    "Once upon a time, in a small village by the sea.",
    "héllo 😀 wörld 日本語 done",
    "😀😀👩‍👩‍👧 emoji in a row 🎉",
    "ünïcödé at the end: Ω",
    "def add(a, b):\n    return a + b\n",
]


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


def ids_of(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def stream(tok, ids, prompt="Hello, world!", **kw) -> tuple[list[str], IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tok, tok.encode(prompt).ids, **kw)
    deltas = [d.add(i) for i in ids]
    deltas.append(d.flush())
    return deltas, d


# --- IncrementalDetokenizer -----------------------------------------------------------


def test_the_tiny_tokenizer_really_splits_characters(tok):
    # Otherwise the tests below would not exercise the held-back path.
    assert len(ids_of(tok, "😀")) == 4
    assert len(ids_of(tok, "日")) == 3
    assert "\ufffd" in tok.decode(ids_of(tok, "😀")[:2])


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_add_up_to_the_full_decode_without_replacement_chars(tok, text):
    ids = ids_of(tok, text)
    deltas, d = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert d.text == text
    assert not any("\ufffd" in x for x in deltas)
    assert deltas[-1] == ""  # valid text: nothing left for flush


def test_a_split_character_comes_out_whole_on_its_last_byte(tok):
    ids = ids_of(tok, "a😀")
    d = IncrementalDetokenizer(tok, [])
    assert d.add(ids[0]) == "a"
    assert [d.add(i) for i in ids[1:]] == ["", "", "", "😀"]
    assert d.flush() == ""


def test_invalid_bytes_are_released_by_flush(tok):
    ids = ids_of(tok, "ab😀")[:-2]  # the model stops half-way through a character
    deltas, d = stream(tok, ids)
    assert deltas[-1] == "\ufffd"
    assert "".join(deltas) == tok.decode(ids) == d.text


def test_an_invalid_byte_mid_text_does_not_block_the_rest(tok):
    ids = ids_of(tok, "😀")[:1] + ids_of(tok, " the sea")
    deltas, _ = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids)
    assert deltas[-1] == ""


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, skip):
    ids = ids_of(tok, "the end") + [IM_END_ID] + ids_of(tok, " 😀") + [EOS_ID]
    deltas, d = stream(tok, ids, skip_special_tokens=skip)
    assert d.text == tok.decode(ids, skip_special_tokens=skip)
    assert ("</s>" in d.text) != skip


def test_output_after_the_prompt_keeps_its_leading_space(tok):
    deltas, d = stream(tok, ids_of(tok, " world"), prompt="Hello")
    assert d.text == " world"


class CountingTokenizer:
    """Records how many ids each decode call gets."""

    def __init__(self, tok):
        self.tok, self.lengths = tok, []

    def encode(self, *args, **kwargs):
        return self.tok.encode(*args, **kwargs)

    def decode(self, ids, skip_special_tokens=True):
        self.lengths.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_each_step_decodes_a_small_window(tok):
    text = " ".join(TEXTS) * 20
    ids = ids_of(tok, text)
    counting = CountingTokenizer(tok)
    deltas, d = stream(counting, ids, prompt="a long prompt " * 50)
    assert d.text == text
    assert max(counting.lengths) <= 12
    assert len(counting.lengths) <= 2 * len(ids) + 2


# --- StopChecker ---------------------------------------------------------------------


def feed_all(checker: StopChecker, chunks, may_stop: bool = True) -> tuple[list[str], bool]:
    out, stopped = [], False
    for c in chunks:
        emit, stopped = checker.feed(c, may_stop)
        out.append(emit)
        if stopped:
            break
    return out, stopped


def test_no_stop_strings_pass_everything_through():
    c = StopChecker([])
    assert c.feed("abc") == ("abc", False)
    assert c.finish() == ""


def test_a_possible_stop_prefix_is_held_until_disambiguated():
    c = StopChecker(["\n\nUser"])
    assert c.feed("Hi") == ("Hi", False)
    assert c.feed("\n") == ("", False)
    assert c.feed("\n") == ("", False)
    assert c.feed("Us") == ("", False)
    assert c.feed("ed it") == ("\n\nUsed it", False)
    assert c.feed("\n\nUs") == ("", False)
    assert c.feed("er: more") == ("", True)
    assert c.text == "Hi\n\nUsed it"
    assert c.feed("anything") == ("", True)
    assert c.finish() == ""


def test_finish_releases_held_text():
    c = StopChecker(["\n\nUser"])
    assert c.feed("done\n\nUse") == ("done", False)
    assert c.finish() == "\n\nUse"
    assert c.text == "done\n\nUse"


def test_the_first_stop_to_complete_wins_and_the_stop_is_excluded():
    c = StopChecker(["cat", "at the"])
    assert feed_all(c, ["the c", "at the mat"]) == (["the ", ""], True)
    assert c.text == "the "
    c = StopChecker(["ab", "b"])
    assert feed_all(c, ["xa", "b"]) == (["x", ""], True)
    c = StopChecker(["STOP"])
    assert c.feed("STOP right there") == ("", True)
    assert c.text == ""


def test_stop_strings_across_token_boundaries_cut_exactly(tok):
    text = "Hello, world! How are you today? I am fine, thank you."
    for stop, expected in [("How are", "Hello, world! "), ("day? I", "Hello, world! How are you to"),
                           ("ank", "Hello, world! How are you today? I am fine, th"), ("nowhere", text)]:
        d, c = IncrementalDetokenizer(tok, []), StopChecker([stop])
        streamed, stopped = [], False
        for i in ids_of(tok, text):
            emit, stopped = c.feed(d.add(i))
            streamed.append(emit)
            if stopped:
                break
        if not stopped:
            streamed += [c.feed(d.flush())[0], c.finish()]
        assert "".join(streamed) == c.text == expected
        assert stopped == (stop != "nowhere")


def test_stop_on_a_split_multibyte_character(tok):
    d, c = IncrementalDetokenizer(tok, []), StopChecker(["😀"])
    out = [c.feed(d.add(i)) for i in ids_of(tok, "fish 😀 and chips")]
    assert "".join(e for e, _ in out) == "fish "
    assert out[-1][1]


@pytest.mark.parametrize("include_stop", [False, True])
def test_matches_a_reference_on_random_chunkings(include_stop):
    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice("ab\nc") for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice("ab\nc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        # The text stops where the first stop string completes (the longest, if several end there),
        # before it or, included, after it.
        hits = [(i + len(s), -len(s)) for s, i in ((s, text.find(s)) for s in stops) if i >= 0]
        end, minus_length = min(hits) if hits else (len(text), 0)
        expected = text[: end if include_stop else end + minus_length]
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 10))))
        chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        c = StopChecker(stops, include_stop)
        out, stopped = feed_all(c, chunks)
        tail = c.finish()
        assert "".join(out) + tail == expected == c.text, (text, stops, chunks)
        assert stopped == bool(hits)


def test_an_included_stop_string_ends_the_text_and_nothing_waits_for_it():
    c = StopChecker(["\n\nUser"], include_stop=True)
    assert c.feed("Hi\n") == ("Hi\n", False)  # it may begin the stop string: output either way
    assert c.feed("\nUs") == ("\nUs", False)
    assert c.feed("er: more") == ("er", True) and c.matched == "\n\nUser"
    assert c.text == "Hi\n\nUser" and c.finish() == ""
    c = StopChecker(["cat", "at the"], include_stop=True)
    assert feed_all(c, ["the c", "at the mat"]) == (["the c", "at"], True)
    c = StopChecker(["ab"], include_stop=True)  # before min_tokens, a stop string is text here too
    assert feed_all(c, ["xab", "a"], may_stop=False) == (["xab", "a"], False)
    assert c.feed("bc") == ("b", True) and c.text == "xabab"


def test_a_stop_that_completes_first_wins_over_one_that_started_earlier():
    c = StopChecker(["abc", "b"])
    assert feed_all(c, ["a", "b", "c"]) == (["", "a"], True) and c.matched == "b"
    c = StopChecker(["abc", "b"])
    assert feed_all(c, ["abc"]) == (["a"], True)  # the same, however the text is split


def test_a_stop_completed_before_it_may_stop_is_text_and_one_begun_there_still_ends_it():
    c = StopChecker(["ab"])
    assert feed_all(c, ["xab", "a"], may_stop=False) == (["x", "ab"], False)  # the last "a" may begin one
    assert c.feed("bc") == ("", True) and c.matched == "ab" and c.text == "xab"
    c = StopChecker(["ab"])
    assert feed_all(c, ["ab"], may_stop=False) == ([""], False) and c.finish() == "ab"


def test_thousands_of_stop_strings_match_like_one():
    many = StopChecker([f"stop-{i:06d}" for i in range(20_000)])
    few = StopChecker(["stop-999999"])
    text = "the model says stop-12 and stop-9 but never the whole thing " * 50
    for checker in (many, few):
        for ch in text:
            checker.feed(ch)
    # One automaton step per character either way; held text is never longer than a stop string.
    assert len(many._held) <= len("stop-000000") and many.text == few.text == text[: len(many.text)]
