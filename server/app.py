"""The FastAPI app over one GenerateService: routes, middleware, and the service's lifecycle.

The model loads in the background once the app starts, so the server answers from the
first moment: /health and generation routes say 503 until the service is READY. Draining
(on SIGTERM, see main.py) stops new requests and gives running ones a grace period.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from starlette.middleware.cors import CORSMiddleware

from kiln.runtime.service import GenerateService, ServiceState

from .http import (admin_routes, anthropic_routes, embedding_routes, generate_routes, infill_routes, lora_routes,
                   openai_routes, responses_routes, tokenizer_routes, websocket_routes)
from .errors import install_error_handlers
from .logprobs import TokenText
from .metrics import CONTENT_TYPE, Metrics
from .http.middleware import BodyLimit, Guard, JsonBodies, RequestContext
from .settings import ServerSettings
from .http.streaming import ClientDisconnected

log = logging.getLogger("kiln.server")


def create_app(service: GenerateService, settings: ServerSettings,
               on_fatal: Callable[[], None] | None = None) -> FastAPI:
    """`on_fatal` is called when the model cannot be loaded (the runner then exits non-zero)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        grpc_front = None
        if settings.grpc_port is not None:
            from .grpc.server import GrpcFront  # the grpc extra, imported only when asked for

            grpc_front = app.state.grpc = GrpcFront(service, settings, app.state.metrics)
            await grpc_front.start()
            await grpc_front.set_serving(False)
        loader = asyncio.create_task(load(app))
        try:
            yield
        finally:
            await begin_drain(app)
            if not loader.done():
                loader.cancel()
            if grpc_front is not None:
                await grpc_front.stop(grace=5.0)

    async def load(app: FastAPI) -> None:
        try:
            await service.start()
        except Exception as error:
            log.error("could not load the model: %s", error)
            app.state.load_error = str(error)
            app.state.exit_code = 1
            if on_fatal is not None:
                on_fatal()
            return
        app.state.token_text = TokenText(lambda ids: service.decode(ids, skip_special_tokens=False))
        if service.kv_events is not None and settings.kv_events_endpoint:
            from .kv_events_publisher import ZmqKvEventPublisher  # the events extra, imported only when asked for

            app.state.kv_publisher = ZmqKvEventPublisher(settings.kv_events_endpoint, settings.kv_events_topic)
            service.kv_events.add_listener(app.state.kv_publisher)
            log.info("KV events published on %s", settings.kv_events_endpoint)
        if getattr(app.state, "grpc", None) is not None:
            await app.state.grpc.set_serving(True)
        log.info("ready: serving %s on http://%s:%d", settings.model_name, settings.host, settings.port)

    app = FastAPI(title="Kiln", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.service = service
    app.state.settings = settings
    app.state.metrics = metrics = Metrics(service, settings.model_name)
    app.state.started_at = int(time.time())
    app.state.load_error = None
    app.state.exit_code = 0
    app.state.drain_task = None
    app.state.sockets = set()  # open WebSocket sessions (websocket_routes.Session)

    install_error_handlers(app)

    @app.exception_handler(ClientDisconnected)
    async def client_gone(request: Request, error: ClientDisconnected):
        return Response(status_code=499)  # nobody reads it; the access log shows who left

    @app.get("/health")
    async def health():
        state = service.state
        body = {"status": "failed" if app.state.load_error else state.value}
        if app.state.load_error:
            body["error"] = app.state.load_error
        return JSONResponse(body, status_code=200 if state is ServiceState.READY else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    app.include_router(openai_routes.router)
    app.include_router(responses_routes.router)
    app.include_router(anthropic_routes.router)
    app.include_router(infill_routes.router)
    app.include_router(embedding_routes.router)
    app.include_router(lora_routes.router)
    app.include_router(generate_routes.router)
    app.include_router(websocket_routes.router)
    app.include_router(tokenizer_routes.router)
    app.include_router(admin_routes.router)

    # Added innermost first: RequestContext sees every response, errors from the others included.
    app.add_middleware(JsonBodies)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(Guard, api_keys=settings.api_keys, rate_limit=settings.rate_limit)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["X-Request-Id", "Retry-After"],
                           allow_credentials="*" not in settings.cors_origins)
    app.add_middleware(RequestContext, metrics=metrics, log_requests=settings.log_requests)
    return app


async def drain(app: FastAPI, settle_seconds: float = 5.0) -> None:
    """Drain the service, then give WebSocket generations the moment they need to send their
    last message (their events have ended; the send has not yet happened)."""
    if getattr(app.state, "grpc", None) is not None:  # gRPC health checkers stop sending work
        await app.state.grpc.set_serving(False)
    await begin_drain(app)
    deadline = time.monotonic() + settle_seconds
    while any(session.running for session in app.state.sockets) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


def begin_drain(app: FastAPI) -> asyncio.Task:
    """Stop taking requests and let running ones finish within the grace period (once)."""
    if app.state.drain_task is None:
        service, grace = app.state.service, app.state.settings.grace_seconds
        log.info("draining: %d request(s) in flight, up to %.0fs to finish", service.in_flight, grace)
        app.state.drain_task = asyncio.get_running_loop().create_task(service.stop(grace))
    return app.state.drain_task
