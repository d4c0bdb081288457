"""Two Kiln gRPC workers behind the Shepherd Model Gateway (`smg launch --policy cache_aware`),
unchanged: the gateway tokenizes, routes by the workers' KV events and serves the OpenAI API,
with the tokens one Kiln server gives over HTTP."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.server_process import free_port, wait_until_answers

pytestmark = pytest.mark.e2e
SYSTEM = "You are a helpful assistant who answers briefly. " * 4


@pytest.fixture(scope="module")
def gateway(start_server, tiny_artifacts, tmp_path_factory):
    workers = []
    for _ in range(2):
        port = free_port()
        workers.append((start_server("--artifacts", tiny_artifacts, "--served-model-name", "tiny",
                                     "--grpc-port", str(port), "--kv-events"), port))
    port = free_port()
    log = (tmp_path_factory.mktemp("smg") / "smg.log").open("w")
    process = subprocess.Popen(
        [str(Path(sys.executable).with_name("smg")), "launch", "--host", "127.0.0.1", "--port", str(port),
         "--prometheus-port", str(free_port()), "--policy", "cache_aware",
         "--tokenizer-path", str(tiny_artifacts), "--model-path", str(tiny_artifacts),
         "--worker-urls", *[f"grpc://127.0.0.1:{p}" for _, p in workers]],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_until_answers(url + "/v1/models", process, timeout=120)
    yield url, [w for w, _ in workers]
    process.terminate()
    process.wait(30)
    log.close()


def completion(url, prompt, **fields) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **fields}
    response = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_the_gateway_serves_kiln_workers_and_routes_by_their_caches(gateway):
    url, (first, second) = gateway
    assert [m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]] == ["tiny"]
    prompts = [SYSTEM + question for question in ("What is a cat?", "What is a dog?", "Name a color.",
                                                  "Name a fruit.", "What is rain?")]
    for prompt in prompts:
        # The gateway tokenizes without special tokens (no BOS): ask Kiln the same way.
        through, direct = completion(url, prompt), completion(first.url, prompt, add_special_tokens=False)
        assert through["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]
        assert through["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"] == 8
        # The gateway detokenizes itself and holds back an incomplete UTF-8 tail (the random
        # tiny model's tokens end mid-character); the text it sends is Kiln's up to that tail.
        text, want = through["choices"][0]["text"], direct["choices"][0]["text"]
        assert want.startswith(text.rstrip("\ufffd")) and len(text) >= len(want) - 2
    # The shared system prompt: after the first request the gateway sends the others where its
    # pages are, so their prompts are served from that worker's prefix cache.
    hits = sum(w.metric("vllm:prefix_cache_hits_total") for w in (first, second))
    assert hits >= 4 * 16
    streamed = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "stream": True})
    assert streamed.status_code == 200 and "data: [DONE]" in streamed.text
