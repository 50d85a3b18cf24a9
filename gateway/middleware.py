"""The middleware around every route but RequestIdMiddleware (request_id.py): body limit, API key, status counts.

Pure ASGI, so a client's disconnect still reaches a streaming response and cancels its generation.
"""
from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from splitmoe.gateway.metrics import GatewayMetrics
from splitmoe.gateway.openai_types import error_response
from splitmoe.gateway.request_id import error_json

PROBE_PATHS = frozenset({"/health", "/metrics"})  # probes and scrapes: not counted, no trace span


class BodyLimitMiddleware:
    """Buffers each request body up to the limit; a larger one gets 413 before anything parses it."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body = await self._read_body(scope, receive)
        if body is None:
            too_large = error_response(413, f"the request body exceeds {self.max_body_bytes} bytes",
                                       code="request_too_large")
            return await error_json(too_large)(scope, receive, send)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:  # later reads wait for the client's disconnect, as the server delivers it
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return None
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:  # chunked bodies declare no length
                return None
            more = message.get("more_body", False)
        return b"".join(chunks)


class ApiKeyMiddleware:
    """`Authorization: Bearer KEY` (or `X-Api-Key: KEY`) on every path but `open_paths` and what `is_public` says."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str],
                 is_public: Callable[[Scope], bool] = lambda scope: False) -> None:
        self.app = app
        self.api_key = api_key.encode()
        self.open_paths = open_paths
        self.is_public = is_public

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["path"] in self.open_paths or self.is_public(scope)
                or self._authorized(scope)):
            return await self.app(scope, receive, send)
        denied = error_response(401, "invalid or missing API key", code="invalid_api_key")
        await error_json(denied, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        return has_api_key(scope, self.api_key)


def has_api_key(scope: Scope, api_key: bytes) -> bool:
    """Whether the request presents `api_key` (`Authorization: Bearer` or `X-Api-Key`)."""
    headers = dict(scope["headers"])
    scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
    if scheme.lower() != b"bearer":
        token = headers.get(b"x-api-key", b"")
    return hmac.compare_digest(token.strip(), api_key)  # constant time: no timing oracle


class StatusCountMiddleware:
    """Counts responses by HTTP status (401 and 413 included, which never reach a route)."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PROBE_PATHS:
            return await self.app(scope, receive, send)
        status = 500  # what the client gets if the app fails before it answers

        async def counted_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counted_send)
        finally:
            self.metrics.http_responses.labels(status=str(status)).inc()
