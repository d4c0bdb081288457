"""Cross-cutting HTTP concerns as plain ASGI middleware (streaming-safe, unlike BaseHTTPMiddleware).

- RequestContext: an `X-Request-Id` on every response (the client's, if it sent a sane one),
  security headers, one access-log line with the latency, the request counter; and for a
  failure of Kiln's own, a well-formed 500 that leaves the connection usable (an exception
  let through to the server would make it drop the connection, and with it the next
  request a pooling client sends on it).
- Guard: API keys (`Authorization: Bearer`, or `x-api-key` as Anthropic's clients send it; 401
  without) and a per-key token-bucket rate limit (429 with `Retry-After`) that counts
  generations: an HTTP request is one, and on a WebSocket each `generate` message is one (the
  route takes it from the same bucket); /health and /metrics stay open.
- BodyLimit: 413 for a body over the limit, by Content-Length or while it streams in.
"""

from __future__ import annotations

import hmac
import logging
import math
import re
import time
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.runtime.errors import GenerationError

from ..errors import APIError, error_response
from ..metrics import Metrics

log = logging.getLogger("kiln.server")
access_log = logging.getLogger("kiln.access")

OPEN_PATHS = {"/health", "/metrics"}
# Where Guard leaves a WebSocket's rate-limit check (scope state): the route calls it per generation.
RATE_LIMIT_STATE = "check_rate_limit"
KNOWN_ROUTES = {"/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                "/v1/messages/count_tokens", "/infill", "/v1/embeddings", "/v1/score", "/score", "/rerank",
                "/v1/rerank", "/v2/rerank", "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/models",
                "/health", "/metrics", "/ws", "/tokenize", "/detokenize", "/tokenizer_info"}
SECURITY_HEADERS = {
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "content-security-policy": "default-src 'none'; frame-ancestors 'none'",
    "cache-control": "no-store",
}
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


class RequestContext:
    def __init__(self, app: ASGIApp, metrics: Metrics, log_requests: bool = True):
        self.app = app
        self.metrics = metrics
        self.log_requests = log_requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        given = Headers(scope=scope).get("x-request-id", "")
        request_id = given if _REQUEST_ID.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started = time.perf_counter()
        status = 499 if scope["type"] == "http" else 101  # 499: the client left before a response
        responded = False

        async def send_with_headers(message: Message) -> None:
            nonlocal status, responded
            responded = responded or message["type"] in ("http.response.start", "websocket.accept", "websocket.close")
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = MutableHeaders(scope=message)
                headers["x-request-id"] = request_id
                for name, value in SECURITY_HEADERS.items():
                    if name not in headers:
                        headers[name] = value
            elif message["type"] == "websocket.accept":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode())]
            elif message["type"] == "websocket.close" and status == 101 and message.get("code", 1000) == 1008:
                status = 403
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        except Exception as error:
            status = 500
            log.exception("unexpected error on %s %s", scope.get("method", "WS"), scope["path"])
            if scope["type"] != "http" or responded:
                return  # nothing well-formed can be said any more
            failure = GenerationError(f"internal error: {type(error).__name__}")
            await error_response(scope["path"], failure)(scope, receive, send_with_headers)
        finally:
            path = scope["path"]
            route = path if path in KNOWN_ROUTES else "other"
            method = scope.get("method", "WS")
            self.metrics.requests.labels(route, method, str(status)).inc()
            if self.log_requests:
                client = scope.get("client") or ("-", 0)
                access_log.info('%s:%s "%s %s" %d %.1fms id=%s', client[0], client[1], method, path, status,
                                (time.perf_counter() - started) * 1000, request_id)


async def reject(scope: Scope, receive: Receive, send: Send, error: APIError) -> None:
    """Answer with an error before the app sees the request (HTTP), or refuse the socket."""
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008, "reason": error.message[:120]})
        return
    await error_response(scope["path"], error)(scope, receive, send)


class TokenBucket:
    def __init__(self, rate: float, burst: float):
        self.rate, self.burst = rate, burst
        self.tokens, self.stamp = burst, time.monotonic()

    def take(self) -> float:
        """0 if a request may go now, else the seconds until it may."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate


class Guard:
    def __init__(self, app: ASGIApp, api_keys: list[str], rate_limit: float):
        self.app = app
        self.api_keys = [k.encode() for k in api_keys]
        self.rate_limit = rate_limit
        self.buckets: dict[str, TokenBucket] = {}

    def _key(self, scope: Scope) -> str | None:
        headers = Headers(scope=scope)
        authorization = headers.get("authorization", "")
        if authorization[:7].lower() == "bearer ":
            return authorization[7:].strip()
        if scope["type"] == "websocket":  # browsers cannot set headers on a WebSocket
            for name, value in re.findall(r"(?:^|&)([^=&]+)=([^&]*)", scope.get("query_string", b"").decode()):
                if name == "api_key":
                    return value
        return headers.get("x-api-key")

    def _authorized(self, key: str | None) -> bool:
        if key is None:
            return False
        given = key.encode()
        return any(hmac.compare_digest(given, k) for k in self.api_keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        key = self._key(scope)
        if self.api_keys and not self._authorized(key):
            error = APIError(401, "a valid API key is required: send 'Authorization: Bearer <key>' (or "
                             "'x-api-key: <key>', as Anthropic's clients do)",
                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            return await reject(scope, receive, send, error)
        if self.rate_limit > 0:
            client = key if self.api_keys else (scope.get("client") or ("-",))[0]
            bucket = self._bucket(client)
            if scope["type"] == "websocket":
                scope.setdefault("state", {})[RATE_LIMIT_STATE] = lambda: self.check(bucket)
            else:
                try:
                    self.check(bucket)
                except APIError as error:
                    return await reject(scope, receive, send, error)
        await self.app(scope, receive, send)

    def check(self, bucket: TokenBucket) -> None:
        """Take one generation from `bucket`, or raise the 429 that says when to retry."""
        wait = bucket.take()
        if wait > 0:
            raise APIError(429, f"rate limit of {self.rate_limit:g} requests per second exceeded: retry later",
                           code="rate_limit_exceeded", headers={"Retry-After": str(max(1, math.ceil(wait)))})

    def _bucket(self, client: str) -> TokenBucket:
        bucket = self.buckets.get(client)
        if bucket is None:
            if len(self.buckets) > 10_000:  # forget idle clients (their buckets are full again)
                now = time.monotonic()
                self.buckets = {c: b for c, b in self.buckets.items() if now - b.stamp < b.burst / b.rate}
            bucket = self.buckets[client] = TokenBucket(self.rate_limit, max(1.0, self.rate_limit))
        return bucket


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than {self.max_bytes} bytes", code="request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = Headers(scope=scope).get("content-length")
        if length is not None:
            if not length.isdigit():
                return await reject(scope, receive, send, APIError(400, "invalid Content-Length", code="invalid_request"))
            if int(length) > self.max_bytes:
                return await reject(scope, receive, send, self._too_large())
        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI lets an HTTPException from reading the body through; errors.py formats it.
                    raise HTTPException(413, self._too_large().message)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except HTTPException as error:
            if error.status_code != 413 or started:
                raise
            await reject(scope, receive, send, self._too_large())


class JsonBodies:
    """Read the API routes' bodies as JSON whatever Content-Type the client claimed.

    `curl -d '{...}'` sends application/x-www-form-urlencoded, and shortfin reads such a
    body as JSON; so do we, rather than refuse a well-formed request over a header.
    """

    JSON_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                   "/v1/messages/count_tokens", "/infill", "/tokenize", "/detokenize", "/v1/embeddings", "/v1/score",
                   "/score", "/rerank", "/v1/rerank", "/v2/rerank", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in ("POST", "PUT") and scope["path"].rstrip("/") in self.JSON_ROUTES:
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)
