"""The gateway's one gRPC client: the AttentionService stub behind deadlines and one error type.

Every call carries a deadline from settings and the current trace context; every gRPC failure
becomes an `AttentionError` that already knows its HTTP status, so handlers never see grpc types.
This is the gateway's only protobuf module: calls take and return attention_types' values, and the
functions at the end convert them to messages and back, field by field of the same name.
"""
from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator
from dataclasses import fields
from typing import TypeVar

import grpc

from splitmoe.gateway.attention_types import (
    AttentionStats,
    DeviceMemory,
    ExpertHeat,
    ExpertTokens,
    GenerateChunk,
    GenerateParams,
    HopStats,
    LoraAdapter,
    ModelInfo,
    Prompt,
    ScoreParams,
    ScoreResult,
    StructuredOutput,
    TokenizeParams,
    TokenizeResult,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from splitmoe.gateway.settings import GatewaySettings
from splitmoe.proto import attention_pb2 as pb
from splitmoe.proto.attention_pb2_grpc import AttentionServiceStub
from splitmoe.runtime.telemetry import inject_grpc_metadata

A = TypeVar("A")

# The attention service's status codes, as the HTTP status the gateway answers with; any other is a 500.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,   # its queue is full
    grpc.StatusCode.UNAVAILABLE: 503,          # loading, or expert services down
    grpc.StatusCode.CANCELLED: 503,            # shed by the server under load, or it is shutting down
    grpc.StatusCode.ABORTED: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
# Statuses whose details are the attention service's words about the request itself: the client sees
# them. Others may name internal addresses (an expert service's, the attention service's own): logs only.
USER_FACING = frozenset({400, 404, 429})
UNAVAILABLE_MESSAGE = ("the model is unavailable for now (its attention service or an expert service is down, "
                       "loading or overloaded); retry later")
# Message sizes: a Score answer with 20 top logprobs per prompt token is a few MiB at 128k tokens.
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    # gRPC backs off up to 120 s between reconnects; an attention service that (re)starts should be
    # found within a second, not minutes later. Retrying one loopback or LAN address is cheap.
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1_000),
)


class AttentionError(Exception):
    """A failed attention-service call: the HTTP status, a message fit for the client, and what
    happened in full (`detail`), which goes to the log only."""

    def __init__(self, status: int, message: str, code: str | None = None, detail: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.detail = detail or message

    @classmethod
    def from_rpc(cls, error: grpc.aio.AioRpcError, timeout_s: float) -> "AttentionError":
        status = HTTP_STATUS.get(error.code(), 500)
        code = error.code().name.lower()
        detail = f"{error.code().name}: {error.details()}"
        if status in USER_FACING:
            return cls(status, error.details() or error.code().name, code, detail)
        if status == 503:
            return cls(503, UNAVAILABLE_MESSAGE, code, detail)
        if status == 504:
            return cls(504, f"the attention service did not finish within {timeout_s:g} s", code, detail)
        return cls(500, "internal error in the attention service", code, detail)


class AttentionClient:
    """One channel to the attention service; open it inside the event loop that will use it."""

    def __init__(self, settings: GatewaySettings) -> None:
        self._request_timeout_s = settings.request_timeout_s
        self._probe_timeout_s = settings.probe_timeout_s
        self._channel = settings.cluster.aio_channel(settings.attention_address, CHANNEL_OPTIONS)
        self._stub = AttentionServiceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def generate(self, params: GenerateParams) -> AsyncIterator[GenerateChunk]:
        """The response stream; closing it early (or cancelling its task) cancels the call."""
        call = self._stub.Generate(generate_request(params), timeout=self._request_timeout_s,
                                   metadata=inject_grpc_metadata())
        try:
            async for response in call:
                yield chunk_of(response)
        except grpc.aio.AioRpcError as e:
            raise AttentionError.from_rpc(e, self._request_timeout_s) from None
        finally:
            call.cancel()  # a no-op once the stream ended; otherwise it aborts the generation

    async def score(self, params: ScoreParams) -> ScoreResult:
        return score_result_of(await self._unary(self._stub.Score, score_request(params), self._request_timeout_s))

    async def tokenize(self, params: TokenizeParams) -> TokenizeResult:
        response = await self._unary(self._stub.Tokenize, tokenize_request(params), self._request_timeout_s)
        return _answer(TokenizeResult, response, ids=tuple(response.ids), token_strs=tuple(response.token_strs))

    async def detokenize(self, ids: list[int]) -> str:
        response = await self._unary(self._stub.Detokenize, pb.DetokenizeRequest(ids=ids), self._request_timeout_s)
        return response.text

    async def model_info(self) -> ModelInfo:
        return model_info_of(await self._unary(self._stub.ModelInfo, pb.ModelInfoRequest(), self._probe_timeout_s))

    async def load_lora_adapter(self, name: str, path: str) -> str:
        """The attention service's words on the loaded adapter. Reading (and, on a GPU, uploading) the
        file takes a request's deadline, not a probe's."""
        request = pb.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
        return (await self._adapter_call(self._stub.LoadLoraAdapter, request)).message

    async def unload_lora_adapter(self, name: str) -> str:
        request = pb.UnloadLoraAdapterRequest(lora_name=name)
        return (await self._adapter_call(self._stub.UnloadLoraAdapter, request)).message

    async def _adapter_call(self, method, request) -> pb.LoraAdapterResponse:
        """RESOURCE_EXHAUSTED here says every adapter slot (--max-loras) is taken: the client's to free
        by an unload, so a 400, not the 429 of a full queue, which a retry would get past."""
        try:
            return await self._unary(method, request, self._request_timeout_s)
        except AttentionError as e:
            if e.status == 429:
                raise AttentionError(400, e.message, e.code, e.detail) from None
            raise

    async def stats(self, timeout_s: float | None = None) -> AttentionStats:
        """`timeout_s`: the probe deadline unless given (/health's own is shorter)."""
        stats = await self._unary(self._stub.GetStats, pb.AttentionStatsRequest(), timeout_s or self._probe_timeout_s)
        return stats_of(stats)

    async def _unary(self, method, request, timeout_s: float):
        try:
            return await method(request, timeout=timeout_s, metadata=inject_grpc_metadata())
        except grpc.aio.AioRpcError as e:
            raise AttentionError.from_rpc(e, timeout_s) from None


# ------------------------------------------------------------------------ dataclasses <-> messages

_TOOL_MODES = {"auto": pb.ToolCalling.AUTO, "named": pb.ToolCalling.NAMED, "required": pb.ToolCalling.REQUIRED}


def generate_request(params: GenerateParams) -> pb.GenerateRequest:
    tools = params.tool_calling
    tool_calling = pb.ToolCalling(mode=_TOOL_MODES[tools.mode], function=tools.function,
                                  single=tools.single) if tools else None
    return pb.GenerateRequest(request_id=params.request_id, sampling=pb.SamplingParams(**params.sampling),
                              reasoning_inline=params.reasoning_inline, tool_calling=tool_calling,
                              structured_output=_structured_output(params.structured_output),
                              lora_name=params.lora_name, **_prompt_field(params.prompt))


def _structured_output(output: StructuredOutput | None) -> pb.StructuredOutput | None:
    if output is None:
        return None
    return pb.StructuredOutput(kind=pb.StructuredOutput.Kind.Value(output.kind.upper()), json_schema=output.json_schema)


def score_request(params: ScoreParams) -> pb.ScoreRequest:
    return pb.ScoreRequest(request_id=params.request_id, top_logprobs=params.top_logprobs,
                           lora_name=params.lora_name, **_prompt_field(params.prompt))


def tokenize_request(params: TokenizeParams) -> pb.TokenizeRequest:
    return pb.TokenizeRequest(add_special_tokens=params.add_special_tokens, **_prompt_field(params.prompt))


def _prompt_field(prompt: Prompt) -> dict:
    """The `prompt` oneof: text, token ids or a chat."""
    if isinstance(prompt, str):
        return {"text": prompt}
    if isinstance(prompt, tuple):
        return {"token_ids": pb.TokenIds(ids=prompt)}
    messages = [pb.ChatMessage(role=m.role, content=m.content, name=m.name, tool_call_id=m.tool_call_id,
                               tool_calls=[pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments)
                                           for c in m.tool_calls])
                for m in prompt.messages]
    kwargs = json.dumps(prompt.template_kwargs) if prompt.template_kwargs else ""
    tools = json.dumps(list(prompt.tools)) if prompt.tools else ""
    return {"chat": pb.ChatPrompt(messages=messages, add_generation_prompt=prompt.add_generation_prompt,
                                  template_kwargs=kwargs, tools=tools)}


def _answer(cls: type[A], message, **differing) -> A:
    """`cls` from the message's fields of the same names; `differing`: those named or valued otherwise.
    An answer dataclass is the part of its message the gateway reads: a field added to both needs no code here."""
    return cls(**{name: getattr(message, name) for name in _field_names(cls) if name not in differing}, **differing)


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))  # cached: tokens with logprobs convert one per candidate


def chunk_of(response: pb.GenerateResponse) -> GenerateChunk:
    usage = _answer(Usage, response.usage) if response.HasField("usage") else None
    return _answer(GenerateChunk, response, tokens=_tokens_of(response.tokens),
                   finish_reason=response.finish_reason or None, usage=usage,
                   tool_calls=tuple(_answer(ToolCallDelta, c) for c in response.tool_calls))


def score_result_of(response: pb.ScoreResponse) -> ScoreResult:
    return _answer(ScoreResult, response, tokens=_tokens_of(response.tokens),
                   prompt_tokens=response.usage.prompt_tokens)


def _tokens_of(tokens) -> tuple[TokenLogprob, ...]:
    return tuple(_answer(TokenLogprob, t, top=tuple(_answer(TopLogprob, c) for c in t.top)) for t in tokens)


def model_info_of(info: pb.ModelInfoResponse) -> ModelInfo:
    return _answer(ModelInfo, info, lora_adapters=tuple(_answer(LoraAdapter, a) for a in info.lora_adapters))


def stats_of(s: pb.AttentionStats) -> AttentionStats:
    hops = tuple(_answer(HopStats, h, address=h.expert_address) for h in s.hops)
    heat = tuple(_answer(ExpertHeat, e, placed_on=tuple(e.placed_on)) for e in s.expert_heat)
    return _answer(AttentionStats, s, hops=hops, expert_tokens=tuple(_answer(ExpertTokens, e) for e in s.expert_tokens),
                   expert_heat=heat, uncovered_layers=tuple(s.uncovered_layers),
                   device_memory=tuple(_answer(DeviceMemory, m) for m in s.device_memory),
                   spec_accepted_per_position=tuple(s.spec_accepted_per_position))
