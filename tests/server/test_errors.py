"""Every bad input gets its status and OpenAI's error body; never a 500 for what a client sent."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kiln.runtime import GenerateService, ServiceConfig
from kiln.runtime.contract import Artifacts
from kiln.server.app import create_app
from kiln.server.settings import ServerSettings
from tests.fake_program import FakeProgram

pytestmark = pytest.mark.e2e

CHAT = [{"role": "user", "content": "hello"}]


def assert_openai_error(response, status: int, fragment: str = "", param: str | None = None, code: str | None = None):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert fragment in body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
    if code is not None:
        assert body["error"]["code"] == code
    assert response.headers["x-request-id"]
    return body["error"]


@pytest.mark.parametrize("body, fragment, param", [
    ({"prompt": "hi", "temperature": -1}, "temperature", "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p", "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "max_tokens"),
    ({"prompt": "hi", "max_tokens": 1000}, "maximum context length", "max_tokens"),
    ({"prompt": "hi " * 300}, "maximum context length", "prompt"),  # the prompt alone is too long
    ({"prompt": [1, 2, 5000]}, "vocabulary", None),
    ({"prompt": []}, "prompt", "prompt"),
    ({"prompt": "", "add_special_tokens": False}, "empty", None),
    ({"prompt": ["ok", ""], "add_special_tokens": False}, "prompt 1", None),
    ({"prompt": "hi", "n": 0}, "n must be", "n"),
    ({"prompt": "hi", "n": 1000}, "n must be", "n"),
    ({"prompt": "hi", "logprobs": 99}, "logprobs", "logprobs"),
    ({"prompt": "hi", "stop": [""]}, "stop", None),
    ({"prompt": "hi", "presence_penalty": 3}, "presence_penalty", "presence_penalty"),
    ({"prompt": "hi", "seed": 1.5}, "seed", "seed"),
    ({"prompt": "hi", "suffix": "x"}, "suffix", "suffix"),
    ({"prompt": "hi", "best_of": 3}, "best_of", "best_of"),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias", "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"a token": 1}}, "logit_bias", "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"100000": 1}}, "logit_bias", "logit_bias"),
    ({"prompt": 5}, "prompt", "prompt"),
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens", "max_tokens"),
    ({}, "prompt", "prompt"),
])
def test_bad_completions(tiny_server, body, fragment, param):
    response = httpx.post(tiny_server.url + "/v1/completions", json=body, timeout=30)
    error = assert_openai_error(response, 400, fragment, param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, fragment, param", [
    ({"messages": []}, "messages", "messages"),
    ({"messages": [{"content": "no role"}]}, "role", None),
    ({"messages": CHAT, "top_logprobs": 2}, "logprobs", "top_logprobs"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 50}, "top_logprobs", "top_logprobs"),
    ({"messages": CHAT, "tools": [{"type": "function"}]}, "tools", "tools"),
    ({"messages": CHAT, "response_format": {"type": "xml"}}, "response_format", "response_format"),
    ({"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema",
     "response_format"),
    ({"messages": CHAT, "guided_regex": "[a-"}, "regex", "guided_regex"),
    ({"messages": CHAT, "guided_choice": []}, "guided_choice", "guided_choice"),
    ({"messages": CHAT, "guided_regex": "a+", "guided_choice": ["a"]}, "one structured-output", "guided_choice"),
    ({"messages": CHAT, "structured_outputs": {"xml": "<a/>"}}, "structured_outputs", "structured_outputs"),
    ({"messages": CHAT, "guided_json": {"type": "object"}, "min_tokens": 3}, "min_tokens", "min_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "only text", None),
    ({"messages": [{"role": "user", "content": "hi " * 300}]}, "maximum context length", "messages"),
    ({"messages": CHAT, "max_completion_tokens": 10_000}, "maximum context length", "max_tokens"),
])
def test_bad_chat(tiny_server, body, fragment, param):
    response = httpx.post(tiny_server.url + "/v1/chat/completions", json=body, timeout=30)
    assert_openai_error(response, 400, fragment, param)


def test_unknown_model_is_404_and_aliases_work(tiny_server):
    for route, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": CHAT})):
        response = httpx.post(tiny_server.url + route, json={**body, "model": "gpt-4"}, timeout=30)
        error = assert_openai_error(response, 404, "gpt-4", "model", "model_not_found")
        assert "'tiny'" in error["message"]
        for name in ("tiny", "tiny-alias"):
            response = httpx.post(tiny_server.url + route, json={**body, "model": name, "max_tokens": 2}, timeout=30)
            assert response.status_code == 200 and response.json()["model"] == name


def test_malformed_json_and_wrong_content(tiny_server):
    for content in (b'{"prompt": "hi"', b"not json", b"[1, 2]", b""):
        response = httpx.post(tiny_server.url + "/v1/completions", content=content, timeout=10,
                              headers={"content-type": "application/json"})
        assert_openai_error(response, 400)
    response = httpx.post(tiny_server.url + "/v1/completions", content=b'{"prompt": "hi",', timeout=10,
                          headers={"content-type": "application/json"})
    assert "JSON" in response.json()["error"]["message"]


def test_unknown_route_and_method(tiny_server):
    assert_openai_error(httpx.get(tiny_server.url + "/v1/nothing"), 404, "no route", code="not_found")
    assert_openai_error(httpx.get(tiny_server.url + "/v1/completions"), 405, code="method_not_allowed")


def test_client_errors_are_never_500(tiny_server):
    """A sweep of odd but well-formed bodies: whatever they mean, the answer is not a server error."""
    odd = [
        {"prompt": "hi", "stop": 5}, {"prompt": "hi", "n": True}, {"prompt": [[1, 2], "x"]},
        {"prompt": "hi", "stream_options": {"include_usage": "yes"}}, {"prompt": [[]]},
        {"prompt": "hi", "temperature": None, "top_p": None, "max_tokens": None, "stop": None},
        {"prompt": "hi", "stop_token_ids": [10 ** 9]}, {"prompt": "hi", "min_tokens": 100, "max_tokens": 2},
        {"prompt": "hi", "echo": True, "max_tokens": 0}, {"prompt": "hi", "priority": -5, "max_tokens": 2},
        {"prompt": "hi", "top_k": -7}, {"prompt": "hi", "min_p": 2}, {"prompt": "hi", "repetition_penalty": 0},
        {"prompt": "\u0000\uffff", "max_tokens": 2},
    ]
    for body in odd:
        response = httpx.post(tiny_server.url + "/v1/completions", json=body, timeout=30)
        assert response.status_code < 500, (body, response.text)
    chats = [
        {"messages": [{"role": "user", "content": None}]}, {"messages": [{"role": "user", "content": ["x", 5]}]},
        {"messages": CHAT, "chat_template_kwargs": {"messages": 1, "foo": 2}, "max_tokens": 2},
        {"messages": [{"role": "user", "content": {"a": 1}}]}, {"messages": "hi"},
    ]
    for body in chats:
        response = httpx.post(tiny_server.url + "/v1/chat/completions", json=body, timeout=30)
        assert response.status_code < 500, (body, response.text)
    # Lone surrogates are valid JSON escapes but not text: a 400 on every route.
    for route, body in (("/v1/completions", {"prompt": "a\udbff b"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\udbff b"}]}),
                        ("/generate", {"text": "a\udbff b"})):
        response = httpx.post(tiny_server.url + route, content=json.dumps(body).encode(), timeout=30,
                              headers={"content-type": "application/json"})
        assert response.status_code == 400 and "Unicode" in response.text, response.text
    # A template that meets values it cannot handle.
    response = httpx.post(tiny_server.url + "/v1/chat/completions", timeout=30, json={
        "messages": CHAT, "chat_template_kwargs": {"loop": 3, "raise_exception": 1}, "max_tokens": 2})
    assert response.status_code < 500, response.text


# -- states, in-process: loading, queue full, a model that does not load ---------------------

async def in_process(app, method, path, **kwargs):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kiln") as client:
        return await client.request(method, path, **kwargs)


def test_loading_answers_503(fake_model_dir):
    service = GenerateService(ServiceConfig(Artifacts.in_directory(fake_model_dir)),  # never started: LOADING
                              program_factory=FakeProgram)
    app = create_app(service, ServerSettings(served_model_names=("tiny",)))

    async def scenario():
        health = await in_process(app, "GET", "/health")
        assert health.status_code == 503 and health.json() == {"status": "loading"}
        for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": CHAT})):
            response = await in_process(app, "POST", path, json=body)
            error = assert_openai_error(response, 503, "loading", code="not_ready")
            assert error["type"] == "server_error" and response.headers["retry-after"]
        response = await in_process(app, "POST", "/generate", json={"text": "hi"})
        assert response.status_code == 503 and response.json()["code"] == "SERVICE_UNAVAILABLE"
        assert (await in_process(app, "GET", "/metrics")).status_code == 200
        assert (await in_process(app, "GET", "/v1/models")).json()["data"][0]["id"] == "tiny"

    asyncio.run(scenario())


def test_full_queue_answers_503(fake_model_dir):
    async def scenario():
        config = ServiceConfig(Artifacts.in_directory(fake_model_dir), max_queue=0)
        service = await GenerateService(config, program_factory=FakeProgram).start()
        app = create_app(service, ServerSettings(served_model_names=("tiny",)))
        try:
            response = await in_process(app, "POST", "/v1/completions", json={"prompt": "hi"})
            assert_openai_error(response, 503, "queue is full", code="queue_full")
            response = await in_process(app, "POST", "/generate", json={"text": "hi"})
            assert response.status_code == 503 and response.json()["code"] == "QUEUE_FULL"
            assert service.cache.stats().active == 0
        finally:
            await service.stop(0)

    asyncio.run(scenario())


def test_a_request_larger_than_the_queue_is_a_400_not_busy(fake_model_dir):
    """Sequences the queue could never hold at once (prompts times n) are the client's to cut,
    not a 503 to retry forever; what fits still runs."""
    async def scenario():
        config = ServiceConfig(Artifacts.in_directory(fake_model_dir), max_queue=4)
        service = await GenerateService(config, program_factory=FakeProgram).start()
        app = create_app(service, ServerSettings(served_model_names=("tiny",)))
        try:
            response = await in_process(app, "POST", "/v1/completions",
                                        json={"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 1})
            assert_openai_error(response, 400, "6 sequences", param="n")
            response = await in_process(app, "POST", "/generate",
                                        json={"text": "hi", "sampling_params": {"n": 5, "max_completion_tokens": 1}})
            assert response.status_code == 400 and "--max-queue" in response.json()["error"]
            response = await in_process(app, "POST", "/generate",
                                        json={"text": ["a", "b"], "sampling_params": {"n": 2, "max_completion_tokens": 1}})
            assert response.status_code == 200, response.text
            assert service.cache.stats().active == 0
        finally:
            await service.stop(0)

    asyncio.run(scenario())


def test_a_model_that_cannot_load_exits_1(start_server, tmp_path):
    server = start_server("--artifacts", tmp_path, ready=False)
    assert server.process.wait(60) == 1
    assert "could not load the model" in server.log()
