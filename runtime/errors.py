"""Kiln's errors, with their meaning as types: what went wrong and who can fix it.

Each class carries how an API shows it (HTTP status, OpenAI `type` and `code`) and
the request field at fault (`param`), so the HTTP layer maps types, never message
text, and the CLI tells a user's mistake (any `KilnError`) from a bug in Kiln (any
other exception). Nothing here imports torch or iree.
"""

from __future__ import annotations

import reprlib

# A client's value as an error message quotes it: a few levels and items deep, never the
# whole of a megabyte list or a value nested thousands of levels (whose repr would recurse).
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxdict, _SHOWN.maxstring, _SHOWN.maxother = 3, 6, 6, 60, 60


def shown(value) -> str:
    """`value`'s repr, cut short: for quoting a client's input in an error message."""
    return _SHOWN.repr(value)


class KilnError(Exception):
    """Something a user or client can act on; the subclasses say what."""

    status = 500
    type = "server_error"
    code = "server_error"

    def __init__(self, message: str, param: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after


class InvalidRequestError(KilnError, ValueError):
    """The request itself is wrong: too long, empty, bad ids or parameters (HTTP 400)."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class ModelNotFoundError(KilnError):
    """A request names a model this server does not serve (HTTP 404)."""

    status = 404
    type = "not_found_error"
    code = "model_not_found"


class NotReadyError(KilnError):
    """The service cannot take requests now: loading, draining or stopped (HTTP 503)."""

    status = 503
    code = "not_ready"

    def __init__(self, message: str, retry_after: int = 5):
        super().__init__(message, retry_after=retry_after)


class QueueFullError(NotReadyError):
    """Too many requests are waiting; a retry soon may be taken (HTTP 503)."""

    code = "queue_full"

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message, retry_after=retry_after)


class ModelLoadError(KilnError):
    """A model or its compiled artifacts are missing, corrupt, or of a kind Kiln cannot run."""


class ExportError(KilnError):
    """Bad export or compile options, or a model the export cannot handle."""


class GenerationError(KilnError):
    """A request that was accepted failed while running (the device call, or Kiln itself)."""
