"""Each request's id: given on arrival, renamed by a generation route to its response's id, and carried
by the `x-request-id` header, every error body and the log's lines about the request."""
from __future__ import annotations

import uuid
from contextvars import ContextVar

from fastapi.responses import JSONResponse
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from splitmoe.gateway.openai_types import ErrorResponse

REQUEST_ID_HEADER = "x-request-id"


class RequestId:
    """This request's id: `req-<hex>`, which a generation route renames to its response's id
    (`chatcmpl-<hex>`), so the header, the body's id, error bodies and log lines all agree."""

    def __init__(self) -> None:
        self.hex = uuid.uuid4().hex
        self.value = f"req-{self.hex}"

    def rename(self, prefix: str) -> str:
        self.value = f"{prefix}-{self.hex}"
        return self.value

    @staticmethod
    def current() -> "RequestId":
        return _REQUEST_ID.get()

    @staticmethod
    def current_or_none() -> "RequestId | None":
        """None outside a request: RequestIdMiddleware sets it for each."""
        return _REQUEST_ID.get(None)


_REQUEST_ID: ContextVar[RequestId] = ContextVar("request_id")


def error_json(error: ErrorResponse, headers: dict[str, str] | None = None) -> JSONResponse:
    """The error with its request's id, in the body and in the header (set here too: a 500 from an
    unhandled exception is sent from outside RequestIdMiddleware)."""
    request_id = RequestId.current_or_none()
    headers = dict(headers or {})
    if request_id is not None:
        error.error.request_id = error.error.request_id or request_id.value
        headers[REQUEST_ID_HEADER] = request_id.value
    return JSONResponse(error.model_dump(), status_code=error.status_code, headers=headers)


class RequestIdMiddleware:
    """Gives each request its id (RequestId) and every response its `x-request-id` header."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = RequestId()
        _REQUEST_ID.set(request_id)  # this request's task and those it starts; an exception handler too

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                if REQUEST_ID_HEADER not in headers:
                    headers.append(REQUEST_ID_HEADER, request_id.value)
            await send(message)

        await self.app(scope, receive, send_with_id)
