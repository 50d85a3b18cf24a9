"""POST /v1/completions: one Generate call per prompt and choice, and a Score call per prompt to echo it."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field

from splitmoe.gateway.attention_types import GenerateChunk, ScoreResult
from splitmoe.gateway.handlers.base import Generation, GenerationHandler
from splitmoe.gateway.handlers.models import Served
from splitmoe.gateway.logprobs import completion_logprobs, join_logprobs, text_length
from splitmoe.gateway.metrics import RequestTimer
from splitmoe.gateway.openai_types import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from splitmoe.gateway.streams import ChoiceState, open_streams


@dataclass(frozen=True, slots=True)
class PromptEcho:
    """One prompt as echoed back: its text, its logprobs (when asked) and its length in tokens."""
    text: str
    logprobs: CompletionLogprobs | None
    prompt_tokens: int


@dataclass(slots=True)
class Completion(Generation):
    echoes: list[PromptEcho] | None = None     # one per prompt, when the request echoes or scores them
    offsets: list[int] = field(default_factory=list)  # each choice's text_offset so far, streamed

    def echo(self, choice: int) -> PromptEcho | None:
        return self.echoes[choice // self.request.n] if self.request.echo else None


class CompletionHandler(GenerationHandler):
    """POST /v1/completions, including scoring: echo + logprobs (+ max_tokens 0) via Score."""
    chunk_type = CompletionResponse  # OpenAI uses one shape for both

    async def _start(self, request: CompletionRequest, request_id: str, served: Served,
                     timer: RequestTimer) -> Completion:
        echoes = await self._echoes(request, request_id, served.lora_name)
        states = [ChoiceState() for _ in range(len(request.prompts()) * request.n)]
        if request.max_tokens == 0:  # scoring only: nothing to generate
            streams = []
            for i, state in enumerate(states):
                state.finish_reason, state.prompt_tokens = "length", echoes[i // request.n].prompt_tokens
        else:
            params = request.to_generate_params(request_id, served.lora_name)
            streams = await open_streams(self.client, self.admission, params)
        return Completion(request, request_id, served.name, timer, states, streams, echoes, [0] * len(states))

    async def _echoes(self, request: CompletionRequest, request_id: str, lora_name: str) -> list[PromptEcho] | None:
        """Each prompt's echo, scored by the attention service where its text or logprobs are needed."""
        prompts = request.prompts()
        if not request.needs_prompt_scores:
            return [PromptEcho(p, None, 0) for p in prompts] if request.echo else None
        calls = request.to_score_params(request_id, lora_name)
        scores = await asyncio.gather(*(self.client.score(s) for s in calls))
        return [self._echo(request, p, s) for p, s in zip(prompts, scores)]

    @staticmethod
    def _echo(request: CompletionRequest, prompt: str | list[int], score: ScoreResult) -> PromptEcho:
        text = prompt if isinstance(prompt, str) else score.text
        logprobs = None
        if request.echo and request.logprobs is not None:
            logprobs = completion_logprobs(score.tokens, request.logprobs, 0, first_unscored=True)
        return PromptEcho(text, logprobs, score.prompt_tokens)

    def _response(self, gen: Completion, usage: UsageInfo) -> CompletionResponse:
        choices = []
        for i, state in enumerate(gen.states):
            echo = gen.echo(i)
            text = (echo.text if echo else "") + "".join(state.text)
            logprobs = None
            if gen.request.logprobs is not None:
                offset = len(echo.text) if echo else 0
                logprobs = join_logprobs(echo.logprobs if echo else None,
                                         completion_logprobs(state.tokens, gen.request.logprobs, offset))
            choices.append(CompletionChoice(index=i, text=text, logprobs=logprobs, finish_reason=state.finish_reason))
        return CompletionResponse(id=gen.request_id, model=gen.model, choices=choices, usage=usage)

    def _opening_choices(self, gen: Completion) -> Iterator[CompletionChoice]:
        """The echoed prompt opens its choices, as in vLLM; with max_tokens 0 it is all they hold."""
        for i, state in enumerate(gen.states):
            echo = gen.echo(i)
            if echo is not None or state.finish_reason:
                gen.offsets[i] = len(echo.text) if echo else 0
                yield CompletionChoice(index=i, text=echo.text if echo else "",
                                       logprobs=echo.logprobs if echo else None, finish_reason=state.finish_reason)

    def _stream_choices(self, gen: Completion, i: int, message: GenerateChunk) -> list[CompletionChoice]:
        logprobs = None
        if gen.request.logprobs is not None:
            logprobs = completion_logprobs(message.tokens, gen.request.logprobs, gen.offsets[i])
            gen.offsets[i] += text_length(message.tokens)
        return [CompletionChoice(index=i, text=message.text, logprobs=logprobs, finish_reason=message.finish_reason)]
