"""SIGINT (Ctrl+C) stops an idle server as cleanly as SIGTERM: exit 0, nothing left listening."""

from __future__ import annotations

import signal

import httpx
import pytest

pytestmark = pytest.mark.e2e


def test_sigint_exits_0(start_server, tiny_artifacts):
    server = start_server("--artifacts", tiny_artifacts, "--no-access-log")
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert server.stop(signal.SIGINT) == 0
    assert "draining" in server.log() and "Traceback" not in server.log()
