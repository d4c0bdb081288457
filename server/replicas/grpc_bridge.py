"""One gRPC call through a replica's own gRPC server, as raw messages: the front forwards the
bytes it received, the replica's KServe and VllmEngine services answer them exactly as a
single server's would (API keys and errors included), and the answer goes back as bytes.

A replica's gRPC server listens on a port of its own on 127.0.0.1, reached only from the
replica itself; the front is the one address clients use.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from grpc import aio


@dataclass(frozen=True)
class GrpcCall:
    method: str  # "/package.Service/Method"
    requests: tuple[bytes, ...]  # one, unless the method streams requests
    metadata: tuple[tuple[str, str], ...]
    request_streaming: bool = False
    response_streaming: bool = False


@dataclass(frozen=True)
class GrpcStatus:
    """How a call ended when it did not end OK: a grpc.StatusCode's name and the details."""

    code: str
    details: str


async def call_local(channel: aio.Channel, call: GrpcCall) -> AsyncIterator[bytes | GrpcStatus]:
    """The call's response messages, then a GrpcStatus if it failed. Closing this generator
    cancels the call, which aborts its generation."""
    metadata = aio.Metadata(*call.metadata)
    if call.request_streaming:
        running = channel.stream_stream(call.method)(iter(call.requests), metadata=metadata)
    elif call.response_streaming:
        running = channel.unary_stream(call.method)(call.requests[0], metadata=metadata)
    else:
        running = channel.unary_unary(call.method)(call.requests[0], metadata=metadata)
    try:
        if call.request_streaming or call.response_streaming:
            async for message in running:
                yield message
        else:
            yield await running
    except aio.AioRpcError as error:
        yield GrpcStatus(error.code().name, error.details() or "")
    finally:
        with contextlib.suppress(Exception):
            running.cancel()


def status_code(status: GrpcStatus) -> grpc.StatusCode:
    return grpc.StatusCode[status.code]
