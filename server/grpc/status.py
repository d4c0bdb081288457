"""Kiln's errors as gRPC status codes, for every gRPC service of Kiln's."""

from __future__ import annotations

import grpc

from kiln.runtime.errors import KilnError, QueueFullError

_STATUS_BY_HTTP = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
                   503: grpc.StatusCode.UNAVAILABLE}


def status_of(error: KilnError) -> grpc.StatusCode:
    """A Kiln error as gRPC says it: a bad request is INVALID_ARGUMENT, never INTERNAL."""
    if isinstance(error, QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    return _STATUS_BY_HTTP.get(error.status, grpc.StatusCode.INTERNAL)
