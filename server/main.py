"""Run the app with uvicorn: listen at once, load in the background, drain on SIGTERM/SIGINT, exit 0.

On the first signal the service drains while every connection stays open (new requests
get 503; running ones get the grace period, then are aborted with an error the client
sees), so SSE streams and WebSocket generations alike end with their last message; only
then does uvicorn shut down (it would close WebSockets at once with 1012). The signal is
not re-raised at the end, so a drained server exits 0. A second signal ends the process at
once, and so does a drain that overruns the grace period by DRAIN_MARGIN_SECONDS, whatever
the event loop is doing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading

import uvicorn

from kiln.runtime.service import GenerateService
from kiln.runtime.service_config import ServiceConfig

from .app import create_app, drain
from .http.connections import head_deadline_protocol
from .settings import ServerSettings

log = logging.getLogger("kiln.server")


# The exit status when a second signal, or a drain past its deadline, ends the process at once.
FORCED_EXIT_CODE = 1
# What a drain may take beyond the grace period before the process is ended regardless: aborting
# what is left (5 s at most), the WebSockets' last messages (5 s), the gRPC server's stop (5 s),
# and the HTTP server's own shutdown.
DRAIN_MARGIN_SECONDS = 20.0


def _exit_now(code: int) -> None:
    """End the process without waiting on anything (no lock, no flush: the thread that is stuck
    may hold them); the log line before it has gone out already, stderr being line-buffered."""
    os._exit(code)


class KilnServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain, grace_seconds: float = 30.0):
        super().__init__(config)
        self.drain = drain  # a coroutine function: the service drained, the last messages sent
        self.drain_deadline = grace_seconds + DRAIN_MARGIN_SECONDS
        self.draining = False
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's, minus raising the signal again once shut down (which would make the exit code 143)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig, frame) -> None:
        if self.draining:  # a second signal: stop now, whatever the event loop is doing
            log.warning("received %s again: exiting now", signal.Signals(sig).name)
            _exit_now(FORCED_EXIT_CODE)
        if self.loop is None:  # none of ours to drain yet
            self.should_exit = self.force_exit = True
            return
        self.draining = True
        log.info("received %s: draining", signal.Signals(sig).name)
        self.loop.call_soon_threadsafe(self._drain_then_exit)
        # The drain runs on the event loop; should the loop be stuck, the process still ends.
        watchdog = threading.Timer(self.drain_deadline, self._drain_overran)
        watchdog.daemon = True
        watchdog.start()

    def _drain_overran(self) -> None:
        log.error("the drain did not end within %.0fs: exiting now", self.drain_deadline)
        _exit_now(FORCED_EXIT_CODE)

    def _drain_then_exit(self) -> None:
        task = asyncio.ensure_future(self.drain())
        task.add_done_callback(lambda _: setattr(self, "should_exit", True))


def configure_logging(level: str = "info") -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def uvicorn_config(app, settings: ServerSettings, log_level: str = "info") -> uvicorn.Config:
    return uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=log_level, access_log=False,
        log_config=None,  # our logging.basicConfig, one format for uvicorn's lines and ours
        timeout_graceful_shutdown=settings.grace_seconds + 5, ws="auto", lifespan="on",
        # A WebSocket message is a request body too: the same limit (the socket closes with 1009).
        ws_max_size=settings.max_body_bytes,
        http=head_deadline_protocol(settings.header_timeout),
        timeout_keep_alive=settings.keep_alive_timeout,
        limit_concurrency=settings.max_connections,
    )


def serve(service_config: ServiceConfig, settings: ServerSettings, log_level: str = "info", prepare=None) -> int:
    """Serve until a signal (or a failed load); returns the process exit code."""
    configure_logging(log_level)
    service = GenerateService(service_config, prepare=prepare)
    server: KilnServer | None = None

    def fatal() -> None:
        if server is not None:
            server.should_exit = True

    app = create_app(service, settings, on_fatal=fatal)
    server = KilnServer(uvicorn_config(app, settings, log_level), drain=lambda: drain(app),
                        grace_seconds=settings.grace_seconds)
    server.run()
    if not server.started:
        return 1  # the port was taken, or startup failed: uvicorn has said why
    return app.state.exit_code
