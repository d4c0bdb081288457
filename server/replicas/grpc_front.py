"""The front's gRPC server: KServe v2 and VllmEngine calls forwarded, as raw bytes, to a replica
chosen as for HTTP (the prompt's page hashes), with health checking and reflection answered
here. A replica's own gRPC server parses, authenticates and answers each call, so what a
client sees is what a single server would say.

Triton's bidirectional ModelStreamInfer carries independent requests: each is routed on its
own and the answers merge into the one stream, as they would on one server. An Abort reaches
the replica its Generate went to. KV events stay per replica: a front that routes by prefix
itself has no single cache to report, so SubscribeKvEvents says so.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from ..grpc.server import HealthReporting
from .grpc_bridge import GrpcCall, GrpcStatus, status_code
from .prefix_table import RouteHint

log = logging.getLogger("kiln.replicas")
ABORT = "/vllm.grpc.engine.VllmEngine/Abort"
KV_EVENTS = "/vllm.grpc.engine.VllmEngine/SubscribeKvEvents"
# forward(call, hint) -> the replica's answer: messages, then a GrpcStatus if it failed.
Forward = Callable[[GrpcCall, RouteHint], AsyncIterator]


def forwarded_services():
    """The services a replica serves, as descriptors (from the protocol packages' stubs)."""
    from smg_grpc_proto.generated import vllm_engine_pb2
    from tritonclient.grpc import service_pb2

    return [service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"],
            vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"]]


class FailedCall(Exception):
    def __init__(self, status: GrpcStatus):
        super().__init__(status.details)
        self.status = status


class GrpcFrontServer(HealthReporting):
    def __init__(self, address: str, forward: Forward, hint: Callable[[str, bytes], RouteHint],
                 max_message_bytes: int):
        self.forward, self.hint = forward, hint
        self.server = aio.server(options=[("grpc.max_receive_message_length", max_message_bytes)])
        self.health = HealthServicer()
        names = []
        for service in forwarded_services():
            handlers = {method.name: self._handler(f"/{service.full_name}/{method.name}", method.client_streaming,
                                                   method.server_streaming) for method in service.methods}
            self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service.full_name, handlers)])
            names.append(service.full_name)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = names
        reflection.enable_server_reflection(
            [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], self.server)
        self.address = address
        if not self.server.add_insecure_port(address):
            raise OSError(f"cannot listen for gRPC on {address}")

    async def start(self) -> None:
        await self.server.start()
        await self.set_serving(True)
        log.info("gRPC front on %s: %s", self.address, ", ".join(self.service_names))

    # -- forwarding ----------------------------------------------------------------------
    async def _answers(self, call: GrpcCall, hint: RouteHint) -> AsyncIterator[bytes]:
        async for item in self.forward(call, hint):
            if isinstance(item, GrpcStatus):
                raise FailedCall(item)
            yield item

    def _handler(self, method: str, request_streaming: bool, response_streaming: bool) -> grpc.RpcMethodHandler:
        def one_call(request: bytes, context) -> GrpcCall:
            return GrpcCall(method, (request,), _metadata(context), response_streaming=response_streaming)

        async def unary(request: bytes, context):
            try:
                if method == ABORT:
                    return await self._abort(request, context)
                return await _only(self._answers(one_call(request, context), self.hint(method, request)))
            except FailedCall as failed:
                await context.abort(status_code(failed.status), failed.status.details)

        async def server_streaming(request: bytes, context):
            if method == KV_EVENTS:
                await context.abort(grpc.StatusCode.UNIMPLEMENTED, "KV events are per replica: behind the "
                                    "data-parallel front, which routes by prefix itself, subscribe to none")
            try:
                async for message in self._answers(one_call(request, context), self.hint(method, request)):
                    yield message
            except FailedCall as failed:
                await context.abort(status_code(failed.status), failed.status.details)

        async def bidirectional(requests, context):
            async for message in self._each_on_its_own(method, requests, context):
                yield message

        if request_streaming:
            return grpc.stream_stream_rpc_method_handler(bidirectional)
        if response_streaming:
            return grpc.unary_stream_rpc_method_handler(server_streaming)
        return grpc.unary_unary_rpc_method_handler(unary)

    async def _each_on_its_own(self, method: str, requests, context) -> AsyncIterator[bytes]:
        """Every request of the stream forwarded as a stream of one, the answers merged."""
        answers: asyncio.Queue = asyncio.Queue()
        tasks: set[asyncio.Task] = set()
        metadata = _metadata(context)

        async def answer(request: bytes) -> None:
            call = GrpcCall(method, (request,), metadata, request_streaming=True, response_streaming=True)
            try:
                async for message in self._answers(call, self.hint(method, request)):
                    await answers.put(message)
            except FailedCall as failed:  # the whole stream fails, as it would on one server
                await answers.put(failed)

        async def read() -> None:
            async for request in requests:
                task = asyncio.ensure_future(answer(request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.gather(*list(tasks))
            await answers.put(None)

        reader = asyncio.ensure_future(read())
        try:
            while (item := await answers.get()) is not None:
                if isinstance(item, FailedCall):
                    await context.abort(status_code(item.status), item.status.details)
                yield item
        finally:  # the client went away: every forwarded request is cancelled with it
            reader.cancel()
            for task in list(tasks):
                task.cancel()

    async def _abort(self, request: bytes, context) -> bytes:
        """Each request id to the replica its Generate went to."""
        from smg_grpc_proto.generated import vllm_engine_pb2 as pb

        ids = list(pb.AbortRequest.FromString(request).request_ids)
        for request_id in ids or [""]:
            single = pb.AbortRequest(request_ids=[request_id] if request_id else []).SerializeToString()
            await _only(self._answers(GrpcCall(ABORT, (single,), _metadata(context)), RouteHint(follows=request_id)))
        return pb.AbortResponse().SerializeToString()


def _metadata(context) -> tuple[tuple[str, str], ...]:
    """What the client sent (its API key among it), minus what gRPC itself sets."""
    return tuple((key, value) for key, value in (context.invocation_metadata() or ())
                 if not key.startswith(("grpc-", ":")) and key != "user-agent" and isinstance(value, str))


async def _only(messages: AsyncIterator[bytes]) -> bytes:
    answer = None
    async for message in messages:
        answer = message
    if answer is None:
        raise FailedCall(GrpcStatus("INTERNAL", "the replica sent no answer"))
    return answer
