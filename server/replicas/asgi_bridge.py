"""One HTTP request through an ASGI app in this process, its response as a stream of plain data.

An engine replica runs the whole Kiln app, so a request forwarded by the front meets the
same middleware, routes and errors as on a single server. The request crosses processes as
a `ForwardedRequest`; the response comes back as a `ResponseStart` and then body chunks.
When the caller stops reading (the client left, Ray cancelled the call), the app is told
the client disconnected, which aborts the generation and returns its pages.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.types import ASGIApp, Message


@dataclass(frozen=True)
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    client: tuple[str, int] | None = None


@dataclass(frozen=True)
class ResponseStart:
    status: int
    headers: tuple[tuple[bytes, bytes], ...]


def http_scope(request: ForwardedRequest) -> dict:
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": request.method, "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
        "root_path": "", "query_string": request.query_string, "headers": list(request.headers),
        "client": request.client, "server": ("127.0.0.1", 0),
    }


async def call_app(app: ASGIApp, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
    """The app's response to `request`: its start, then each non-empty body chunk as sent."""
    sent: asyncio.Queue[Message] = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await sent.put(message)

    running = asyncio.ensure_future(app(http_scope(request), receive, send))
    try:
        async for message in _sent_while_running(sent, running):
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], tuple((bytes(k), bytes(v)) for k, v in message["headers"]))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
    finally:
        gone.set()  # the app sees the client leave, if it is still listening
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
            await asyncio.wait_for(asyncio.shield(running), timeout=30)


async def _sent_while_running(sent: asyncio.Queue[Message], running: asyncio.Future) -> AsyncIterator[Message]:
    """The app's messages as it sends them, until it returns (raising what it raised)."""
    taking = None
    try:
        while True:
            taking = asyncio.ensure_future(sent.get())
            await asyncio.wait({taking, running}, return_when=asyncio.FIRST_COMPLETED)
            if not taking.done():  # the app returned without another message
                running.result()
                return
            yield taking.result()
    finally:
        if taking is not None and not taking.done():
            taking.cancel()


def websocket_scope(request: ForwardedRequest) -> dict:
    scope = http_scope(request)
    scope.update(type="websocket", scheme="ws", subprotocols=[])
    scope.pop("method")
    return scope


async def call_websocket(app: ASGIApp, request: ForwardedRequest,
                         incoming: asyncio.Queue[Message]) -> AsyncIterator[Message]:
    """A WebSocket session with the app: the client's messages (ASGI `websocket.receive` and
    `websocket.disconnect`) come from `incoming`, the app's (`websocket.accept`, `.send`,
    `.close`) are yielded. Closing this generator tells the app the client is gone."""
    sent: asyncio.Queue[Message] = asyncio.Queue()
    connected = False

    async def receive() -> Message:
        nonlocal connected
        if not connected:
            connected = True
            return {"type": "websocket.connect"}
        return await incoming.get()

    async def send(message: Message) -> None:
        await sent.put(message)

    running = asyncio.ensure_future(app(websocket_scope(request), receive, send))
    try:
        async for message in _sent_while_running(sent, running):
            yield dict(message)
            if message["type"] == "websocket.close":
                return
    finally:
        incoming.put_nowait({"type": "websocket.disconnect", "code": 1001})
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
            await asyncio.wait_for(asyncio.shield(running), timeout=30)
