"""What one connection may cost the server: a deadline for each request's head.

uvicorn times out idle keep-alive connections, but not a client that opens a connection
and sends its headers slowly, or never finishes them: each such connection stays open for
good. This protocol (uvicorn's own h11 one, plus a timer) closes a connection whose request
head is not complete within the deadline, whether it is the connection's first request or
a later one on the same connection. The number of connections is capped by uvicorn's
`limit_concurrency` (503 beyond it).
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class _HeadDeadlineProtocol(H11Protocol):
    head_timeout: float = 10.0  # set by head_deadline_protocol

    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # the head is in: the request is the app's now
            self._cancel_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_timer()  # the next request on this connection gets its own deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def head_deadline_protocol(seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol closing connections whose request head takes over `seconds`."""
    return type("HeadDeadlineProtocol", (_HeadDeadlineProtocol,), {"head_timeout": seconds})
