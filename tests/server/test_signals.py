"""SIGTERM ends the server within the grace period and a margin whatever the event loop is doing,
and a second signal ends it at once: here the loop is held by a route that never yields."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import pytest

from kiln.server.main import DRAIN_MARGIN_SECONDS, FORCED_EXIT_CODE
from tests.server_process import free_port, wait_until_answers


@pytest.fixture
def stuck_server(fake_model_dir):
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "tests.fake_server", str(fake_model_dir), str(port), "--hold-route"])
    url = f"http://127.0.0.1:{port}"
    wait_until_answers(url + "/health", process, timeout=60)
    try:
        httpx.get(url + "/hold", timeout=0.5)
    except httpx.TimeoutException:
        pass  # the loop is now held
    yield process
    if process.poll() is None:
        process.kill()
        process.wait()


def test_sigterm_ends_a_server_whose_event_loop_is_stuck(stuck_server):
    started = time.monotonic()
    stuck_server.send_signal(signal.SIGTERM)
    code = stuck_server.wait(timeout=1.0 + DRAIN_MARGIN_SECONDS + 20)
    assert code == FORCED_EXIT_CODE
    assert time.monotonic() - started < 1.0 + DRAIN_MARGIN_SECONDS + 10


def test_a_second_signal_ends_it_at_once(stuck_server):
    stuck_server.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    started = time.monotonic()
    stuck_server.send_signal(signal.SIGINT)
    assert stuck_server.wait(timeout=10) == FORCED_EXIT_CODE
    assert time.monotonic() - started < 5
