"""The gateway's one gRPC client: the AttentionService stub behind deadlines and one error type.

Every call carries a deadline from settings and the current trace context; every gRPC failure
becomes an `AttentionError` that already knows its HTTP status, so handlers never see grpc types.
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from gateway.settings import GatewaySettings
from proto import attention_pb2 as pb
from proto.attention_pb2_grpc import AttentionServiceStub
from splitmoe.telemetry import inject_grpc_metadata

log = logging.getLogger(__name__)

# The attention service's status codes, as the HTTP status the gateway answers with.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
# Message sizes: a Score answer with 20 top logprobs per prompt token is a few MiB at 128k tokens.
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
)


class AttentionError(Exception):
    """A failed attention-service call, carrying the HTTP status and a message fit for the user."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code

    @classmethod
    def from_rpc(cls, error: grpc.aio.AioRpcError, timeout_s: float) -> "AttentionError":
        status = HTTP_STATUS.get(error.code(), 500)
        code = error.code().name.lower()
        if status == 504:
            return cls(504, f"the attention service did not finish within {timeout_s:g} s", code)
        if status == 500:  # details of an internal failure are for the logs, not the client
            log.error("attention service failed: %s %s", error.code().name, error.details())
            return cls(500, "internal error in the attention service", code)
        return cls(status, error.details() or error.code().name, code)


class AttentionClient:
    """One channel to the attention service; open it inside the event loop that will use it."""

    def __init__(self, settings: GatewaySettings) -> None:
        self._request_timeout_s = settings.request_timeout_s
        self._probe_timeout_s = settings.probe_timeout_s
        self._channel = grpc.aio.insecure_channel(settings.attention_address, options=CHANNEL_OPTIONS)
        self._stub = AttentionServiceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def generate(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        """The response stream; closing it early (or cancelling its task) cancels the call."""
        call = self._stub.Generate(request, timeout=self._request_timeout_s, metadata=inject_grpc_metadata())
        try:
            async for response in call:
                yield response
        except grpc.aio.AioRpcError as e:
            raise AttentionError.from_rpc(e, self._request_timeout_s) from None
        finally:
            call.cancel()  # a no-op once the stream ended; otherwise it aborts the generation

    async def score(self, request: pb.ScoreRequest) -> pb.ScoreResponse:
        return await self._unary(self._stub.Score, request, self._request_timeout_s)

    async def model_info(self) -> pb.ModelInfoResponse:
        return await self._unary(self._stub.ModelInfo, pb.ModelInfoRequest(), self._probe_timeout_s)

    async def stats(self) -> pb.AttentionStats:
        return await self._unary(self._stub.GetStats, pb.AttentionStatsRequest(), self._probe_timeout_s)

    async def _unary(self, method, request, timeout_s: float):
        try:
            return await method(request, timeout=timeout_s, metadata=inject_grpc_metadata())
        except grpc.aio.AioRpcError as e:
            raise AttentionError.from_rpc(e, timeout_s) from None
