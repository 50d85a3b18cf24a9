"""The handlers: one object per endpoint family, each returning an error, a response, or a stream.

A handler turns a validated request into attention-service calls (through `AttentionClient`) and
their answers into OpenAI's shapes. User and service errors come back as `ErrorResponse` values;
app.py maps the three outcomes to HTTP. Streams open before the HTTP status is sent, so a request
the attention service rejects (prompt too long, queue full) gets its 4xx instead of a broken 200.
A request is admitted whole before any call (admission.py), and a failed request logs one line.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field

from pydantic import BaseModel

from splitmoe.gateway.admission import Admission, Refused, Ticket
from splitmoe.gateway.attention_client import AttentionClient, AttentionError
from splitmoe.gateway.attention_types import GenerateChunk, GenerateParams, ModelInfo, ScoreResult, TokenLogprob, TopLogprob
from splitmoe.gateway.metrics import GatewayMetrics, RequestTimer
from splitmoe.gateway.openai_types import (
    ChatChoiceLogprobs, ChatCompletionChoice, ChatCompletionChunk, ChatCompletionLogProb, ChatCompletionLogProbsContent,
    ChatCompletionRequest, ChatCompletionResponse, ChatCompletionStreamChoice, ChatResponseMessage, CompletionChoice,
    CompletionLogprobs, CompletionRequest, CompletionResponse, DeltaMessage, ErrorResponse, ModelCard, ModelList,
    UsageInfo, error_response,
)

log = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"
MIN_LOGPROB = -9999.0  # -inf is not JSON; vLLM clamps to the same value


# ------------------------------------------------------------------------------- stream plumbing

@dataclass(slots=True)
class ChoiceState:
    """What one choice (one Generate call) has produced so far."""
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tokens: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, chunk: GenerateChunk) -> None:
        self.text.append(chunk.text)
        self.reasoning.append(chunk.reasoning_text)
        self.tokens.extend(chunk.tokens)
        if chunk.finish_reason:
            self.finish_reason = chunk.finish_reason
        if chunk.usage is not None:
            self.prompt_tokens = chunk.usage.prompt_tokens
            self.completion_tokens = chunk.usage.completion_tokens


class OpenStream:
    """A Generate stream whose first message has arrived; `aclose` cancels the call at any point."""

    def __init__(self, first: GenerateChunk, rest: AsyncIterator[GenerateChunk]) -> None:
        self._first: GenerateChunk | None = first
        self._rest = rest

    def __aiter__(self) -> "OpenStream":
        return self

    async def __anext__(self) -> GenerateChunk:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await anext(self._rest)

    async def aclose(self) -> None:
        await self._rest.aclose()


async def _open(stream: AsyncIterator[GenerateChunk]) -> OpenStream:
    """Wait for the stream's first message, so that a rejected request fails here."""
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        raise AttentionError(500, "the attention service ended a generation without a message") from None
    except BaseException:
        await stream.aclose()
        raise
    return OpenStream(first, stream)


async def _holding(stream: AsyncIterator[GenerateChunk], ticket: Ticket) -> AsyncIterator[GenerateChunk]:
    """`stream`, giving its admission slot back when it ends: finished, failed, closed, or finalized
    after its consumer dropped it."""
    try:
        async for chunk in stream:
            yield chunk
    finally:
        ticket.release()
        await stream.aclose()  # cancels the call if it is still running


async def open_streams(client: AttentionClient, admission: Admission,
                       calls: Sequence[GenerateParams]) -> list[OpenStream]:
    """Admit the calls (Refused: 429), then start them all at once; if any is rejected, cancel the
    others and raise its error."""
    ticket = admission.admit(len(calls))
    try:
        opened = await asyncio.gather(*(_open(_holding(client.generate(c), ticket)) for c in calls),
                                      return_exceptions=True)
    except BaseException:  # cancelled (the client left): calls that never started hold slots too
        ticket.release_all()
        raise
    errors = [e for e in opened if isinstance(e, BaseException)]
    if errors:
        await asyncio.gather(*(s.aclose() for s in opened if isinstance(s, OpenStream)), return_exceptions=True)
        ticket.release_all()
        raise next((e for e in errors if isinstance(e, AttentionError)), errors[0])
    return opened


async def merge(streams: Sequence[OpenStream]) -> AsyncIterator[tuple[int, GenerateChunk]]:
    """(index, message) from all streams as they arrive; closing the merge cancels every stream."""
    try:
        if len(streams) == 1:  # the common case needs no tasks
            async for item in streams[0]:
                yield 0, item
        elif streams:
            async with aclosing(_merge_tasks(streams)) as entries:
                async for entry in entries:
                    yield entry
    finally:
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)


async def _merge_tasks(streams: Sequence[OpenStream]) -> AsyncIterator[tuple[int, GenerateChunk]]:
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: OpenStream) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item))
            queue.put_nowait((i, done))
        except Exception as e:  # handed to the consumer, which raises it
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        for _ in range(len(tasks)):
            while (entry := await queue.get())[1] is not done:
                if isinstance(entry[1], Exception):
                    raise entry[1]
                yield entry
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def choice_events(streams: Sequence[OpenStream], states: list[ChoiceState],
                        timer: RequestTimer) -> AsyncIterator[tuple[int, GenerateChunk]]:
    """Every choice's messages as they arrive, recorded in `states` and timed."""
    async with aclosing(merge(streams)) as events:
        async for i, chunk in events:
            timer.on_message(i, len(chunk.tokens))
            states[i].add(chunk)
            yield i, chunk


async def drain(events: AsyncIterator) -> None:
    async with aclosing(events):
        async for _ in events:
            pass


def sse_line(payload: BaseModel, exclude: set[str] | None = None) -> str:
    return f"data: {payload.model_dump_json(exclude=exclude)}\n\n"


async def sse_stream(chunks: AsyncIterator[BaseModel], include_usage: bool, request_id: str) -> AsyncIterator[str]:
    """OpenAI's SSE framing: `data: {chunk}` lines, an error as one more chunk, then [DONE]."""
    exclude = None if include_usage else {"usage"}  # OpenAI sends "usage": null only when asked for usage
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                yield sse_line(chunk, exclude)
    except AttentionError as e:
        yield sse_line(failed(request_id, e))
    except Exception:
        log.exception("%s: stream failed", request_id)
        yield sse_line(with_request_id(error_response(500, "internal error in the gateway"), request_id))
    yield SSE_DONE


def failed(request_id: str, e: AttentionError) -> ErrorResponse:
    """The error the client gets, and the request's one log line about it, with what only the log may
    say (gRPC status and details, internal addresses)."""
    level = logging.ERROR if e.status == 500 else logging.WARNING if e.status >= 429 else logging.INFO
    log.log(level, "%s: %d %s", request_id, e.status, e.detail)
    return with_request_id(error_response(e.status, e.message, code=e.code), request_id)


def with_request_id(error: ErrorResponse, request_id: str) -> ErrorResponse:
    error.error.request_id = request_id
    return error


def total_usage(states: Sequence[ChoiceState], n: int) -> UsageInfo:
    """Usage over all choices; the n choices of one prompt share (and count once) its prompt tokens."""
    prompt_tokens = sum(states[i].prompt_tokens for i in range(0, len(states), n))
    return UsageInfo.of(prompt_tokens, sum(s.completion_tokens for s in states))


def finish(timer: RequestTimer, usage: UsageInfo, states: Sequence[ChoiceState]) -> None:
    timer.finish(usage.prompt_tokens, usage.completion_tokens, (s.finish_reason for s in states))


# -------------------------------------------------------------------------------------- logprobs

def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def token_str(t: TokenLogprob | TopLogprob) -> str:
    """The token as OpenAI spells it: its text, or `bytes:\\xNN` when it holds part of a character."""
    try:
        return t.token_bytes.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in t.token_bytes)


def chat_logprobs(tokens: Sequence[TokenLogprob], top_n: int) -> ChatChoiceLogprobs:
    def top(t: TokenLogprob) -> list[ChatCompletionLogProb]:
        return [ChatCompletionLogProb(token=token_str(c), logprob=_logprob(c.logprob), bytes=list(c.token_bytes))
                for c in t.top[:top_n]]
    return ChatChoiceLogprobs(content=[
        ChatCompletionLogProbsContent(token=token_str(t), logprob=_logprob(t.logprob), bytes=list(t.token_bytes),
                                      top_logprobs=top(t))
        for t in tokens])


def completion_logprobs(tokens: Sequence[TokenLogprob], top_n: int, text_offset: int,
                        first_unscored: bool = False) -> CompletionLogprobs:
    """The legacy format. `first_unscored`: tokens[0] opens a prompt, so nothing predicts it."""
    out = CompletionLogprobs()
    for i, t in enumerate(tokens):
        out.tokens.append(token_str(t))
        out.text_offset.append(text_offset)
        text_offset += len(t.token)
        if i == 0 and first_unscored:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_logprob(t.logprob))
        top = {token_str(c): _logprob(c.logprob) for c in t.top[:top_n]}
        top.setdefault(token_str(t), _logprob(t.logprob))  # the sampled token, as vLLM includes it
        out.top_logprobs.append(top)
    return out


def join_logprobs(a: CompletionLogprobs | None, b: CompletionLogprobs) -> CompletionLogprobs:
    if a is None:
        return b
    return CompletionLogprobs(text_offset=a.text_offset + b.text_offset, token_logprobs=a.token_logprobs + b.token_logprobs,
                              tokens=a.tokens + b.tokens, top_logprobs=a.top_logprobs + b.top_logprobs)


def text_length(tokens: Sequence[TokenLogprob]) -> int:
    return sum(len(t.token) for t in tokens)


# ----------------------------------------------------------------------------------------- models

class ServedModel:
    """The one model behind this gateway: its public name, and ModelInfo cached once ready."""

    def __init__(self, client: AttentionClient, served_name: str | None) -> None:
        self._client = client
        self._served_name = served_name
        self._ready_info: ModelInfo | None = None
        self.created = int(time.time())

    async def info(self) -> ModelInfo:
        if self._ready_info is not None:
            return self._ready_info
        info = await self._client.model_info()
        if info.ready:  # id and context length never change once loaded
            self._ready_info = info
        return info

    async def name(self) -> str:
        if self._served_name:
            return self._served_name
        info = await self.info()
        if not info.model_id:
            raise AttentionError(503, "the model is still loading", "unavailable")
        return info.model_id

    async def resolve(self, requested: str | None) -> str | ErrorResponse:
        """The served name, or 404 when the request names another model (None means ours); raises
        AttentionError while the attention service is down or loading."""
        name = await self.name()
        if requested is not None and requested != name:
            shown = requested if len(requested) <= 100 else requested[:100] + "..."
            return error_response(404, f"The model `{shown}` does not exist.", code="model_not_found", param="model")
        return name

    async def list(self, request_id: str) -> ModelList | ErrorResponse:
        try:
            name, info = await self.name(), await self.info()
        except AttentionError as e:
            return failed(request_id, e)
        card = ModelCard(id=name, created=self.created, max_model_len=info.context_tokens or None)
        return ModelList(data=[card])


class Handler:
    def __init__(self, client: AttentionClient, model: ServedModel, metrics: GatewayMetrics,
                 admission: Admission) -> None:
        self.client = client
        self.model = model
        self.metrics = metrics
        self.admission = admission


# ------------------------------------------------------------------------------------------- chat

class ChatHandler(Handler):
    """POST /v1/chat/completions."""

    async def create(self, request: ChatCompletionRequest, request_id: str
                     ) -> ErrorResponse | ChatCompletionResponse | AsyncIterator[str]:
        try:
            model = await self.model.resolve(request.model)
            if isinstance(model, ErrorResponse):
                return model
            timer = self.metrics.request_timer()
            self.admission.check(request.num_generations)
            streams = await open_streams(self.client, self.admission, request.to_generate_params(request_id))
            states = [ChoiceState() for _ in streams]
            if request.stream:
                chunks = self._chunks(request, request_id, model, choice_events(streams, states, timer), states, timer)
                return sse_stream(chunks, request.include_usage, request_id)
            await drain(choice_events(streams, states, timer))
        except Refused as e:
            return e.error
        except AttentionError as e:
            return failed(request_id, e)
        usage = total_usage(states, request.n)
        finish(timer, usage, states)
        return self._response(request, request_id, model, states, usage)

    def _response(self, request: ChatCompletionRequest, request_id: str, model: str,
                  states: list[ChoiceState], usage: UsageInfo) -> ChatCompletionResponse:
        choices = [ChatCompletionChoice(
            index=i, finish_reason=s.finish_reason,
            message=ChatResponseMessage(content="".join(s.text), reasoning_content="".join(s.reasoning) or None),
            logprobs=chat_logprobs(s.tokens, request.top_logprobs or 0) if request.logprobs else None)
            for i, s in enumerate(states)]
        return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage)

    async def _chunks(self, request: ChatCompletionRequest, request_id: str, model: str, events: AsyncIterator,
                      states: list[ChoiceState], timer: RequestTimer) -> AsyncIterator[ChatCompletionChunk]:
        created = int(time.time())

        def chunk(choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices, usage=usage)

        async with aclosing(events):  # closed however the stream ends: this cancels the calls
            for i in range(len(states)):  # the first delta of each choice carries the role
                yield chunk([ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
            async for i, message in events:
                for choice in self._stream_choices(request, i, message):
                    yield chunk([choice])
        usage = total_usage(states, request.n)
        finish(timer, usage, states)
        if request.include_usage:
            yield chunk([], usage)

    @staticmethod
    def _stream_choices(request: ChatCompletionRequest, i: int,
                        message: GenerateChunk) -> list[ChatCompletionStreamChoice]:
        """A content delta (when there is new text or logprobs), then the finish as its own delta."""
        choices = []
        logprobs = chat_logprobs(message.tokens, request.top_logprobs or 0) if request.logprobs else None
        if message.text or message.reasoning_text or (logprobs is not None and logprobs.content):
            delta = DeltaMessage(content=message.text if message.text or not message.reasoning_text else None,
                                 reasoning_content=message.reasoning_text or None)
            choices.append(ChatCompletionStreamChoice(index=i, delta=delta, logprobs=logprobs))
        if message.finish_reason:
            choices.append(ChatCompletionStreamChoice(index=i, delta=DeltaMessage(),
                                                      finish_reason=message.finish_reason))
        return choices


# ------------------------------------------------------------------------------------ completions

@dataclass(frozen=True, slots=True)
class PromptEcho:
    """One prompt as echoed back: its text, its logprobs (when asked) and its length in tokens."""
    text: str
    logprobs: CompletionLogprobs | None
    prompt_tokens: int


class CompletionHandler(Handler):
    """POST /v1/completions, including scoring: echo + logprobs (+ max_tokens 0) via Score."""

    async def create(self, request: CompletionRequest, request_id: str
                     ) -> ErrorResponse | CompletionResponse | AsyncIterator[str]:
        try:
            model = await self.model.resolve(request.model)
            if isinstance(model, ErrorResponse):
                return model
            timer = self.metrics.request_timer()
            self.admission.check(request.num_generations)
            echoes = await self._echoes(request, request_id)
            states = [ChoiceState() for _ in range(len(request.prompts()) * request.n)]
            if request.max_tokens == 0:  # scoring only: nothing to generate
                streams = []
                for i, state in enumerate(states):
                    state.finish_reason, state.prompt_tokens = "length", echoes[i // request.n].prompt_tokens
            else:
                streams = await open_streams(self.client, self.admission, request.to_generate_params(request_id))
            events = choice_events(streams, states, timer)
            if request.stream:
                chunks = self._chunks(request, request_id, model, events, states, echoes, timer)
                return sse_stream(chunks, request.include_usage, request_id)
            await drain(events)
        except Refused as e:
            return e.error
        except AttentionError as e:
            return failed(request_id, e)
        usage = total_usage(states, request.n)
        finish(timer, usage, states)
        return self._response(request, request_id, model, states, echoes, usage)

    async def _echoes(self, request: CompletionRequest, request_id: str) -> list[PromptEcho] | None:
        """Each prompt's echo, scored by the attention service where its text or logprobs are needed."""
        prompts = request.prompts()
        if not request.needs_prompt_scores:
            return [PromptEcho(p, None, 0) for p in prompts] if request.echo else None
        scores = await asyncio.gather(*(self.client.score(s) for s in request.to_score_params(request_id)))
        return [self._echo(request, p, s) for p, s in zip(prompts, scores)]

    @staticmethod
    def _echo(request: CompletionRequest, prompt: str | list[int], score: ScoreResult) -> PromptEcho:
        text = prompt if isinstance(prompt, str) else score.text
        logprobs = None
        if request.echo and request.logprobs is not None:
            logprobs = completion_logprobs(score.tokens, request.logprobs, 0, first_unscored=True)
        return PromptEcho(text, logprobs, score.prompt_tokens)

    def _response(self, request: CompletionRequest, request_id: str, model: str, states: list[ChoiceState],
                  echoes: list[PromptEcho] | None, usage: UsageInfo) -> CompletionResponse:
        choices = []
        for i, state in enumerate(states):
            echo = echoes[i // request.n] if request.echo else None
            text = (echo.text if echo else "") + "".join(state.text)
            logprobs = None
            if request.logprobs is not None:
                offset = len(echo.text) if echo else 0
                logprobs = join_logprobs(echo.logprobs if echo else None,
                                         completion_logprobs(state.tokens, request.logprobs, offset))
            choices.append(CompletionChoice(index=i, text=text, logprobs=logprobs, finish_reason=state.finish_reason))
        return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)

    async def _chunks(self, request: CompletionRequest, request_id: str, model: str, events: AsyncIterator,
                      states: list[ChoiceState], echoes: list[PromptEcho] | None,
                      timer: RequestTimer) -> AsyncIterator[CompletionResponse]:
        created = int(time.time())

        def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> CompletionResponse:
            return CompletionResponse(id=request_id, created=created, model=model, choices=choices, usage=usage)

        offsets = [0] * len(states)  # each choice's text_offset so far
        async with aclosing(events):  # closed however the stream ends: this cancels the calls
            for i, state in enumerate(states):
                echo = echoes[i // request.n] if request.echo else None
                if echo is not None or state.finish_reason:  # the echoed prompt opens the choice, as in vLLM
                    offsets[i] = len(echo.text) if echo else 0
                    yield chunk([CompletionChoice(index=i, text=echo.text if echo else "",
                                                  logprobs=echo.logprobs if echo else None,
                                                  finish_reason=state.finish_reason)])  # set when max_tokens is 0
            async for i, message in events:
                logprobs = None
                if request.logprobs is not None:
                    logprobs = completion_logprobs(message.tokens, request.logprobs, offsets[i])
                    offsets[i] += text_length(message.tokens)
                yield chunk([CompletionChoice(index=i, text=message.text, logprobs=logprobs,
                                              finish_reason=message.finish_reason)])
        usage = total_usage(states, request.n)
        finish(timer, usage, states)
        if request.include_usage:
            yield chunk([], usage)


# ------------------------------------------------------------------------------- health, metrics

class OpsHandler(Handler):
    """GET /health (503 while the model loads or an expert service is down) and GET /metrics."""

    async def health(self) -> ErrorResponse | dict:
        try:
            info = await self.model.info()
            if not info.ready:
                return error_response(503, "the model is still loading", code="loading")
            stats = await self.client.stats()
        except AttentionError as e:  # not logged: probes come every few seconds
            return error_response(503, f"attention service unavailable: {e.message}", code="unavailable")
        down = sum(not hop.healthy for hop in stats.hops)
        if down:  # which ones: /metrics, behind the API key (addresses are internal)
            return error_response(503, f"{down} of {len(stats.hops)} expert services unhealthy",
                                  code="expert_unhealthy")
        return {"status": "ok"}

    async def metrics_text(self) -> bytes:
        try:
            stats = await self.client.stats()
        except AttentionError:
            stats = None  # still expose the gateway's own metrics; attention_service_up reads 0
        return self.metrics.render(stats)
