"""`kiln serve` on tensor- and pipeline-parallel exports of the tiny model (two local-task
devices each): the same HTTP answers as the one-device export's, streamed or not."""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "Once upon a time, in a small village by the sea,"}]


def answers(server) -> tuple[str, str, str]:
    """A greedy completion, a greedy chat reply, and the chat reply streamed."""
    completion = httpx.post(server.url + "/v1/completions", timeout=60,
                            json={"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0})
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                      json={"model": "tiny", "messages": MESSAGES, "max_tokens": 16, "temperature": 0})
    assert completion.status_code == 200 and chat.status_code == 200, (completion.text, chat.text)
    streamed = ""
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60,
                      json={"model": "tiny", "messages": MESSAGES, "max_tokens": 16, "temperature": 0,
                            "stream": True}) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                streamed += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
    return completion.json()["choices"][0]["text"], chat.json()["choices"][0]["message"]["content"], streamed


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_a_parallel_export_serves_the_one_device_answers(request, start_server, tiny_server, layout):
    artifacts = request.getfixturevalue(f"tiny_{layout}_artifacts")
    server = start_server("--artifacts", artifacts, "--served-model-name", "tiny")
    got = answers(server)
    assert got == answers(tiny_server)
    assert got[1] == got[2] and got[0]
    assert server.metric('kiln_model_steps_total{kind="decode"}') > 0
    assert server.stop() == 0
