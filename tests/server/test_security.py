"""API keys, the per-key rate limit, the body size limit, CORS, request ids and security headers."""

from __future__ import annotations

import time

import httpx
import pytest

pytestmark = pytest.mark.e2e

KEYS = ("key-one", "key-two")
RATE = 2  # requests per second per key, bursts of 2


@pytest.fixture(scope="module")
def strict_server(start_server, tiny_artifacts):
    return start_server("--artifacts", tiny_artifacts, "--api-key", KEYS[0], "--rate-limit", RATE,
                        "--max-body-bytes", 2048, "--cors-origin", "https://app.example", "--no-access-log",
                        env={"KILN_API_KEY": "key-from-env"})


def completion(server, key=None, **kwargs):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=headers,
                      timeout=30, **kwargs)


def wait_for_tokens():
    time.sleep(1.1 * 2 / RATE)  # both burst tokens back


def test_api_keys(strict_server):
    wait_for_tokens()
    for key in (None, "wrong"):
        response = completion(strict_server, key)
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert response.json()["error"]["type"] == "authentication_error"
    response = httpx.post(strict_server.url + "/generate", json={"text": "hi"})
    assert response.status_code == 401 and response.json()["code"] == "UNAUTHORIZED"
    assert httpx.get(strict_server.url + "/v1/models").status_code == 401
    assert completion(strict_server, KEYS[0]).status_code == 200
    assert completion(strict_server, "key-from-env").status_code == 200
    # Health and metrics stay open, for probes and scrapers.
    assert httpx.get(strict_server.url + "/health").status_code == 200
    assert httpx.get(strict_server.url + "/metrics").status_code == 200


def test_rate_limit_per_key(strict_server):
    wait_for_tokens()
    statuses = [completion(strict_server, KEYS[0]).status_code for _ in range(RATE + 1)]
    assert statuses == [200] * RATE + [429]
    limited = completion(strict_server, KEYS[0])
    assert limited.status_code == 429
    assert int(limited.headers["retry-after"]) >= 1
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert completion(strict_server, "key-from-env").status_code == 200  # another key has its own bucket
    time.sleep(1.1 / RATE)
    assert completion(strict_server, KEYS[0]).status_code == 200  # tokens come back at RATE per second


def test_body_limit(strict_server):
    wait_for_tokens()
    headers = {"Authorization": f"Bearer {KEYS[0]}", "content-type": "application/json"}
    big = b'{"prompt": "' + b"x" * 4096 + b'"}'
    response = httpx.post(strict_server.url + "/v1/completions", content=big, headers=headers)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit applies while the body streams in
        yield big[:1000]
        yield big[1000:]

    response = httpx.post(strict_server.url + "/v1/completions", content=chunks(), headers=headers)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    headers["Authorization"] = "Bearer key-from-env"  # a third request: another key's rate budget
    response = httpx.post(strict_server.url + "/generate", content=chunks(), headers=headers)
    assert response.status_code == 413 and response.json()["code"] == "REQUEST_TOO_LARGE"


def test_cors(strict_server):
    preflight = httpx.options(strict_server.url + "/v1/completions", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://app.example"
    other = httpx.options(strict_server.url + "/v1/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in other.headers
    response = httpx.get(strict_server.url + "/health", headers={"Origin": "https://app.example"})
    assert response.headers["access-control-allow-origin"] == "https://app.example"


def test_request_id_and_security_headers(tiny_server):
    response = httpx.get(tiny_server.url + "/health", headers={"X-Request-Id": "trace-123"})
    assert response.headers["x-request-id"] == "trace-123"
    fresh = httpx.get(tiny_server.url + "/health").headers["x-request-id"]
    assert len(fresh) == 32
    unsafe = httpx.get(tiny_server.url + "/health", headers={"X-Request-Id": "a b\tc" * 50}).headers["x-request-id"]
    assert unsafe != "a b\tc" * 50
    error = httpx.post(tiny_server.url + "/v1/completions", json={"prompt": 1})
    for response in (error, httpx.get(tiny_server.url + "/metrics")):
        assert response.headers["x-request-id"]
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.headers["x-frame-options"] == "DENY"
        assert "default-src 'none'" in response.headers["content-security-policy"]
    assert "/v1/completions" in tiny_server.log() and "id=" in tiny_server.log()  # the access log
