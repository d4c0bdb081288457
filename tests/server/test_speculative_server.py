"""`kiln serve --speculative-model` on the compiled tiny model: prompt lookup and a draft model
give the tokens a server without speculation gives, streamed or not, and /metrics counts drafts."""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.e2e
# Token-id prompts that repeat themselves, so prompt lookup finds drafts.
PROMPTS = [[5, 9, 200, 31, 7] * 6, [40, 41, 42, 43] * 5 + [40, 41], list(range(10, 60))]


@pytest.fixture(scope="module")
def servers(start_server, tiny_server, tiny_artifacts):
    ngram = start_server("--artifacts", tiny_artifacts, "--speculative-model", "ngram",
                         "--num-speculative-tokens", "5", "--prompt-lookup-max", "3",
                         "--speculative-disable-by-batch-size", "0")
    draft = start_server("--artifacts", tiny_artifacts, "--speculative-model", tiny_artifacts,
                         "--num-speculative-tokens", "3")
    return {"plain": tiny_server, "ngram": ngram, "draft_model": draft}


def completion_tokens(server, prompt, stream=False, **extra) -> list[str]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        kwargs = dict(model=client.models.list().data[0].id, prompt=prompt, max_tokens=24, temperature=0,
                      logprobs=0, extra_body={"ignore_eos": True, **extra})
        if not stream:
            return client.completions.create(**kwargs).choices[0].logprobs.tokens
        tokens = []
        for chunk in client.completions.create(stream=True, **kwargs):
            if chunk.choices and chunk.choices[0].logprobs:
                tokens += chunk.choices[0].logprobs.tokens
        return tokens


def metric(server, name, label="") -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if (line.startswith(name + "{") or line.startswith(name + " ")) and label in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not in /metrics")


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_gives_the_plain_servers_tokens(servers, method):
    server = servers[method]
    for prompt in PROMPTS:
        plain = completion_tokens(servers["plain"], prompt)
        assert completion_tokens(server, prompt) == plain
        assert completion_tokens(server, prompt, stream=True) == plain
        assert completion_tokens(server, prompt, speculative=False) == plain
    drafted = metric(server, "kiln_spec_decode_draft_tokens_total")
    accepted = metric(server, "kiln_spec_decode_accepted_tokens_total")
    assert drafted > 0 and 0 <= accepted <= drafted
    if method == "draft_model":  # the draft is the model itself: every draft is right
        assert accepted == drafted
        assert metric(server, "kiln_spec_decode_mean_accepted_length") > 3
    assert metric(server, "kiln_model_steps_total", 'kind="speculate"') > 0


def test_opting_out_takes_a_bool(servers):
    response = httpx.post(servers["ngram"].url + "/v1/completions",
                          json={"prompt": "hi", "max_tokens": 2, "speculative": [1]})
    assert response.status_code == 400 and "speculative" in response.text
