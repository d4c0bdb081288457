"""Errors as clients expect them: OpenAI's JSON on /v1 (and elsewhere), shortfin's on /generate.

Routes raise `APIError`; runtime exceptions, validation failures and unknown routes are
mapped here too, so a client's mistake is always a 4xx with a message, never a 500.
"""

from __future__ import annotations

import logging
from dataclasses import fields

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kiln.runtime.chat import ChatTemplateError
from kiln.runtime.sampling import SamplingParams
from kiln.runtime.service import InvalidRequestError, ServiceUnavailableError

log = logging.getLogger("kiln.server")

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
# SamplingParams' messages start with the field's name: the error's `param`.
_SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}

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


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}


def invalid_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, code="invalid_request", param=param)


def model_not_found(name: str, known: list[str]) -> APIError:
    return APIError(404, f"the model {name!r} does not exist: this server serves {', '.join(map(repr, known))}",
                    code="model_not_found", param="model")


def unavailable(message: str, code: str, retry_after: int = 1) -> APIError:
    return APIError(503, message, code=code, headers={"Retry-After": str(retry_after)})


def server_error(message: str) -> APIError:
    return APIError(500, message, code="server_error")


def error_body(path: str, status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    """The JSON body for an error on `path`."""
    if path.rstrip("/") == "/generate":
        shortfin_code = _SHORTFIN_CODES.get(code or "", "INVALID_REQUEST_ARGS" if status < 500 else "INTERNAL_ERROR")
        return {"error": message, "code": shortfin_code}
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error" if status < 500
                                                            else "server_error"), "param": param, "code": code}}


def error_response(path: str, error: APIError) -> JSONResponse:
    return JSONResponse(error_body(path, error.status, error.message, error.code, error.param),
                        status_code=error.status, headers=error.headers)


def from_runtime(error: Exception) -> APIError:
    """A runtime exception raised while checking or submitting a request, as an APIError."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, (InvalidRequestError, ChatTemplateError)):
        message = str(error)
        first = message.split(" ", 1)[0]
        return invalid_request(message, param=first if first in _SAMPLING_FIELDS else None)
    if isinstance(error, ServiceUnavailableError):
        message = str(error)
        code = "queue_full" if "queue is full" in message else "not_ready"
        return unavailable(message, code, retry_after=1 if code == "queue_full" else 5)
    raise error


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
    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return error_response(request.url.path, error)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError):
        message, param = _validation_message(error)
        # FastAPI's 422 on shortfin's route (what shortfin answers), OpenAI's 400 elsewhere.
        status = 422 if request.url.path.rstrip("/") == "/generate" else 400
        return error_response(request.url.path, APIError(status, message, code="invalid_request", param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(error.status_code)
        message = error.detail if isinstance(error.detail, str) else "request failed"
        if error.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return error_response(request.url.path, APIError(error.status_code, message, code=code,
                                                         headers=getattr(error, "headers", None)))

    @app.exception_handler(InvalidRequestError)
    @app.exception_handler(ChatTemplateError)
    @app.exception_handler(ServiceUnavailableError)
    async def runtime_error(request: Request, error: Exception):
        return error_response(request.url.path, from_runtime(error))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception):
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(request.url.path, server_error(f"internal error: {type(error).__name__}"))
