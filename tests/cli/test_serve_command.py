"""`kiln serve` on the tiny model: Ctrl+C exits as cleanly as SIGTERM, and --model builds on first use."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

pytestmark = pytest.mark.e2e


def test_sigint_exits_0(start_server, tiny_artifacts):
    server = start_server("--artifacts", tiny_artifacts, "--no-access-log")
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert server.stop(signal.SIGINT) == 0
    assert "draining" in server.log() and "Traceback" not in server.log()
    assert "leaked" not in server.log()  # nanobind's list of the IREE objects alive as Python exits


def test_serve_builds_a_model_on_first_use(start_server, tiny_hf_dir, tmp_path):
    """`kiln serve --model DIR`: built (in a child process) into the keyed cache, then served; the
    second start reuses the build."""
    env = {"KILN_CACHE_DIR": str(tmp_path / "cache")}
    server = start_server("--model", tiny_hf_dir, "--no-access-log", env=env, ready=False)
    # The server listens while it builds: /health and generation answer 503 "loading" meanwhile.
    first = None
    while first is None:
        assert server.process.poll() is None, server.log()
        try:
            first = httpx.get(server.url + "/health", timeout=2)
        except httpx.TransportError:
            time.sleep(0.05)
    assert first.status_code == 503 and first.json()["status"] == "loading"
    refused = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert refused.status_code == 503 and "loading" in refused.json()["error"]["message"]
    server.wait_ready()
    [model] = httpx.get(server.url + "/v1/models").json()["data"]
    # Served under the model's own name (its directory's), the path it was given by taken too.
    assert model["id"] == tiny_hf_dir.name and f"loaded {tmp_path / 'cache'}" in server.log()
    for name in (None, tiny_hf_dir.name, str(tiny_hf_dir)):
        body = {"prompt": "hi", "max_tokens": 3, **({"model": name} if name else {})}
        assert httpx.post(server.url + "/v1/completions", json=body).status_code == 200
    assert server.stop() == 0
    again = start_server("--model", tiny_hf_dir, "--no-access-log", env=env)
    assert "reusing" in again.log() and f"loaded {tmp_path / 'cache'}" in again.log()
    assert again.stop() == 0
