"""One generation request's state as it moves through the scheduler."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from splitmoe.attention_service.engine.grammar import Grammar
from splitmoe.attention_service.engine.reasoning import OutputText
from splitmoe.attention_service.engine.sampling import RequestSampler, Sampled, SamplingOptions
from splitmoe.attention_service.engine.speculation import DraftLength
from splitmoe.attention_service.model.sequence import Sequence

FINISH_STOP, FINISH_LENGTH, FINISH_TOOL_CALLS = "stop", "length", "tool_calls"


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one engine step produced for one request; `error` ends it unsuccessfully."""

    request_id: str
    text: str = ""  # new content: the answer, stop strings applied
    reasoning_text: str = ""  # new reasoning, when the model's format separates it
    tool_calls: tuple = ()  # tool_calls.ToolCallDelta: pieces of the reply's tool calls, when parsed
    tokens: tuple[Sampled, ...] = ()
    finish_reason: str = ""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str = ""
    error_kind: str = ""  # "unavailable" | "internal"

    @property
    def finished(self) -> bool:
        return bool(self.finish_reason or self.error)


OutputSink = Callable[[RequestOutput], None]


@dataclass(eq=False)  # identity, not field equality: two requests are never "equal"
class GenerationRequest:
    request_id: str
    seq: Sequence
    options: SamplingOptions
    sampler: RequestSampler
    detokenizer: OutputText  # tokens -> (reasoning, content) text, stop strings held back
    sink: OutputSink
    stop_ids: frozenset[int]
    max_context_tokens: int
    num_prompt_tokens: int = 0
    trace_context: Any = None  # the caller's span context: engine steps are traced under it
    grammar: Grammar | None = None  # structured output: what the tokens must match (None: free text)
    draft: list[int] = field(default_factory=list)  # tokens to verify in the next step (speculation.py)
    draft_length: DraftLength = field(default_factory=DraftLength)  # how many to draft, from its acceptance

    def __post_init__(self):
        self.num_prompt_tokens = self.seq.num_tokens

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_tokens - self.num_prompt_tokens

    def accept(self, sampled: Sampled) -> RequestOutput:
        """Take the sampled token; say what to stream and whether the request is done."""
        self.seq.token_ids.append(sampled.token_id)
        if self.grammar is not None and not self.grammar.accept(sampled.token_id):
            # The mask allowed only what the grammar accepts: this is a fault of ours, not the caller's.
            return RequestOutput(self.request_id, error=f"structured output: {self.grammar.error}",
                                 error_kind="internal", num_prompt_tokens=self.num_prompt_tokens)
        delta = self.detokenizer.add(sampled.token_id)
        finish = self._finish_reason(sampled.token_id)
        if finish:
            delta += self.detokenizer.flush()
        if finish == FINISH_STOP and self.detokenizer.has_tool_calls:
            finish = FINISH_TOOL_CALLS  # OpenAI's reason when a reply ends in calls
        return RequestOutput(self.request_id, delta.content, delta.reasoning, delta.tool_calls,
                             (sampled,) if self.options.logprobs else (), finish,
                             self.num_prompt_tokens, self.num_output_tokens)

    def _finish_reason(self, token_id: int) -> str:
        if self.detokenizer.stopped:
            return FINISH_STOP
        if token_id in self.options.stop_token_ids or (token_id in self.stop_ids and not self.options.ignore_eos):
            return FINISH_STOP
        if self.grammar is not None and self.grammar.finished:  # the answer is whole: nothing may follow
            return FINISH_STOP
        if self.num_output_tokens >= self.options.max_tokens or self.seq.num_tokens >= self.max_context_tokens:
            return FINISH_LENGTH
        return ""
