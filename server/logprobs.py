"""Logprobs in OpenAI's two shapes: the legacy completions one and the chat one.

Token strings are each token decoded alone (special tokens kept), as vLLM returns them;
a token that ends mid-character shows U+FFFD, and its `bytes` in the chat shape are
the UTF-8 of that string.
"""

from __future__ import annotations

from functools import lru_cache

from kiln.runtime.request import TokenLogprob


class TokenText:
    """Each token's own text, decoded once (`decode` turns ids into text, special tokens kept)."""

    def __init__(self, decode):
        self.text = lru_cache(maxsize=65536)(lambda token_id: decode([token_id]))


def completion_logprobs(token_text: TokenText, token_ids: list[int], entries: list[TokenLogprob | None],
                        offset: int = 0) -> dict:
    """{tokens, token_logprobs, top_logprobs, text_offset} for these tokens. An entry of None
    (the first prompt token, which nothing predicts) has null logprobs; offsets count from `offset`."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(token_ids, entries):
        text = token_text.text(token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(None if entry is None else entry.logprob)
        out["top_logprobs"].append(None if entry is None else {token_text.text(t): lp for t, lp in entry.top.items()})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def join_completion_logprobs(first: dict, second: dict) -> dict:
    return {key: first[key] + second[key] for key in first}


def chat_logprobs(token_text: TokenText, entries: list[TokenLogprob]) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        text = token_text.text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [
        {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top.items()]}
        for e in entries
    ]}
