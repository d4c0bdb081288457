"""The HTTP layer in-process over a fake program: routes, shared checks and error types,
without compiling a model (the real-server tests are beside this one)."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from kiln.runtime import GenerateService, ServiceConfig
from kiln.runtime.contract import Artifacts
from kiln.server.app import create_app
from kiln.server.settings import ServerSettings
from tests.fake_program import FakeProgram, expected_greedy


@pytest.fixture(scope="module")
def client(fake_model_dir):
    service = GenerateService(ServiceConfig(Artifacts.in_directory(fake_model_dir)), program_factory=FakeProgram)
    app = create_app(service, ServerSettings(served_model_names=("fake",), log_requests=False))
    with TestClient(app) as client:
        for _ in range(200):
            if client.get("/health").status_code == 200:
                break
        yield client


def test_completions_tokens_follow_the_model(client):
    ids = [5, 9, 13, 40]
    body = client.post("/v1/completions", json={"model": "fake", "prompt": ids, "max_tokens": 6, "temperature": 0,
                                                "ignore_eos": True}).json()
    service = client.app.state.service
    assert body["choices"][0]["text"] == service.decode(expected_greedy(ids, 6))
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_generate_route_returns_token_ids(client):
    ids = [7, 8, 9]
    answer = client.post("/generate", json={"input_ids": ids, "return_input_ids": True,
                                            "sampling_params": {"max_completion_tokens": 5, "ignore_eos": True}})
    assert answer.status_code == 200 and answer.json() == expected_greedy(ids, 5)


def test_chat_defaults_max_tokens_to_the_rest_of_the_context(client):
    body = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "ignore_eos": True}).json()
    service = client.app.state.service
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
