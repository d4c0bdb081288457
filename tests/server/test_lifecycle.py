"""Clients that leave, and a server that is told to stop: pages come back, SIGTERM drains and exits 0.

Also the README's main command, `kiln serve` with no model arguments, end to end.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.export.test_smollm2 import REFERENCE_CONTINUATION, REFERENCE_PROMPT

pytestmark = [pytest.mark.e2e, pytest.mark.smollm2]

LONG = {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True}


def test_disconnect_mid_stream_releases_pages(smol_server):
    aborted = smol_server.metric('kiln_sequences_finished_total{reason="abort"}', default=0)
    for route, body in (("/v1/completions", LONG),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell a story."}],
                                                  "max_tokens": 1000, "ignore_eos": True}),
                        ("/generate", {"text": "Once upon a time", "stream": True,
                                       "sampling_params": {"max_completion_tokens": 1000, "ignore_eos": True}})):
        with httpx.stream("POST", smol_server.url + route, json={**body, "stream": True}, timeout=60) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            for _ in range(3):
                assert next(line for line in lines if line.startswith("data: "))
            assert smol_server.metric("kiln_kv_pages_active") > 0
        # Closed after three tokens of a thousand: aborted at once, every page back.
        assert smol_server.wait_metric("kiln_kv_pages_active", 0, timeout=2) == 0
        assert smol_server.metric("kiln_sequences_running") == 0
    assert smol_server.metric('kiln_sequences_finished_total{reason="abort"}') == aborted + 3


def test_disconnect_while_waiting_for_a_whole_response(smol_server):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(smol_server.url + "/v1/completions", json=LONG, timeout=1.0)
    assert smol_server.wait_metric("kiln_kv_pages_active", 0, timeout=2) == 0
    assert smol_server.metric("kiln_sequences_running") == 0
    assert '" 499 ' in smol_server.log()


def read_stream(server, body, out: dict):
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            out["status"] = r.status_code
            out["events"] = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    except httpx.HTTPError as error:
        out["error"] = error


def test_sigterm_drains_and_exits_0(start_server, smollm2_artifacts):
    server = start_server("--artifacts", smollm2_artifacts, "--grace-period", "3")
    short, long = {}, {}
    threads = [threading.Thread(target=read_stream, args=(server, {"prompt": REFERENCE_PROMPT, "max_tokens": 40,
                                                                   "temperature": 0}, short)),
               threading.Thread(target=read_stream, args=(server, LONG, long))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while server.metric("kiln_sequences_running") < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(30) == 0
    took = time.monotonic() - started
    for thread in threads:
        thread.join(10)
    log = server.log()
    assert "draining" in log
    # The short request finished within the grace period, whole.
    assert short["status"] == 200 and short["events"][-1] == "[DONE]"
    chunks = [json.loads(e) for e in short["events"][:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks)[: len(REFERENCE_CONTINUATION)] == REFERENCE_CONTINUATION
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # The long one was cut at the end of the grace period, with an error the client can see.
    assert long["events"][-1] == "[DONE]"
    assert "shutting down" in json.loads(long["events"][-2])["error"]["message"]
    assert 3 <= took < 15
    # Nothing listens any more.
    with pytest.raises(httpx.TransportError):
        httpx.get(server.url + "/health", timeout=2)


def test_readme_main_command(smollm2_default_artifacts, tmp_path):
    """`kiln serve` with no model: the bundled SmolLM2 from the keyed cache (built by the fixture),
    served from the file's own Q4_1 blocks, with the float32 reference's greedy tokens."""
    from tests.server_process import ServerProcess

    assert json.loads((smollm2_default_artifacts / "model.kiln.json").read_text())["quantization"] == "q4_1"
    server = ServerProcess([], tmp_path / "server.log")
    try:
        server.wait_ready(timeout=600)
        [model] = httpx.get(server.url + "/v1/models").json()["data"]
        assert model["id"] == "SmolLM2-135M-Instruct"
        assert model["root"] == "SmolLM2-135M-Instruct"  # the name, never a path of the server's
        assert f"loaded {smollm2_default_artifacts}" in server.log()  # the same build, not a second one
        response = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": "SmolLM2-135M-Instruct", "prompt": REFERENCE_PROMPT, "max_tokens": 32, "temperature": 0})
        assert response.json()["choices"][0]["text"] == REFERENCE_CONTINUATION
        # The serving process never loaded torch (the build step ran in a child process).
        assert "libtorch" not in Path(f"/proc/{server.process.pid}/maps").read_text()
    finally:
        assert server.stop() == 0


def test_server_package_imports_no_torch():
    code = ("import sys, kiln.server.main, kiln.server.app, kiln.cli.serve_command; "
            "bad = [m for m in ('torch', 'iree.turbine') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sigterm_gives_websocket_generations_the_grace_period(start_server, tiny_artifacts):
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    server = start_server("--artifacts", tiny_artifacts, "--grace-period", "3", "--no-access-log")
    last: dict[str, dict] = {}
    tokens: dict[str, int] = {"short": 0, "long": 0}
    with connect(server.url.replace("http", "ws") + "/ws") as socket:
        for name, max_tokens in (("short", 24), ("long", 230)):
            socket.send(json.dumps({"type": "generate", "id": name, "input_ids": [5, 6, 7], "max_tokens": max_tokens,
                                    "temperature": 0, "ignore_eos": True}))
        signalled = False
        try:
            while len(last) < 2:
                message = json.loads(socket.recv(timeout=30))
                if message["type"] == "token":
                    tokens[message["id"]] += len(message["token_ids"])
                    if not signalled and tokens["short"] and tokens["long"]:
                        server.process.send_signal(signal.SIGTERM)
                        signalled = True
                else:
                    last[message["id"]] = message
        except ConnectionClosed:
            pass
    assert signalled and server.process.wait(30) == 0
    # Each generation ended with its own last message, not a bare close.
    assert last["short"]["type"] == "done" and last["short"]["choices"][0]["finish_reason"] == "length"
    assert tokens["short"] == 24
    assert last["long"]["type"] in ("done", "error")
    if last["long"]["type"] == "error":
        assert "shutting down" in last["long"]["error"]["message"]
