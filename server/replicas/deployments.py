"""The two Ray Serve deployments: the engine (one whole Kiln app per replica) and the front.

An engine replica is the single server's app in a Ray actor: same routes, middleware,
API keys and errors, its own GenerateService and KV cache, its own share of the cores
(or its own GPU). The front is the ingress: it reads each request's prompt into page
hashes, and Ray's handle, with PrefixAffinityRouter, sends it to a replica; the response
streams back chunk by chunk, and a client that leaves cancels the call, which aborts the
generation on the replica.
"""

# No `from __future__ import annotations`: FastAPI reads the route's annotations as types.
import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from kiln.runtime.errors import NotReadyError
from kiln.runtime.service import GenerateService, ServiceState
from kiln.runtime.service_config import ServiceConfig

from ..app import begin_drain, create_app
from ..errors import error_response
from ..settings import ServerSettings
from .asgi_bridge import ForwardedRequest, ResponseStart, call_app, call_websocket
from .prefix_table import RouteHint
from .router import ROUTING_KEYWORD
from .routing_key import RoutingKeys, RoutingKeysSpec

log = logging.getLogger("kiln.replicas")
REPLICA_HEADER = b"x-kiln-replica"  # which replica answered: for clients, logs and tests
ENGINE_NAME = "KilnEngine"
FRONT_NAME = "KilnFront"
HOP_HEADERS = {b"content-length", b"transfer-encoding", b"connection", b"date", b"server"}


def task_topology_flag(threads: int, local_rank: int | None) -> str:
    """One IREE task worker per core of this replica's share, on cores of its own: IREE pins each
    worker to a core, and replicas left to choose would all take the first ones."""
    if local_rank is None:
        return f"--task_topology_max_group_count={threads}"
    cores = os.cpu_count() or 1
    return "--task_topology_cpu_ids=" + ",".join(str((local_rank * threads + i) % cores) for i in range(threads))


class KilnEngine:
    """One engine replica: the Kiln app, loaded before Ray sends it anything."""

    async def __init__(self, service_config: ServiceConfig, settings: ServerSettings, threads: int = 0):
        context = serve.get_replica_context()
        if threads:  # before the first device is created
            from iree.runtime import flags

            flags.parse_flags(task_topology_flag(threads, getattr(context.rank, "local_rank", None)))
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.replica_id = context.replica_id.unique_id.encode()
        self.service = GenerateService(service_config)
        self.sockets: dict[str, asyncio.Queue] = {}  # open WebSocket sessions: the client's messages
        self.app = create_app(self.service, settings)
        self.lifespan = self.app.router.lifespan_context(self.app)
        await self.lifespan.__aenter__()
        while self.service.state is ServiceState.LOADING and self.app.state.load_error is None:
            await asyncio.sleep(0.05)
        if self.app.state.load_error is not None:
            raise RuntimeError(f"the replica could not load the model: {self.app.state.load_error}")
        grpc_front = getattr(self.app.state, "grpc", None)  # its own server, on a port of its own
        self.grpc_channel = None
        if grpc_front is not None:
            from grpc import aio

            self.grpc_channel = aio.insecure_channel(f"127.0.0.1:{grpc_front.port}", options=[
                ("grpc.max_receive_message_length", settings.max_body_bytes)])

    async def forward(self, request: ForwardedRequest, **routing) -> AsyncIterator[ResponseStart | bytes]:
        """The app's answer to one HTTP request (`routing` is the router's, unused here)."""
        async for item in call_app(self.app, request):
            if isinstance(item, ResponseStart):
                item = ResponseStart(item.status, item.headers + ((REPLICA_HEADER, self.replica_id),))
            yield item

    async def open_socket(self, session: str, request: ForwardedRequest, **routing) -> AsyncIterator[dict]:
        """A WebSocket session with the app: what it sends, as ASGI messages. The client's
        messages arrive through `socket_message` calls, which follow this one here."""
        incoming: asyncio.Queue = asyncio.Queue()
        self.sockets[session] = incoming
        try:
            async for message in call_websocket(self.app, request, incoming):
                yield message
        finally:
            self.sockets.pop(session, None)

    async def socket_message(self, session: str, message: dict, **routing) -> bool:
        """A client's message (ASGI websocket.receive or .disconnect) for an open session."""
        incoming = self.sockets.get(session)
        if incoming is not None:
            incoming.put_nowait(message)
        return incoming is not None

    async def grpc_call(self, call, **routing) -> AsyncIterator:
        """The replica's gRPC services' answer to one call (a GrpcCall): messages, then a
        GrpcStatus if it failed."""
        from .grpc_bridge import call_local

        async for item in call_local(self.grpc_channel, call):
            yield item

    def check_health(self) -> None:
        if self.app.state.load_error is not None or self.service.state is ServiceState.STOPPED:
            raise RuntimeError(f"the engine is {self.service.state.value}")

    def record_routing_stats(self) -> dict:
        """What the front's /metrics shows per replica (Ray polls it)."""
        stats = self.service.stats()
        return {"running": stats.running_requests, "waiting": stats.waiting_requests,
                "pages_total": stats.pages_total, "pages_free": stats.pages_free, "pages_cached": stats.pages_cached,
                "prompt_tokens": stats.prompt_tokens, "prefix_hit_tokens": stats.prefix_hit_tokens,
                "generated_tokens": stats.generated_tokens, "preemptions": stats.preemptions}

    async def __del__(self):
        """Ray is stopping this replica: running requests get the grace period, then the app stops."""
        await begin_drain(self.app)
        await self.lifespan.__aexit__(None, None, None)


front_app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)


@serve.ingress(front_app)
class KilnFront:
    """The ingress: every route forwarded to a replica, the prompt's page hashes steering it."""

    async def __init__(self, engine: DeploymentHandle, keys: RoutingKeysSpec, grpc_address: str | None = None,
                       max_message_bytes: int = 16 * 2**20):
        self.engine = engine.options(stream=True)
        self.engine_calls = engine  # for calls with one answer
        self.keys = RoutingKeys(keys.tokenizer_path, keys.page_tokens, keys.chat_template, keys.max_chars)
        self.in_flight = 0  # responses (HTTP and gRPC) still streaming back through this front
        self.draining = False
        self.grpc = None
        if grpc_address is not None:
            from .grpc_front import GrpcFrontServer

            self.grpc = GrpcFrontServer(grpc_address, self.forward_grpc, self.keys.of_grpc, max_message_bytes)
            await self.grpc.start()

    async def forward_grpc(self, call, hint: RouteHint) -> AsyncIterator:
        """A gRPC call (grpc_bridge.GrpcCall) to the replica the router picks for `hint`."""
        if self.draining:
            from .grpc_bridge import GrpcStatus

            yield GrpcStatus("UNAVAILABLE", "the service is draining, not ready")
            return
        self.in_flight += 1
        answer = self.engine.grpc_call.remote(call, **{ROUTING_KEYWORD: hint})
        try:
            async for item in answer:
                yield item
        finally:  # the client cancelled (or the call ended): the replica's call is cancelled too
            answer.cancel()
            self.in_flight -= 1

    async def drain(self, grace_seconds: float) -> int:
        """Refuse new requests (503, as a draining server does) and wait up to `grace_seconds`
        for those in flight to finish; returns how many had not. Ray stops the replicas next,
        and would cut a stream it found still running."""
        self.draining = True
        if self.grpc is not None:  # health checkers stop sending work
            await self.grpc.set_serving(False)
        deadline = time.monotonic() + grace_seconds
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.in_flight

    async def __del__(self):
        if self.grpc is not None:
            await self.grpc.stop(grace=1.0)

    @front_app.get("/metrics")
    async def metrics(self) -> Response:
        return Response(self.routing_metrics(), media_type="text/plain; version=0.0.4")

    @front_app.websocket("/{path:path}")
    async def forward_socket(self, websocket: WebSocket, path: str) -> None:
        """A WebSocket session, on one replica from handshake to close (spread by load: the
        prompts come later), its messages relayed both ways."""
        if self.draining:
            await websocket.close(code=1013, reason="the service is draining, not ready")
            return
        session = uuid.uuid4().hex
        request = ForwardedRequest(
            method="GET", path=websocket.url.path, query_string=websocket.url.query.encode(),
            headers=tuple(websocket.headers.raw), body=b"",
            client=(websocket.client.host, websocket.client.port) if websocket.client else None)
        self.in_flight += 1
        outgoing = self.engine.open_socket.remote(session, request, **{ROUTING_KEYWORD: RouteHint(key=session)})
        relay = None
        try:
            first = await outgoing.__anext__()
            if first["type"] == "websocket.close":  # refused at the handshake (an API key, a limit)
                await websocket.close(code=first.get("code", 1000), reason=first.get("reason", ""))
                return
            await websocket.accept(subprotocol=first.get("subprotocol"), headers=first.get("headers"))
            relay = asyncio.ensure_future(self._relay_client(websocket, session))
            async for message in outgoing:
                await websocket.send(message)
                if message["type"] == "websocket.close":
                    break
        except (StopAsyncIteration, WebSocketDisconnect, RuntimeError):  # RuntimeError: sent to a closed socket
            pass
        finally:
            if relay is not None:
                relay.cancel()
            outgoing.cancel()
            self.in_flight -= 1

    async def _relay_client(self, websocket: WebSocket, session: str) -> None:
        hint = {ROUTING_KEYWORD: RouteHint(follows=session)}
        while True:
            message = await websocket.receive()
            await self.engine_calls.socket_message.remote(session, dict(message), **hint)
            if message["type"] == "websocket.disconnect":
                return

    @front_app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
    async def forward(self, path: str, request: Request) -> Response:
        if self.draining:
            return error_response(request.url.path, NotReadyError("the service is draining, not ready", retry_after=1))
        body = await request.body()
        hashes = await asyncio.to_thread(self.keys.of_request, request.url.path, body) if body else []
        forwarded = ForwardedRequest(
            method=request.method, path=request.url.path, query_string=request.url.query.encode(),
            headers=tuple(request.headers.raw), body=body,
            client=(request.client.host, request.client.port) if request.client else None)
        self.in_flight += 1
        answer = self.engine.forward.remote(forwarded, **{ROUTING_KEYWORD: RouteHint(tuple(hashes))})
        try:
            start = await answer.__anext__()
        except BaseException:
            self.in_flight -= 1
            raise
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.headers if k.lower() not in HOP_HEADERS}

        async def body_chunks():
            try:
                async for chunk in answer:
                    yield chunk
            finally:  # the client left (or the response ended): the replica stops generating
                answer.cancel()
                self.in_flight -= 1

        return StreamingResponse(body_chunks(), status_code=start.status, headers=headers)

    def routing_metrics(self) -> str:
        """The router's counts in Prometheus text (requests per replica; prompt pages, and those
        routed to a replica that held them by the router's table) and each replica's engine
        figures as Ray last polled them."""
        # Imported here, not at the top: Ray ships this class by value, with a copy of the module's
        # globals, while the router registers itself in the module as imported in this process.
        from kiln.server.replicas.router import ROUTERS

        router = ROUTERS.get(ENGINE_NAME)
        lines = ["# TYPE kiln_dp_requests_routed_total counter"]
        if router is None:
            return "\n".join(lines) + "\n"
        for replica, count in sorted(router.routed.items()):
            lines.append(f'kiln_dp_requests_routed_total{{replica="{replica}"}} {count}')
        lines += ["# TYPE kiln_dp_prompt_pages_total counter", f"kiln_dp_prompt_pages_total {router.prompt_pages}",
                  "# TYPE kiln_dp_prompt_pages_matched_total counter",
                  f"kiln_dp_prompt_pages_matched_total {router.matched_pages}"]
        stats = {r.replica_id.unique_id: r.routing_stats for r in router.curr_replicas.values()}
        for name in ("running", "waiting", "pages_total", "pages_free", "pages_cached", "prompt_tokens", "prefix_hit_tokens",
                     "generated_tokens", "preemptions"):
            lines.append(f"# TYPE kiln_replica_{name} gauge")
            for replica, values in sorted(stats.items()):
                if name in (values or {}):
                    lines.append(f'kiln_replica_{name}{{replica="{replica}"}} {values[name]}')
        return "\n".join(lines) + "\n"
