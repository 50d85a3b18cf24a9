"""POST /v1/chat/completions: one Generate call per choice."""
from __future__ import annotations

from collections.abc import Iterable

from splitmoe.gateway.attention_types import GenerateChunk
from splitmoe.gateway.handlers.base import Generation, GenerationHandler
from splitmoe.gateway.handlers.models import Served
from splitmoe.gateway.logprobs import chat_logprobs
from splitmoe.gateway.metrics import RequestTimer
from splitmoe.gateway.openai_types import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatResponseMessage,
    DeltaMessage,
    UsageInfo,
)
from splitmoe.gateway.streams import ChoiceState, open_streams
from splitmoe.gateway.tool_calls import delta_tool_calls, message_tool_calls


class ChatHandler(GenerationHandler):
    """POST /v1/chat/completions."""
    chunk_type = ChatCompletionChunk

    async def _start(self, request: ChatCompletionRequest, request_id: str, served: Served,
                     timer: RequestTimer) -> Generation:
        params = request.to_generate_params(request_id, served.lora_name)
        streams = await open_streams(self.client, self.admission, params)
        return Generation(request, request_id, served.name, timer, [ChoiceState() for _ in streams], streams)

    def _response(self, gen: Generation, usage: UsageInfo) -> ChatCompletionResponse:
        request = gen.request
        choices = [ChatCompletionChoice(
            index=i, finish_reason=s.finish_reason, message=_message(s),
            logprobs=chat_logprobs(s.tokens, request.top_logprobs or 0) if request.logprobs else None)
            for i, s in enumerate(gen.states)]
        return ChatCompletionResponse(id=gen.request_id, model=gen.model, choices=choices, usage=usage)

    def _opening_choices(self, gen: Generation) -> Iterable[ChatCompletionStreamChoice]:
        """The first delta of each choice carries the role."""
        return [ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                for i in range(len(gen.states))]

    def _stream_choices(self, gen: Generation, i: int, message: GenerateChunk) -> list[ChatCompletionStreamChoice]:
        """A content delta (when there is new text or logprobs), then the finish as its own delta."""
        request = gen.request
        choices = []
        logprobs = chat_logprobs(message.tokens, request.top_logprobs or 0) if request.logprobs else None
        if message.text or message.reasoning_text or message.tool_calls or (logprobs is not None and logprobs.content):
            only_other = message.reasoning_text or message.tool_calls
            delta = DeltaMessage(content=message.text if message.text or not only_other else None,
                                 reasoning_content=message.reasoning_text or None,
                                 tool_calls=delta_tool_calls(message.tool_calls))
            choices.append(ChatCompletionStreamChoice(index=i, delta=delta, logprobs=logprobs))
        if message.finish_reason:
            choices.append(ChatCompletionStreamChoice(index=i, delta=DeltaMessage(),
                                                      finish_reason=message.finish_reason))
        return choices


def _message(state: ChoiceState) -> ChatResponseMessage:
    """The whole reply; with calls and no text, `content` is null, as OpenAI sends it."""
    calls = message_tool_calls(state.tool_calls)
    content = "".join(state.text)
    return ChatResponseMessage(content=content or (None if calls else ""), tool_calls=calls,
                               reasoning_content="".join(state.reasoning) or None)
