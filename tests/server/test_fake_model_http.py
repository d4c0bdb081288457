"""The HTTP layer over a fake program, on a real server on 127.0.0.1: routes, the checks
every route shares, error types, and what a client must not be able to do, with no
compiled model."""

from __future__ import annotations

import json
import time

import httpx
import numpy as np
import pytest
from websockets.sync.client import connect

from tests.fake_program import expected_greedy, hidden_state


class Client(httpx.Client):
    """httpx to a server on 127.0.0.1, with its service at hand and WebSockets beside HTTP."""

    def __init__(self, port: int, service):
        super().__init__(base_url=f"http://127.0.0.1:{port}", timeout=60)
        self.port, self.service = port, service

    def websocket_connect(self, path: str):
        return JsonSocket(connect(f"ws://127.0.0.1:{self.port}{path}"))


class JsonSocket:
    def __init__(self, connection):
        self.connection = connection

    def __enter__(self):
        self.socket = self.connection.__enter__()
        return self

    def __exit__(self, *exc):
        self.connection.__exit__(*exc)

    def send_json(self, payload) -> None:
        self.socket.send(json.dumps(payload))

    def receive_json(self):
        return json.loads(self.socket.recv(timeout=30))


@pytest.fixture(scope="module")
def client(start_fake_server):
    port, service = start_fake_server()
    with Client(port, service) as client:
        yield client


def test_completions_tokens_follow_the_model(client):
    ids = [5, 9, 13, 40]
    body = client.post("/v1/completions", json={"model": "fake", "prompt": ids, "max_tokens": 6, "temperature": 0,
                                                "ignore_eos": True}).json()
    service = client.service
    assert body["choices"][0]["text"] == service.decode(expected_greedy(ids, 6))
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_embeddings_are_the_last_hidden_state_normalised_whatever_the_batch(client):
    prompts = [[5, 9, 13, 40] * k for k in range(1, 7)]  # six: a batch of 4 and two more
    body = client.post("/v1/embeddings", json={"input": prompts}).json()
    for ids, data in zip(prompts, body["data"]):
        expected = hidden_state(ids)
        assert data["embedding"] == pytest.approx((expected / np.linalg.norm(expected)).tolist(), abs=1e-6)
    cut = client.post("/v1/embeddings", json={"input": prompts[0], "dimensions": 4}).json()["data"][0]["embedding"]
    assert cut == pytest.approx((hidden_state(prompts[0])[:4] / np.linalg.norm(hidden_state(prompts[0])[:4])).tolist(),
                                abs=1e-6)
    assert client.service.stats().steps["embed"] >= 2


def test_an_embedding_request_its_client_leaves_is_aborted_and_gives_its_pages_back(client):
    service = client.service
    before = service.stats().steps["embed"]
    prompts = [[5 + i % 300, 9, 13, 40] * 60 for i in range(2000)]  # 2,000 inputs of 240 tokens: 500 calls or more
    with pytest.raises(httpx.ReadTimeout):
        client.post("/v1/embeddings", json={"input": prompts}, timeout=0.5)
    deadline = time.monotonic() + 30
    while service.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = service.stats()
    assert service.in_flight == 0 and stats.pages_active == 0
    assert stats.steps["embed"] - before < 500  # the inputs not yet written never were


def test_generate_route_returns_token_ids(client):
    ids = [7, 8, 9]
    answer = client.post("/generate", json={"input_ids": ids, "return_input_ids": True,
                                            "sampling_params": {"max_completion_tokens": 5, "ignore_eos": True}})
    assert answer.status_code == 200 and answer.json() == expected_greedy(ids, 5)


def test_chat_defaults_max_tokens_to_the_rest_of_the_context(client):
    body = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "ignore_eos": True}).json()
    service = client.service
    assert body["usage"]["total_tokens"] == service.context_capacity
    assert body["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path, payload, status, param, code", [
    ("/v1/completions", {"model": "other", "prompt": "x"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", "invalid_request"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", "invalid_request"),
    ("/v1/completions", {"prompt": [5, 999]}, 400, "prompt", "invalid_request"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10_000}, 400, "max_tokens", "invalid_request"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages", "invalid_request"),
])
def test_errors_carry_type_code_and_param(client, path, payload, status, param, code):
    answer = client.post(path, json=payload)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert (error["param"], error["code"]) == (param, code)


def test_models_lists_names_not_paths(client):
    [model] = client.get("/v1/models").json()["data"]
    assert model["id"] == "fake" and model["root"] == "fake"


def test_websocket_uses_the_same_checks(client):
    with client.websocket_connect("/ws") as socket:
        socket.send_json({"type": "generate", "id": "a", "input_ids": [5, 6], "n": 99})
        message = socket.receive_json()
        assert message["type"] == "error" and message["error"]["param"] == "n"
        socket.send_json({"type": "generate", "id": "b", "input_ids": [5, 6], "max_tokens": 3, "temperature": 0,
                          "ignore_eos": True})
        messages = []
        while not messages or messages[-1]["type"] != "done":
            messages.append(socket.receive_json())
        assert [t for m in messages if m["type"] == "token" for t in m["token_ids"]] == expected_greedy([5, 6], 3)


@pytest.mark.parametrize("path, payload, param", [
    ("/v1/completions", {"prompt": [-1], "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": [[8589934592]], "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": [[5], [5, 384]], "max_tokens": 1}, "prompt"),
    ("/generate", {"input_ids": [5, -1]}, "input_ids"),
    ("/generate", {"input_ids": [[5], [2**40]]}, "input_ids"),
])
def test_token_ids_outside_the_vocabulary_are_a_400_naming_the_index(client, path, payload, param):
    answer = client.post(path, json=payload)
    assert answer.status_code == 400, answer.text
    body = answer.json()
    message = body["error"] if path == "/generate" else body["error"]["message"]
    assert "outside the vocabulary" in message and f"{param}[" in message
    answer = client.put(path, json=payload) if path == "/generate" else None
    assert answer is None or answer.status_code == 400


def test_websocket_token_ids_are_checked_too(client):
    with client.websocket_connect("/ws") as socket:
        socket.send_json({"type": "generate", "id": "a", "input_ids": [5, 10**12]})
        message = socket.receive_json()
        assert message["type"] == "error" and message["error"]["param"] == "input_ids"


def test_stop_lists_are_bounded(client):
    answer = client.post("/v1/completions", json={"prompt": "hi", "stop": [f"s{i}" for i in range(200_000)]})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "stop"
    answer = client.post("/v1/completions", json={"prompt": "hi", "stop": ["x" * 10_000]})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "stop"
    answer = client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 4, "stop": ["zz"] * 64})
    assert answer.status_code == 200


def streamed_text(client, path: str, body: dict) -> tuple[str, str]:
    """An OpenAI stream's text, joined, and its finish reason."""
    text, finish = "", None
    with client.stream("POST", path, json={**body, "stream": True}) as answer:
        for line in answer.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line.removeprefix("data: "))["choices"]:
                    text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    finish = choice["finish_reason"] or finish
    return text, finish


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": [5, 9, 13, 40]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_include_stop_str_in_output_keeps_the_stop_string(client, path, body):
    def text(answer) -> str:
        choice = answer.json()["choices"][0]
        return choice["text"] if path == "/v1/completions" else choice["message"]["content"]

    body = {**body, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    plain = text(client.post(path, json=body))
    needle = plain[len(plain) // 2:][:2]
    assert needle.strip(), plain
    cut = plain.find(needle)
    stopped = {**body, "stop": [needle]}
    assert text(client.post(path, json=stopped)) == plain[:cut]
    included = {**stopped, "include_stop_str_in_output": True}
    answer = client.post(path, json=included)
    assert text(answer) == plain[:cut + len(needle)] and answer.json()["choices"][0]["finish_reason"] == "stop"
    assert streamed_text(client, path, included) == (plain[:cut + len(needle)], "stop")


@pytest.mark.parametrize("path", ["/v1/completions", "/generate"])
def test_a_body_that_is_not_utf8_is_a_400_that_says_so(client, path):
    answer = client.post(path, content=b'{"prompt": "\xff\xfe", "text": "\xff"}',
                         headers={"content-type": "application/json"})
    assert answer.status_code == 400
    body = answer.json()
    message = body["error"] if path == "/generate" else body["error"]["message"]
    assert "UTF-8" in message
    assert (body["code"] if path == "/generate" else body["error"]["code"]) in ("INVALID_REQUEST_ARGS", "invalid_request")


def test_the_rate_limit_counts_websocket_generations_not_handshakes(start_fake_server):
    port, service = start_fake_server(rate_limit=1)
    with Client(port, service) as client:
        with client.websocket_connect("/ws") as socket:
            for index in range(5):
                socket.send_json({"type": "generate", "id": str(index), "input_ids": [5, 6], "max_tokens": 1})
            answers = {}
            while len(answers) < 5:
                message = socket.receive_json()
                if message["type"] in ("done", "error"):
                    answers[message["id"]] = message
    refused = [m for m in answers.values() if m["type"] == "error"]
    assert len(refused) >= 3  # a burst of 1, one more per second
    assert all(m["error"]["code"] == "rate_limit_exceeded" for m in refused)


def test_tokenize_detokenize_and_tokenizer_info_as_vllm_serves_them(client):
    service = client.service
    answer = client.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
    assert answer["tokens"] == service.encode("hello world") and answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] == service.max_seq_len and len(answer["token_strs"]) == answer["count"]
    assert client.post("/detokenize", json={"tokens": answer["tokens"]}).json()["prompt"].endswith("hello world")
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 3 and client.post("/tokenize", json={}).status_code == 400
    bad = client.post("/detokenize", json={"tokens": [5, -3]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert client.post("/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == "</s>" and info["vocab_size"] == service.vocab_size and info["chat_template"]


def test_logit_bias_steers_the_choice(client):
    ids = [5, 9, 13]
    plain = expected_greedy(ids, 1)[0]
    forced = plain + 50 if plain + 50 < 384 else plain - 50  # logits fall by 1 per id away from the best
    body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "logit_bias": {str(forced): 100, str(plain): -100}}
    answer = client.post("/generate", json={"input_ids": ids, "return_input_ids": True,
                                            "sampling_params": {"max_completion_tokens": 1}})
    assert answer.json() == [plain]
    completion = client.post("/v1/completions", json={**body, "logprobs": 0}).json()
    assert completion["choices"][0]["logprobs"]["tokens"] == [client.service.decode([forced],
                                                                                    skip_special_tokens=False)]


def scrape(client) -> tuple[dict[str, float], dict[str, str]]:
    """/metrics as {sample with its labels: value} and {family: type}."""
    samples, types = {}, {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split()
            types[family] = kind
        elif line and not line.startswith("#"):
            sample, value = line.rsplit(" ", 1)
            samples[sample] = float(value)
    return samples, types


def test_metrics_name_the_model_and_observe_each_finished_request(client):
    before, _ = scrape(client)
    body = {"model": "fake", "prompt": [5, 9, 13], "max_tokens": 4, "temperature": 0, "ignore_eos": True, "n": 2}
    assert client.post("/v1/completions", json=body).status_code == 200
    after, types = scrape(client)
    # Every sample names the model, as vLLM's do (the first served name, as /v1/models lists it).
    assert all('model_name="fake"' in sample for sample in after), [s for s in after if "model_name" not in s]
    # promtool's lint: `_total` is a counter's suffix, never a gauge's.
    assert not [family for family, kind in types.items() if kind == "gauge" and family.endswith("_total")]
    assert types["kiln_kv_pages_capacity"] == "gauge" and "kiln_kv_pages_total" not in types

    def grew(name: str, **labels) -> float:
        key = name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted({**labels, "model_name": "fake"}.items())) + "}"
        return after[key] - before.get(key, 0)

    # One request of two sequences: observed once, its tokens those of both.
    for family in ("kiln_request_queue_time_seconds", "kiln_request_prompt_tokens", "kiln_request_generation_tokens"):
        assert types[family] == "histogram" and grew(f"{family}_count") == 1, family
    assert grew("kiln_request_prompt_tokens_sum") == 3 and grew("kiln_request_generation_tokens_sum") == 8
    assert grew("kiln_request_generation_tokens_bucket", le="5.0") == 0
    assert grew("kiln_request_generation_tokens_bucket", le="10.0") == 1
    assert 0 <= grew("kiln_request_queue_time_seconds_sum") < 5


def test_vllm_named_series_for_routers(client):
    """What llm-d's endpoint picker and vLLM's production-stack router read, under vLLM's names."""
    before, _ = scrape(client)
    body = {"model": "fake", "prompt": [5, 9, 13, 17, 21, 25, 29, 33, 2, 4], "max_tokens": 3, "temperature": 0}
    for _ in range(2):  # the second finds the first's full pages in the prefix cache
        assert client.post("/v1/completions", json=body).status_code == 200
    after, types = scrape(client)
    key = '{model_name="fake"}'
    assert types["vllm:num_requests_running"] == types["vllm:num_requests_waiting"] == "gauge"
    assert after["vllm:num_requests_running" + key] == 0 and after["vllm:num_requests_waiting" + key] == 0
    assert after["vllm:kv_cache_usage_perc" + key] == 0.0
    assert types["vllm:prefix_cache_queries_total"] == types["vllm:prefix_cache_hits_total"] == "counter"
    queries = after["vllm:prefix_cache_queries_total" + key] - before.get("vllm:prefix_cache_queries_total" + key, 0)
    hits = after["vllm:prefix_cache_hits_total" + key] - before.get("vllm:prefix_cache_hits_total" + key, 0)
    assert queries == 20 and 0 < hits < 10


def test_reset_prefix_cache_drops_what_no_request_uses(client):
    """vLLM's /reset_prefix_cache and SGLang's /flush_cache: a cold cache for the next request."""
    prompt = list(range(20, 100))  # several full pages
    body = {"model": "fake", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    client.post("/v1/completions", json=body)
    again = client.post("/v1/completions", json=body).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert client.post("/reset_prefix_cache").json()["dropped_pages"] >= len(prompt) // 4  # the prompt's pages
    assert client.service.cache.stats().cached == 0
    cold = client.post("/v1/completions", json=body).json()
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert client.get("/flush_cache").json()["dropped_pages"] >= len(prompt) // 4
    assert client.get("/version").json()["version"]
