"""The gRPC front: KServe v2 / Triton's GRPCInferenceService and vLLM's VllmEngine (what the
smg gateway speaks to its workers) over the same GenerateService as the HTTP routes, with gRPC
health checking and server reflection, behind the HTTP server's API keys.

The message and service stubs are the ones the protocol packages ship, generated from their
own .proto files: tritonclient's for KServe v2 (package `inference`), smg-grpc-proto's for
VllmEngine (package `vllm.grpc.engine`). Nothing here is generated or edited by hand. They
are the `grpc` extra, imported only when `--grpc-port` is given.
"""

from __future__ import annotations

import asyncio
import functools
import logging

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from kiln.runtime.service import GenerateService

from ..metrics import Metrics
from ..settings import ServerSettings
from .kserve import add_kserve_service
from .vllm_engine import add_vllm_engine_service

log = logging.getLogger("kiln.grpc")
# Callable without a key, as load balancers and grpcurl expect.
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/")
class ApiKeyInterceptor(aio.ServerInterceptor):
    """`authorization: Bearer KEY` metadata, checked as the HTTP middleware checks the header."""

    def __init__(self, keys: tuple[str, ...]):
        self.keys = frozenset(keys)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_SERVICES):
            return handler
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if given.startswith("Bearer ") and given[len("Bearer "):] in self.keys:
            return handler
        return _refusing(handler)


class CallCounter(aio.ServerInterceptor):
    """Counts every call by method and the status it ended with (`kiln_grpc_requests_total`),
    as the HTTP middleware counts requests by route and status; refused calls included."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        counted = functools.partial(_Counted, self.metrics, details.method)
        if handler.response_streaming:
            kind = "stream_stream" if handler.request_streaming else "unary_stream"
            behavior = getattr(handler, kind)

            async def streaming(request, context):
                with counted(context):
                    async for response in behavior(request, context):
                        yield response

            return handler._replace(**{kind: streaming})
        kind = "stream_unary" if handler.request_streaming else "unary_unary"
        behavior = getattr(handler, kind)

        async def unary(request, context):
            with counted(context):
                return await behavior(request, context)

        return handler._replace(**{kind: unary})


class _Counted:
    """Around one call: counts it, with its status, as it ends."""

    def __init__(self, metrics: Metrics, method: str, context):
        self.metrics, self.method, self.context = metrics, method, context

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback) -> None:
        code = self.context.code()
        if code is None:  # no status set: OK, cancelled by the client, or a failure of Kiln's own
            code = (grpc.StatusCode.CANCELLED if isinstance(error, asyncio.CancelledError) else
                    grpc.StatusCode.UNKNOWN if error is not None and not isinstance(error, aio.AbortError) else
                    grpc.StatusCode.OK)
        name = code.name if isinstance(code, grpc.StatusCode) else str(code)
        self.metrics.grpc_requests.labels(self.method, name).inc()


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED."""

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid API key is required "
                            "(metadata authorization: Bearer KEY)")

    async def streaming(request, context):
        await unary(request, context)
        yield  # never reached: makes this an async generator, as a streaming handler is

    kinds = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(streaming if handler.response_streaming else unary,
                request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


class HealthReporting:
    """What a gRPC server of Kiln's (`server`, `health`, `service_names`) says of its health, and its stop."""

    async def set_serving(self, serving: bool) -> None:
        """SERVING while requests may come (the model loaded), NOT_SERVING while loading or draining."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace: float) -> None:
        await self.set_serving(False)
        await self.server.stop(grace)


class GrpcFront(HealthReporting):
    """The gRPC server beside the HTTP one: started once the app starts, stopped as it drains."""

    def __init__(self, service: GenerateService, settings: ServerSettings, metrics: Metrics | None = None):
        interceptors = [CallCounter(metrics)] if metrics is not None else []
        if settings.api_keys:
            interceptors.append(ApiKeyInterceptor(settings.api_keys))
        self.server = aio.server(interceptors=interceptors,
                                 options=[("grpc.max_receive_message_length", settings.max_body_bytes)])
        self.health = HealthServicer()
        names = [add_kserve_service(self.server, service, settings, metrics),
                 add_vllm_engine_service(self.server, service, settings, metrics)]
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names += [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self.server)
        self.service_names = names[:2]
        self.address = f"{settings.host}:{settings.grpc_port}"
        self.port = self.server.add_insecure_port(self.address)  # the one chosen, for port 0
        if not self.port:
            raise OSError(f"cannot listen for gRPC on {self.address}")

    async def start(self) -> None:
        await self.server.start()
        log.info("gRPC on %s: %s", self.address, ", ".join(self.service_names))
