"""Server-sent events, and noticing a client that left (streaming or not) so its request is aborted.

`EventStream` always listens for the disconnect while it streams (whatever ASGI version the
server speaks) and closes its generator, whose `finally` aborts the generation: pages come
back as soon as the client is gone, not at the next token. `unless_disconnected` does the
same for a response that is computed first and sent at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from ..errors import failure_of

DONE = b"data: [DONE]\n\n"
T = TypeVar("T")


def sse(payload: Any, event: str | None = None) -> bytes:
    """One event: `data: <json>` and a blank line (JSON never spans lines), after `event: <name>`
    where the API names its events (the Responses API does)."""
    data = b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
    return data if event is None else b"event: " + event.encode() + b"\n" + data


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None] | None = None):
        """`on_close` runs however the response ends, even if `content` never started (its
        `finally` would not run then): the place to abort what the stream was reading."""
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streamer = asyncio.ensure_future(self.stream_response(send))
        listener = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({streamer, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streamer, listener):
                task.cancel()
            await asyncio.gather(streamer, listener, return_exceptions=True)
            # If it was cancelled while suspended at a yield, the generator is still open.
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            if self.on_close is not None:
                self.on_close()
        error = None if streamer.cancelled() else streamer.exception()
        if error is not None and not isinstance(error, OSError):  # OSError: the client went away mid-write
            raise error


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and raising ClientDisconnected) if the client leaves first."""
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await listener
    if task.cancelled() or not task.done():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientDisconnected()
    return task.result()


async def one_reply(request: Request, generation, view, stream: bool) -> Response:
    """The answer of a route that runs one sequence (the Responses API, Anthropic's Messages): the
    view's events as they come, or its whole body once the sequence is done (its failure raised)."""
    if stream:
        return EventStream(view.stream(generation), on_close=generation.abort)
    [result] = await unless_disconnected(request, generation.collect())
    [choice] = result.choices
    if (error := failure_of(choice)) is not None:
        raise error
    return JSONResponse(view.whole(choice, generation.usage()))
