"""shortfin's /generate on the tiny model: every field, plain and streaming, and its error codes."""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.e2e


def post(server, body, method="POST", **kwargs):
    return httpx.request(method, server.url + "/generate", json=body, timeout=60, **kwargs)


def events(response) -> list:
    """The `data:` payloads of an SSE response, [DONE] last."""
    out = [line[len("data: "):] for line in response.text.split("\n\n") if line.startswith("data: ")]
    assert out[-1] == "[DONE]"
    return [json.loads(x) for x in out[:-1]]


def test_text_single(tiny_server):
    response = post(tiny_server, {"text": "the cat", "sampling_params": {"max_completion_tokens": 8}})
    assert response.status_code == 200
    body = response.json()
    assert list(body) == ["responses"]
    [prompt] = body["responses"]
    assert set(prompt) == {"prompt", "responses"} and prompt["prompt"] == "the cat"
    [generated] = prompt["responses"]
    assert set(generated) == {"text"} and isinstance(generated["text"], str)


def test_a_json_body_without_a_json_content_type(tiny_server):
    """curl -d sends form-urlencoded; the body is JSON all the same, as shortfin reads it."""
    body = json.dumps({"text": "the cat", "sampling_params": {"max_completion_tokens": 4}})
    response = httpx.post(tiny_server.url + "/generate", content=body, timeout=60,
                          headers={"content-type": "application/x-www-form-urlencoded"})
    assert response.status_code == 200 and response.json()["responses"][0]["prompt"] == "the cat"


def test_greedy_by_default_as_shortfin(tiny_server):
    """Without top_k or top_p, shortfin picks the best token whatever the temperature."""
    body = {"text": "the dog", "sampling_params": {"max_completion_tokens": 10, "temperature": 1.5}}
    first, second = post(tiny_server, body).json(), post(tiny_server, body).json()
    assert first == second
    ids = post(tiny_server, {**body, "return_input_ids": True}).json()
    assert len(ids) == 10 and all(isinstance(t, int) for t in ids)
    # 50 tokens by default (or fewer if EOS came first).
    default = post(tiny_server, {"text": "the dog", "return_input_ids": True}).json()
    assert default[:10] == ids and len(default) <= 50


def test_batch_of_texts_and_ids_put(tiny_server):
    texts = ["the cat", "a dog and"]
    by_text = post(tiny_server, {"text": texts, "sampling_params": {"max_completion_tokens": 6},
                                 "return_input_ids": True}).json()
    assert len(by_text) == 2 and all(len(ids) == 6 for ids in by_text)
    solo = [post(tiny_server, {"text": t, "sampling_params": {"max_completion_tokens": 6},
                               "return_input_ids": True}).json() for t in texts]
    assert by_text == solo
    # PUT works as POST; input_ids flat (one prompt) or nested (a batch).
    prompt_ids = [5, 17, 40, 99]
    single = post(tiny_server, {"input_ids": prompt_ids, "sampling_params": {"max_completion_tokens": 4}},
                  method="PUT").json()
    assert single["responses"][0]["prompt"] and len(single["responses"][0]["responses"]) == 1
    nested = post(tiny_server, {"input_ids": [prompt_ids, prompt_ids[:2]], "rid": ["a", "b"],
                                "sampling_params": [{"max_completion_tokens": 4}, {"max_completion_tokens": 2}]},
                  method="PUT").json()
    assert len(nested["responses"]) == 2
    assert nested["responses"][0]["responses"] == single["responses"][0]["responses"]


def test_sampling_fields(tiny_server):
    base = {"text": "the cat sat", "return_input_ids": True}
    sampled = {"max_completion_tokens": 12, "temperature": 0.9, "top_k": 20, "top_p": 0.9, "seed": 3, "n": 3}
    first = post(tiny_server, {**base, "sampling_params": sampled}).json()
    assert len(first) == 3 and all(len(ids) == 12 for ids in first)
    assert first == post(tiny_server, {**base, "sampling_params": sampled}).json()  # seeded
    assert len({tuple(ids) for ids in first}) > 1  # n samples, not copies
    beams = post(tiny_server, {**base, "sampling_params": {"max_completion_tokens": 4, "num_beams": 2}}).json()
    assert len(beams) == 2
    text = post(tiny_server, {"text": "the cat sat", "sampling_params": {"max_completion_tokens": 30}}).json()
    full = text["responses"][0]["responses"][0]["text"]
    if len(full) > 3:
        stop = full[2:4]
        cut = post(tiny_server, {"text": "the cat sat", "sampling_params": {"max_completion_tokens": 30,
                                                                           "stop": stop}}).json()
        assert cut["responses"][0]["responses"][0]["text"] == full[: full.index(stop)]


def test_streaming(tiny_server):
    body = {"text": ["the cat", "a dog"], "rid": ["r1", "r2"], "stream": True,
            "sampling_params": {"max_completion_tokens": 5, "n": 2, "top_k": 10, "seed": 1}}
    response = post(tiny_server, body)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    stream = events(response)
    assert {(e["rid"], e["prompt_index"], e["index"]) for e in stream} == {
        ("r1", 0, 0), ("r1", 0, 1), ("r2", 1, 0), ("r2", 1, 1)}
    assert sum(len(e["token_ids"]) for e in stream) == 4 * 5
    assert sum(1 for e in stream if e["finish_reason"] == "length") == 4
    plain = post(tiny_server, {**body, "stream": False}).json()
    for i, rid in enumerate(["r1", "r2"]):
        for j in range(2):
            text = "".join(e["text"] for e in stream if e["rid"] == rid and e["index"] == j)
            assert text == plain["responses"][i]["responses"][j]["text"]


@pytest.mark.parametrize("body, status, fragment", [
    ({"text": "a", "input_ids": [1]}, 400, "Either text or input_ids"),
    ({}, 400, "Either text or input_ids"),
    ({"text": ["a", "b"], "rid": "x"}, 400, "rid"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, 400, "sampling_params"),
    ({"text": "a", "sampling_params": {"use_beam_search": True}}, 400, "beam search"),
    ({"text": "a", "sampling_params": {"max_completion_tokens": 0}}, 400, "max_tokens"),
    ({"text": "a", "sampling_params": {"top_p": 1.5}}, 400, "top_p"),
    ({"text": "a", "sampling_params": {"max_completion_tokens": 10_000}}, 400, "context length"),
    ({"input_ids": [1, 2, 100_000]}, 400, "vocabulary"),
    ({"input_ids": []}, 400, "empty"),
    ({"text": 5}, 422, "text"),
    ({"text": "a", "sampling_params": {"n": "many"}}, 422, "n"),
])
def test_errors_in_shortfin_shape(tiny_server, body, status, fragment):
    response = post(tiny_server, body)
    assert response.status_code == status, response.text
    error = response.json()
    assert set(error) == {"error", "code"} and error["code"] == "INVALID_REQUEST_ARGS"
    assert fragment in error["error"]


def test_malformed_json(tiny_server):
    response = httpx.post(tiny_server.url + "/generate", content=b'{"text": "a",', timeout=10,
                          headers={"content-type": "application/json"})
    assert response.status_code == 422
    assert response.json()["code"] == "INVALID_REQUEST_ARGS" and "JSON" in response.json()["error"]
