"""What the handlers share: what they work with, and the one flow of the generation endpoints."""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable
from contextlib import aclosing
from dataclasses import dataclass

from pydantic import BaseModel

from splitmoe.gateway.admission import Admission, Refused
from splitmoe.gateway.attention_client import AttentionClient, AttentionError
from splitmoe.gateway.attention_types import GenerateChunk
from splitmoe.gateway.failures import failed
from splitmoe.gateway.handlers.models import Served, ServedModel
from splitmoe.gateway.metrics import GatewayMetrics, RequestTimer
from splitmoe.gateway.openai_types import ErrorResponse, SamplingRequest, UsageInfo
from splitmoe.gateway.sse import sse_stream
from splitmoe.gateway.streams import ChoiceState, OpenStream, choice_events, drain, total_usage


class Handler:
    def __init__(self, client: AttentionClient, model: ServedModel, metrics: GatewayMetrics,
                 admission: Admission) -> None:
        self.client = client
        self.model = model
        self.metrics = metrics
        self.admission = admission


@dataclass(slots=True)
class Generation:
    """One request's choices under way: what its response, or its chunks, are made of."""
    request: SamplingRequest
    request_id: str
    model: str
    timer: RequestTimer
    states: list[ChoiceState]
    streams: list[OpenStream]

    def finish(self) -> UsageInfo:
        """The usage over all choices, counted in the metrics once the last message is in."""
        usage = total_usage(self.states, self.request.n)
        self.timer.finish(usage.prompt_tokens, usage.completion_tokens, (s.finish_reason for s in self.states))
        return usage


class GenerationHandler(Handler, ABC):
    """Chat and completions: the model resolved, the request admitted whole, its calls started, then one
    response once every choice has finished, or chunks as messages arrive. Subclasses say how the calls
    start and what OpenAI's shapes of the endpoint hold."""
    chunk_type: type[BaseModel]  # built from id, created, model, choices and usage

    async def create(self, request: SamplingRequest, request_id: str
                     ) -> ErrorResponse | BaseModel | AsyncIterator[str]:
        served = None
        try:
            served = await self.model.resolve(request.model)
            if isinstance(served, ErrorResponse):
                return served
            timer = self.metrics.request_timer()
            self.admission.check(request.num_generations)
            gen = await self._start(request, request_id, served, timer)
            events = choice_events(gen.streams, gen.states, timer)
            if request.stream:
                return sse_stream(self._chunks(gen, events), request.include_usage, request_id)
            await drain(events)
        except Refused as e:
            return e.error
        except AttentionError as e:
            if e.status == 400 and isinstance(served, Served) and served.lora_name:
                return await self._adapter_refused(served, request_id, e)
            return failed(request_id, e)
        return self._response(gen, gen.finish())

    async def _adapter_refused(self, served: Served, request_id: str, e: AttentionError) -> ErrorResponse:
        """A 400 for a request on an adapter: unloaded since it was resolved (OpenAI's 404, as for any
        unknown model), or a 400 of its own."""
        self.model.forget_adapters()
        try:
            again = await self.model.resolve(served.name)
        except AttentionError:
            again = None
        return again if isinstance(again, ErrorResponse) else failed(request_id, e)

    async def _chunks(self, gen: Generation, events: AsyncIterator[tuple[int, GenerateChunk]]
                      ) -> AsyncIterator[BaseModel]:
        created = int(time.time())

        def chunk(choices: list[BaseModel], usage: UsageInfo | None = None) -> BaseModel:
            return self.chunk_type(id=gen.request_id, created=created, model=gen.model, choices=choices, usage=usage)

        async with aclosing(events):  # closed however the stream ends: this cancels the calls
            for choice in self._opening_choices(gen):
                yield chunk([choice])
            async for i, message in events:
                for choice in self._stream_choices(gen, i, message):
                    yield chunk([choice])
        usage = gen.finish()
        if gen.request.include_usage:
            yield chunk([], usage)

    @abstractmethod
    async def _start(self, request: SamplingRequest, request_id: str, served: Served, timer: RequestTimer) -> Generation:
        """The request's calls started (or answered without any), with the adapter `served` names."""

    @abstractmethod
    def _response(self, gen: Generation, usage: UsageInfo) -> BaseModel:
        """The whole response, once every choice has finished."""

    @abstractmethod
    def _opening_choices(self, gen: Generation) -> Iterable[BaseModel]:
        """The stream's first chunks' choices, before any message."""

    @abstractmethod
    def _stream_choices(self, gen: Generation, i: int, message: GenerateChunk) -> Iterable[BaseModel]:
        """The chunks' choices for choice i's next message."""
