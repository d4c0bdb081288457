"""/ws: generations streamed over one socket, several at once, cancelled by message or by closing."""

from __future__ import annotations

import json

import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tests.export.test_smollm2 import REFERENCE_CONTINUATION, REFERENCE_PROMPT

pytestmark = [pytest.mark.e2e, pytest.mark.smollm2]


def ws_url(server, query: str = "") -> str:
    return server.url.replace("http://", "ws://") + "/ws" + query


def receive(socket) -> dict:
    return json.loads(socket.recv(timeout=60))


def until_done(socket, generation_id: str) -> tuple[list[dict], dict]:
    tokens = []
    while True:
        message = receive(socket)
        assert message["id"] == generation_id, message
        if message["type"] == "done":
            return tokens, message
        assert message["type"] == "token", message
        tokens.append(message)


def test_generate_over_a_socket(smol_server):
    with connect(ws_url(smol_server), proxy=None) as socket:
        socket.send(json.dumps({"type": "generate", "id": "a", "prompt": REFERENCE_PROMPT, "max_tokens": 32,
                                "temperature": 0, "logprobs": 1}))
        tokens, done = until_done(socket, "a")
        assert "".join(t["text"] for t in tokens) == REFERENCE_CONTINUATION
        assert len(tokens) == 32 and all(len(t["logprobs"]) == 1 for t in tokens)
        assert done["choices"] == [{"index": 0, "text": REFERENCE_CONTINUATION, "finish_reason": "length"}]
        assert done["usage"]["completion_tokens"] == 32
        # Chat messages, on the same socket.
        socket.send(json.dumps({"type": "generate", "id": "b", "messages": [{"role": "user", "content": "What is 2+2?"}],
                                "temperature": 0, "max_tokens": 64}))
        _, done = until_done(socket, "b")
        assert "4" in done["choices"][0]["text"] and done["choices"][0]["finish_reason"] == "stop"


def test_two_at_once_and_cancel(smol_server):
    with connect(ws_url(smol_server), proxy=None) as socket:
        socket.send(json.dumps({"type": "generate", "id": "long", "prompt": "Once upon a time", "max_tokens": 400,
                                "ignore_eos": True}))
        socket.send(json.dumps({"type": "generate", "id": "short", "prompt": REFERENCE_PROMPT, "max_tokens": 8,
                                "temperature": 0}))
        seen, short_text = {"long": 0, "short": 0}, ""
        while True:
            message = receive(socket)
            assert message["type"] in ("token", "done"), message
            if message["type"] == "token":
                seen[message["id"]] += 1
                short_text += message["text"] if message["id"] == "short" else ""
            elif message["id"] == "short":
                break
        assert short_text == REFERENCE_CONTINUATION[: len(short_text)] and seen["short"] == 8
        assert seen["long"] > 0  # both ran at once
        socket.send(json.dumps({"type": "cancel", "id": "long"}))
        while (message := receive(socket))["type"] == "token":
            assert message["id"] == "long"
        assert message == {"type": "done", "id": "long", "cancelled": True, "choices": []}
        assert smol_server.wait_metric("kiln_kv_pages_active", 0) == 0
        # Cancelling what is not running is an error, and the socket goes on.
        socket.send(json.dumps({"type": "cancel", "id": "long"}))
        assert receive(socket)["type"] == "error"
        socket.send(json.dumps({"type": "generate", "id": "again", "prompt": "hi", "max_tokens": 2, "ignore_eos": True}))
        assert until_done(socket, "again")[1]["choices"][0]["finish_reason"] == "length"


def test_closing_the_socket_aborts(smol_server):
    with connect(ws_url(smol_server), proxy=None) as socket:
        socket.send(json.dumps({"type": "generate", "id": "x", "prompt": "Once upon a time", "max_tokens": 400,
                                "ignore_eos": True}))
        assert receive(socket)["type"] == "token"
        assert smol_server.metric("kiln_kv_pages_active") > 0
    assert smol_server.wait_metric("kiln_kv_pages_active", 0) == 0
    assert smol_server.metric("kiln_sequences_running") == 0


def test_bad_messages(smol_server):
    with connect(ws_url(smol_server), proxy=None) as socket:
        for raw, fragment in (
            ("not json", "JSON"),
            ('{"type": "dance"}', "type"),
            ('{"type": "generate", "id": "q"}', "exactly one of"),
            ('{"type": "generate", "id": "q", "prompt": "hi", "temperature": -1}', "temperature"),
            ('{"type": "generate", "id": "q", "prompt": "hi", "model": "nope"}', "nope"),
            ('{"type": "generate", "id": "q", "prompt": "hi", "max_tokens": "x"}', "max_tokens"),
            ('{"type": "generate", "id": "q", "input_ids": [1, 99999999]}', "vocabulary"),
        ):
            socket.send(raw)
            message = receive(socket)
            assert message["type"] == "error" and fragment in message["error"]["message"], (raw, message)


def test_socket_needs_the_api_key(start_server, tiny_artifacts):
    server = start_server("--artifacts", tiny_artifacts, "--api-key", "sesame", "--no-access-log")
    with pytest.raises(InvalidStatus):
        connect(ws_url(server), proxy=None)
    for options in ({"additional_headers": {"Authorization": "Bearer sesame"}}, {}):
        url = ws_url(server, "" if options else "?api_key=sesame")
        with connect(url, proxy=None, **options) as socket:
            # ignore_eos: a sampled token of the random tiny model may be EOS, which is not what this tests.
            socket.send(json.dumps({"type": "generate", "id": "k", "prompt": "hi", "max_tokens": 3, "ignore_eos": True}))
            assert until_done(socket, "k")[1]["choices"][0]["finish_reason"] == "length"
    server.stop()
