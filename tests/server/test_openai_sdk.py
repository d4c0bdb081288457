"""The official `openai` SDK, unchanged, against `kiln serve` on SmolLM2-135M."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.export.test_smollm2 import REFERENCE_CONTINUATION, REFERENCE_PROMPT

pytestmark = [pytest.mark.e2e, pytest.mark.smollm2]


@pytest.fixture(scope="module")
def client(smol_server):
    with openai.OpenAI(base_url=smol_server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def test_models(client, smol_server):
    [model] = client.models.list().data
    assert model.id == "smol" and model.owned_by == "kiln"


def test_reference_continuation(client):
    response = client.completions.create(model="smol", prompt=REFERENCE_PROMPT, max_tokens=32, temperature=0)
    [choice] = response.choices
    assert choice.text == REFERENCE_CONTINUATION
    assert choice.finish_reason == "length"
    assert response.id.startswith("cmpl-") and response.object == "text_completion" and response.created > 0
    assert response.usage.completion_tokens == 32
    assert response.usage.total_tokens == response.usage.prompt_tokens + 32


def test_reference_continuation_streamed(client):
    chunks = list(client.completions.create(model="smol", prompt=REFERENCE_PROMPT, max_tokens=32, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == REFERENCE_CONTINUATION
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 32


def test_token_id_prompts_and_several_prompts(client, smollm2_artifacts):
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(smollm2_artifacts / "tokenizer.json")).encode(REFERENCE_PROMPT).ids
    by_ids = client.completions.create(model="smol", prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == REFERENCE_CONTINUATION[: len(by_ids.choices[0].text)]
    assert by_ids.usage.prompt_tokens == len(ids)
    response = client.completions.create(model="smol", prompt=[ids, ids[:3]], max_tokens=8, temperature=0, n=2)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert response.choices[0].text == response.choices[1].text == by_ids.choices[0].text
    assert response.usage.prompt_tokens == len(ids) + 3
    strings = client.completions.create(model="smol", prompt=[REFERENCE_PROMPT, "The capital of France is"],
                                        max_tokens=8, temperature=0)
    assert strings.choices[0].text == by_ids.choices[0].text and len(strings.choices) == 2


def test_vllm_and_openai_extras(client):
    """vLLM's extra sampling fields (through the SDK's extra_body), penalties and `user` are accepted."""
    greedy = client.completions.create(model="smol", prompt=REFERENCE_PROMPT, max_tokens=32, temperature=0)
    extras = client.completions.create(
        model="smol", prompt=REFERENCE_PROMPT, max_tokens=32, temperature=0.8, user="someone",
        extra_body={"top_k": 1, "min_p": 0.05, "ignore_eos": True, "priority": -1, "repetition_penalty": 1.0})
    assert extras.choices[0].text == greedy.choices[0].text  # top_k 1 is greedy whatever the temperature
    penalized = client.completions.create(model="smol", prompt=REFERENCE_PROMPT, max_tokens=32, temperature=0,
                                          presence_penalty=1.5, frequency_penalty=1.5)
    assert penalized.choices[0].text != greedy.choices[0].text  # repeating ", " is penalized
    chat = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          extra_body={"ignore_eos": True, "min_tokens": 4})
    assert chat.usage.completion_tokens == 4 and chat.choices[0].finish_reason == "length"


def test_stop_strings(client):
    response = client.completions.create(model="smol", prompt=REFERENCE_PROMPT, max_tokens=32, temperature=0,
                                         stop=[" 9,", "zzz"])
    assert response.choices[0].text == " 6, 7, 8,"
    assert response.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model="smol", prompt=REFERENCE_PROMPT, max_tokens=32, temperature=0,
                                       stop=" 9,", stream=True)
    assert "".join(c.choices[0].text for c in chunks) == " 6, 7, 8,"


def test_seed_repeats_and_n_differs(client):
    def sample(seed):
        return [c.text for c in client.completions.create(
            model="smol", prompt="Once upon a time", max_tokens=12, temperature=1.0, top_p=0.95, n=3, seed=seed
        ).choices]

    first, again, other = sample(7), sample(7), sample(8)
    assert first == again
    assert first != other
    assert len(set(first)) > 1  # the n samples are not copies of each other


def test_logprobs(client):
    response = client.completions.create(model="smol", prompt=REFERENCE_PROMPT, max_tokens=5, temperature=0, logprobs=3)
    logprobs = response.choices[0].logprobs
    assert "".join(logprobs.tokens) == response.choices[0].text
    assert len(logprobs.token_logprobs) == 5 and all(lp <= 0 for lp in logprobs.token_logprobs)
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) == 3 and max(top, key=top.get) == token  # greedy: the chosen token is the best
        assert top[token] == pytest.approx(logprob)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(5)]


def test_echo_scores_the_prompt(client, smol_server, smollm2_artifacts):
    """What lm-eval's loglikelihood sends: echo, logprobs, max_tokens 0 (or 1, dropping the last)."""
    from tokenizers import Tokenizer

    text = REFERENCE_PROMPT + " 6, 7"
    whole = client.completions.create(model="smol", prompt=text, max_tokens=0, echo=True, logprobs=1,
                                      temperature=0).choices[0]
    assert whole.text == text and whole.finish_reason == "length"
    lp = whole.logprobs
    assert "".join(lp.tokens) == text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x < 0 for x in lp.token_logprobs[1:]) and all(len(top) == 1 for top in lp.top_logprobs[1:])
    # max_tokens 1 scores the prompt the same and adds one generated token.
    one = client.completions.create(model="smol", prompt=text, max_tokens=1, echo=True, logprobs=1,
                                    temperature=0).choices[0]
    assert len(one.logprobs.tokens) == len(lp.tokens) + 1 and one.text.startswith(text)
    assert one.logprobs.token_logprobs[1:-1] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)

    # A greedy continuation, scored as a prompt, is the model's top choice with the sampler's logprobs.
    context = Tokenizer.from_file(str(smollm2_artifacts / "tokenizer.json")).encode(REFERENCE_PROMPT).ids
    greedy = httpx.post(smol_server.url + "/generate", json={
        "input_ids": context, "sampling_params": {"max_completion_tokens": 4}, "return_input_ids": True}).json()
    plain = client.completions.create(model="smol", prompt=context, max_tokens=4, temperature=0, logprobs=1)
    scored = client.completions.create(model="smol", prompt=context + greedy, max_tokens=0, echo=True, logprobs=1)
    tail = scored.choices[0].logprobs
    assert tail.tokens[-4:] == plain.choices[0].logprobs.tokens
    assert tail.token_logprobs[-4:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-3)
    assert all(max(top, key=top.get) == token for token, top in zip(tail.tokens[-4:], tail.top_logprobs[-4:]))


def test_chat(client):
    response = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=64, temperature=0)
    [choice] = response.choices
    assert choice.message.role == "assistant" and "4" in choice.message.content
    assert choice.finish_reason == "stop"
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"
    # Content as a list of text parts renders the same prompt.
    parts = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": [{"type": "text", "text": "What is "},
                                                             {"type": "text", "text": "2+2?"}]}],
        max_tokens=64, temperature=0)
    assert parts.choices[0].message.content == choice.message.content
    assert parts.usage.prompt_tokens == response.usage.prompt_tokens
    assert parts.usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again: a prefix-cache hit


def test_chat_streamed_with_logprobs_and_n(client):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    plain = client.chat.completions.create(model="smol", messages=messages, max_completion_tokens=12, temperature=0)
    stream = client.chat.completions.create(model="smol", messages=messages, max_completion_tokens=12, temperature=0,
                                            n=2, stream=True, logprobs=True, top_logprobs=2,
                                            stream_options={"include_usage": True})
    texts, finishes, logprobs, usage = ["", ""], [None, None], [[], []], None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
            if choice.logprobs:
                logprobs[choice.index] += choice.logprobs.content
    assert texts == [plain.choices[0].message.content] * 2
    assert finishes == [plain.choices[0].finish_reason] * 2
    # Every token is scored, the end-of-turn token that stopped it too.
    assert "".join(entry.token for entry in logprobs[0]) in (texts[0], texts[0] + "<|im_end|>")
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in logprobs[0])
    assert usage.completion_tokens == 2 * plain.usage.completion_tokens


def test_chat_without_max_tokens_fills_the_context(client, smol_server):
    # Greedy, so the answer ends the same way every run (sampled, it may ramble to the context limit).
    response = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Say hi."}],
                                              temperature=0)
    assert response.choices[0].finish_reason == "stop"


def test_errors_through_the_sdk(client):
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="gpt-4", prompt="hi")
    assert error.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="smol", prompt="hi", temperature=-1)
    assert error.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "hi"}], max_tokens=10**6)


def solo_and_together(client, prompts, max_tokens=16):
    def run(prompt):
        stream = client.completions.create(model="smol", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           logprobs=0, stream=True)
        tokens = []
        for chunk in stream:
            if chunk.choices and chunk.choices[0].logprobs:
                tokens += chunk.choices[0].logprobs.tokens
        return tokens

    solo = [run(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(run, prompts))
    return solo, together


def test_sixteen_concurrent_streams_match_solo(client, smol_server):
    prompts = [f"{topic}" for topic in (
        "The capital of France is", "def fibonacci(n):", "Water boils at", "My favourite animal is the",
        "1, 2, 3, 4, 5,", "The sun rises in the", "import numpy as", "Once upon a time",
        "The largest planet is", "SELECT * FROM", "Dear Sir or Madam,", "The chemical symbol for gold is",
        "In 1492, Columbus", "a, b, c, d,", "The opposite of hot is", "Roses are red,")]
    solo, together = solo_and_together(client, prompts)
    assert all(len(tokens) > 0 for tokens in solo)
    assert together == solo
    assert smol_server.wait_metric("kiln_kv_pages_active", 0) == 0


def test_metrics_after_traffic(smol_server):
    text = httpx.get(smol_server.url + "/metrics").text
    for name in ("kiln_time_to_first_token_seconds_count", "kiln_inter_token_latency_seconds_count",
                 "kiln_generation_tokens_total", "kiln_prompt_tokens_total", "kiln_kv_pages_capacity",
                 "kiln_kv_pages_free", "kiln_kv_pages_cached", "kiln_kv_pages_active", "kiln_requests_waiting",
                 "kiln_sequences_running", "kiln_prefix_cache_hit_tokens_total",
                 "kiln_request_queue_time_seconds_count", "kiln_request_prompt_tokens_count",
                 "kiln_request_generation_tokens_count"):
        assert f'{name}{{model_name="smol"' in text, name
    assert smol_server.metric("kiln_time_to_first_token_seconds_count") > 0
    assert smol_server.metric("kiln_prefix_cache_hit_tokens_total") > 0
    assert smol_server.metric("kiln_request_generation_tokens_count") > 0
    total = smol_server.metric("kiln_kv_pages_capacity")
    parts = [smol_server.metric(f"kiln_kv_pages_{k}") for k in ("free", "cached", "active")]
    assert sum(parts) == total and not math.isnan(total)
    assert 'kiln_requests_total{method="POST",model_name="smol",route="/v1/completions",status="200"}' in text
