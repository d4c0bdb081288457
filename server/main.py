"""Run the app with uvicorn: listen at once, load in the background, drain on SIGTERM/SIGINT, exit 0.

uvicorn already stops accepting connections on a signal and waits for open ones; on top
of that the service starts draining at the signal itself (new requests get 503, running
ones get the grace period, then are aborted), and the signal is not re-raised at the
end, so a drained server exits 0. A second SIGINT forces the exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading

import uvicorn

from kiln.runtime.service import GenerateService
from kiln.runtime.service_config import ServiceConfig

from .app import begin_drain, create_app
from .settings import ServerSettings

log = logging.getLogger("kiln.server")


class KilnServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_signal):
        super().__init__(config)
        self.on_signal = on_signal
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
        if not self.should_exit:
            log.info("received %s: draining", signal.Signals(sig).name)
            if self.loop is not None:
                self.loop.call_soon_threadsafe(self.on_signal)
        super().handle_exit(sig, frame)


def configure_logging(level: str = "info") -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def serve(service_config: ServiceConfig, settings: ServerSettings, log_level: str = "info", prepare=None) -> int:
    """Serve until a signal (or a failed load); returns the process exit code."""
    configure_logging(log_level)
    service = GenerateService(service_config, prepare=prepare)
    server: KilnServer | None = None

    def fatal() -> None:
        if server is not None:
            server.should_exit = True

    app = create_app(service, settings, on_fatal=fatal)
    config = uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=log_level, access_log=False,
        log_config=None,  # our logging.basicConfig, one format for uvicorn's lines and ours
        timeout_graceful_shutdown=settings.grace_seconds + 5, ws="auto", lifespan="on",
    )
    server = KilnServer(config, on_signal=lambda: begin_drain(app))
    server.run()
    if not server.started:
        return 1  # the port was taken, or startup failed: uvicorn has said why
    return app.state.exit_code
