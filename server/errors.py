"""Errors as clients expect them: OpenAI's JSON on /v1 (and elsewhere), shortfin's on /generate,
Anthropic's on /v1/messages.

Every error Kiln raises is a `KilnError` whose type carries its HTTP status, OpenAI
`type` and `code`, and the field at fault; this module only formats them. Validation
failures and unknown routes are mapped here too, so a client's mistake is always a 4xx
with a message, never a 500. (A failure of Kiln's own is answered by the RequestContext
middleware, which keeps the connection open.)
"""

from __future__ import annotations

import contextlib
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kiln.runtime.errors import GenerationError, InvalidRequestError, KilnError, NotReadyError

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
_UNPARSABLE_BODY = "There was an error parsing the body"

# OpenAI's error types by status.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}
# shortfin's codes (components/error_codes.py) where it has one, in its style where it has not.
_SHORTFIN_CODES = {
    "queue_full": "QUEUE_FULL",
    "not_ready": "SERVICE_UNAVAILABLE",
    "invalid_api_key": "UNAUTHORIZED",
    "rate_limit_exceeded": "RATE_LIMITED",
    "request_too_large": "REQUEST_TOO_LARGE",
    "server_error": "INTERNAL_ERROR",
    "not_found": "NOT_FOUND",
    "method_not_allowed": "METHOD_NOT_ALLOWED",
}

# Anthropic's error types by status (its SDK reads `error.type`); 503, a full queue or a server
# not ready, is what Anthropic calls overloaded.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
ANTHROPIC_PATHS = "/v1/messages"


class APIError(KilnError):
    """An error of the HTTP layer itself (authentication, limits, routes), with its status."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message, param=param)
        self.status = status
        self.type = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.code = code
        self.headers = headers or {}


def error_headers(error: KilnError) -> dict[str, str]:
    headers = dict(getattr(error, "headers", {}))
    if error.retry_after is not None:
        headers["Retry-After"] = str(error.retry_after)
    return headers


def error_body(path: str, error: KilnError) -> dict:
    """The JSON body for `error` on `path`."""
    if path.rstrip("/") == "/generate":
        shortfin_code = _SHORTFIN_CODES.get(error.code or "", "INVALID_REQUEST_ARGS" if error.status < 500
                                            else "INTERNAL_ERROR")
        return {"error": error.message, "code": shortfin_code}
    if path.rstrip("/").startswith(ANTHROPIC_PATHS):
        return anthropic_error(error)
    return {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}


def anthropic_error(error: KilnError) -> dict:
    """Anthropic's error body: its type by status, the message naming the field at fault."""
    kind = _ANTHROPIC_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    message = error.message if error.param is None or error.param in error.message else \
        f"{error.param}: {error.message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


@contextlib.contextmanager
def fields_named(names: dict[str, str]):
    """InvalidRequestErrors raised inside name the field by this API's word for it: a route that
    runs chat's machinery for another API (Responses, Anthropic's) shows its own field names."""
    try:
        yield
    except InvalidRequestError as error:
        name = names.get(error.param)
        if name is None:
            raise
        message = re.sub(rf"\b{re.escape(error.param)}\b", name, error.message)
        raise InvalidRequestError(message, param=name) from None


def error_response(path: str, error: KilnError) -> JSONResponse:
    return JSONResponse(error_body(path, error), status_code=error.status, headers=error_headers(error))


def failure_of(outcome) -> KilnError | None:
    """The error a client sees for a sequence (a Completion or an Event) that failed or was aborted."""
    if outcome.finish_reason == "error" and outcome.error_param is not None:
        return InvalidRequestError(outcome.error, param=outcome.error_param)
    if outcome.finish_reason == "error":
        return GenerationError(f"generation failed: {outcome.error}")
    if outcome.finish_reason == "abort":
        return NotReadyError("the server is shutting down: the request was aborted", retry_after=1)
    return None


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    problems = error.errors()
    if not problems:
        return "invalid request", None
    first = problems[0]
    # Drop "body" and the union-member tags pydantic adds ("str", "list[int]"...): keep the path.
    location = [str(part) for part in first.get("loc", ())[1:]
                if isinstance(part, int) or (part.isidentifier() and part not in _TYPE_TAGS)]
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    where = ".".join(location)
    message = first.get("msg", "invalid value")
    if not location and first.get("type") in ("model_attributes_type", "dict_type", "missing"):
        message = "the body must be a JSON object (sent with Content-Type: application/json)"
    more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
    return (f"{where}: {message}" if where else message) + more, (location[0] if location else None)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(KilnError)
    async def kiln_error(request: Request, error: KilnError):
        return error_response(request.url.path, error)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError):
        message, param = _validation_message(error)
        # FastAPI's 422 on shortfin's route (what shortfin answers), OpenAI's 400 elsewhere.
        if request.url.path.rstrip("/") == "/generate":
            return error_response(request.url.path, APIError(422, message, code="invalid_request", param=param))
        return error_response(request.url.path, InvalidRequestError(message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        code = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed",
                413: "request_too_large"}.get(error.status_code)
        message = error.detail if isinstance(error.detail, str) else "request failed"
        if error.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif error.status_code == 400 and message == _UNPARSABLE_BODY:  # FastAPI's words for it
            message = "the body could not be read as JSON: it must be UTF-8 text holding one JSON object"
        return error_response(request.url.path, APIError(error.status_code, message, code=code,
                                                         headers=getattr(error, "headers", None)))
