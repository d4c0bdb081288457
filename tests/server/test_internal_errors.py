"""The fake-program server on 127.0.0.1 (`fake_server` in tests/server/conftest.py): a failure
of Kiln's own is a well-formed 500 and the connection stays usable
(behind a pooling proxy, the next request on it is another user's); WebSocket messages
obey the body limit; half-open connections are closed and their number is capped."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect


def exchange(connection: socket.socket, path: str) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 request on an open connection, its whole response read back."""
    connection.sendall(f"GET {path} HTTP/1.1\r\nHost: kiln\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = connection.recv(65536)
        assert chunk, "the server closed the connection"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        chunk = connection.recv(65536)
        assert chunk, "the server closed the connection mid-body"
        body += chunk
    return int(lines[0].split()[1]), headers, body


def test_a_500_keeps_the_connection_open(fake_server):
    with socket.create_connection(("127.0.0.1", fake_server), timeout=10) as connection:
        for _ in range(3):
            status, headers, body = exchange(connection, "/fail")
            assert status == 500 and headers.get("connection") != "close"
            assert b'"type":"server_error"' in body.replace(b" ", b"") and b"RuntimeError" in body
            assert headers["x-request-id"]
            status, _, _ = exchange(connection, "/v1/models")  # the same connection, still usable
            assert status == 200


def test_a_websocket_message_over_the_body_limit_closes_the_socket_at_once(fake_server):
    started = time.monotonic()
    with connect(f"ws://127.0.0.1:{fake_server}/ws") as socket:
        socket.send('{"type": "generate", "prompt": "' + "x" * 200_000 + '"}')
        with pytest.raises(ConnectionClosed) as closed:
            socket.recv(timeout=10)
    assert closed.value.rcvd.code == 1009  # message too big
    assert time.monotonic() - started < 5
    assert httpx.get(f"http://127.0.0.1:{fake_server}/v1/models", timeout=5).status_code == 200


def test_half_open_connections_are_closed_and_capped(fake_server):
    stalled = []
    for _ in range(24):  # the cap: a request on one more connection is refused
        connection = socket.create_connection(("127.0.0.1", fake_server), timeout=10)
        connection.sendall(b"GET /v1/models HTTP/1.1\r\nHost: kiln\r\nX-Slow: ")  # never finished
        stalled.append(connection)
    time.sleep(0.2)
    assert httpx.get(f"http://127.0.0.1:{fake_server}/v1/models", timeout=5).status_code == 503
    started = time.monotonic()
    for connection in stalled:  # each is closed once its head is late
        assert connection.recv(1024) == b""
        connection.close()
    assert time.monotonic() - started < 5
    assert httpx.get(f"http://127.0.0.1:{fake_server}/v1/models", timeout=5).status_code == 200


def test_a_kept_alive_connection_gets_a_deadline_for_each_request_head(fake_server):
    with socket.create_connection(("127.0.0.1", fake_server), timeout=10) as connection:
        assert exchange(connection, "/v1/models")[0] == 200
        connection.sendall(b"GET /v1/models HTTP/1.1\r\n")  # the next head, never finished
        started = time.monotonic()
        assert connection.recv(1024) == b""
        assert time.monotonic() - started < 5
