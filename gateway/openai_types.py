"""The HTTP vocabulary: OpenAI's request and response bodies, in the order of OpenAI's docs.

Requests validate strictly (a string where a number belongs is a 400, as at OpenAI), accept and
log unknown fields, and convert themselves to the attention service's `GenerateParams` (and
`ScoreParams`) in one method. Responses are plain models; the handlers in serving.py fill them.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer, model_validator

from gateway.attention_types import ChatPrompt, ChatTurn, GenerateParams, SamplingParams, ScoreParams

log = logging.getLogger(__name__)

INT64_MAX = 2**63 - 1
MAX_TOP_LOGPROBS = 20
MAX_N = 128
COMPLETION_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions
UNTIL_CONTEXT_END = 0                # SamplingParams.max_tokens 0: generate until EOS, stop or a full context
ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
    405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
    500: "server_error", 503: "service_unavailable_error", 504: "timeout_error",
}


# ---------------------------------------------------------------------------------------- errors

class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """An error as a value: the body OpenAI sends, plus the HTTP status (not serialized)."""
    error: ErrorInfo
    status_code: int = Field(default=400, exclude=True)


def error_response(status: int, message: str, *, code: str | None = None, param: str | None = None) -> ErrorResponse:
    info = ErrorInfo(message=message, type=ERROR_TYPES.get(status, "server_error"), param=param, code=code)
    return ErrorResponse(error=info, status_code=status)


def validation_error(error: ValidationError) -> ErrorResponse:
    """The first pydantic error as OpenAI's 400, naming the offending parameter."""
    first = error.errors(include_url=False)[0]
    param = _param(first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "json_invalid":
        return error_response(400, f"the request body is not valid JSON: {first['ctx']['error']}", code="invalid_json")
    return error_response(400, f"{param}: {message}" if param else message, code="invalid_value", param=param)


def _param(loc: tuple) -> str | None:
    """`stop` for ("stop", "str"): pydantic names the union member it tried; clients know only fields."""
    parts = [str(p) for p in loc if not (isinstance(p, str) and (p in _UNION_TAGS or "[" in p))]
    return ".".join(parts) or None


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list"})


# ------------------------------------------------------------------------------------ base types

class OpenAIBaseModel(BaseModel):
    """Request models: strict types, unknown fields accepted (clients send many) but logged."""
    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="after")
    def _log_unknown_fields(self):
        if self.model_extra:
            log.warning("%s: ignoring unknown fields %s", type(self).__name__, sorted(self.model_extra))
        return self


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class SamplingRequest(OpenAIBaseModel):
    """The parameters chat and completions share; the subclasses list them in OpenAI's order."""
    model: str | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, ge=-INT64_MAX - 1, le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    user: str | None = None
    # Beyond OpenAI, as vLLM and llama-server accept them:
    top_k: int | None = Field(default=None, ge=-1)          # -1 or 0: off
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    ignore_eos: bool = False
    num_experts_per_token: int | None = Field(default=None, ge=0)  # SplitMoE: 0 is the model's own

    @model_validator(mode="after")
    def _check_common(self):
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [s for s in stops if s]

    def sampling_params(self, max_tokens: int, top_logprobs: int | None) -> SamplingParams:
        """`top_logprobs` None: no logprobs; 0: the sampled token's only."""
        temperature = 1.0 if self.temperature is None else self.temperature
        top_p = 1.0 if self.top_p is None else self.top_p
        if top_p == 0.0:  # the attention service reads top_p 0 as 1.0; a nucleus of 0 keeps only the top token
            temperature, top_p = 0.0, 1.0
        return SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=max(self.top_k or 0, 0),
            min_p=self.min_p or 0.0, stop=tuple(self.stop_strings()),
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            logprobs=top_logprobs is not None, top_logprobs=top_logprobs or 0, ignore_eos=self.ignore_eos,
            num_experts_per_token=self.num_experts_per_token or 0)

    def seeded(self, params: SamplingParams, choice: int) -> SamplingParams:
        """Choice i of n samples with seed + i, so `n` choices differ yet replay exactly."""
        if self.seed is None:
            return params
        return replace(params, seed=(self.seed + choice + INT64_MAX + 1) % 2**64 - INT64_MAX - 1)  # wraps in int64


def fan_out(request_id: str, n: int) -> list[str]:
    """Request ids of the n choices (the id itself when n is 1, so logs match the response id)."""
    return [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]


# -------------------------------------------------------------------------------------------- chat

class TextContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    def to_turn(self) -> ChatTurn:
        role = "system" if self.role == "developer" else self.role  # chat templates know no "developer"
        content = self.content or ""
        if not isinstance(content, str):
            content = "\n".join(part.text for part in content)
        return ChatTurn(role=role, content=content)


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions, fields in the order of OpenAI's API reference."""
    messages: list[ChatMessage] = Field(min_length=1)
    # model, frequency_penalty, logit_bias: SamplingRequest
    logprobs: bool = False
    max_completion_tokens: int | None = Field(default=None, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)
    # n, presence_penalty: SamplingRequest
    response_format: ResponseFormat | None = None
    # seed, stop, stream, stream_options, temperature: SamplingRequest
    tool_choice: str | dict | None = None
    tools: list[dict] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # top_p, user: SamplingRequest
    add_generation_prompt: bool = True  # vLLM's extension: False continues the last message
    # llama-server's per-request switch: "none" returns the reasoning inline in `content`
    reasoning_format: Literal["auto", "none"] | None = None

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.tools:
            raise ValueError("tools are not supported")
        if self.response_format is not None and self.response_format.type != "text":
            raise ValueError(f"response_format {self.response_format.type!r} is not supported")
        return self

    def to_generate_params(self, request_id: str) -> list[GenerateParams]:
        """One Generate call per choice (`n` of them)."""
        max_tokens = self.max_completion_tokens or self.max_tokens or UNTIL_CONTEXT_END
        params = self.sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)
        chat = ChatPrompt(messages=tuple(m.to_turn() for m in self.messages),
                          add_generation_prompt=self.add_generation_prompt)
        inline = self.reasoning_format == "none"
        return [GenerateParams(request_id=rid, prompt=chat, sampling=self.seeded(params, i), reasoning_inline=inline)
                for i, rid in enumerate(fan_out(request_id, self.n))]


# ------------------------------------------------------------------------------------- completions

Prompt = str | list[int]  # one prompt: text, or token ids used as given


class CompletionRequest(SamplingRequest):
    """POST /v1/completions (legacy), fields in the order of OpenAI's API reference."""
    # model: SamplingRequest
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = Field(default=None, ge=1)
    echo: bool = False
    # frequency_penalty, logit_bias: SamplingRequest
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    max_tokens: int = Field(default=COMPLETION_DEFAULT_MAX_TOKENS, ge=0)
    # n, presence_penalty, seed, stop, stream, stream_options: SamplingRequest
    suffix: str | None = None
    # temperature, top_p, user: SamplingRequest

    @model_validator(mode="after")
    def _check_completion(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        prompts = self.prompts()
        if not prompts or any(len(p) == 0 and not isinstance(p, str) for p in prompts):
            raise ValueError("prompt: the prompt is empty")
        if any(t < 0 for p in prompts if not isinstance(p, str) for t in p):
            raise ValueError("prompt: token ids must not be negative")
        return self

    def prompts(self) -> list[Prompt]:
        """The batch: a string or an id list is one prompt; a list of either is several."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)

    @property
    def needs_prompt_scores(self) -> bool:
        """Score the prompt for its logprobs (echo), its text (echoed ids) or its length (max_tokens 0)."""
        return self.max_tokens == 0 or (self.echo and (self.logprobs is not None or not isinstance(self.prompt, str)))

    def to_generate_params(self, request_id: str) -> list[GenerateParams]:
        """One Generate call per (prompt, choice), prompt-major: choice index = prompt * n + i."""
        params, prompts = self.sampling_params(self.max_tokens, self.logprobs), self.prompts()
        calls = []
        for p, prompt in enumerate(prompts):
            ids = fan_out(f"{request_id}-p{p}" if len(prompts) > 1 else request_id, self.n)
            calls += [GenerateParams(request_id=rid, prompt=_attention_prompt(prompt), sampling=self.seeded(params, i))
                      for i, rid in enumerate(ids)]
        return calls

    def to_score_params(self, request_id: str) -> list[ScoreParams]:
        """One Score call per prompt (the prompt's own logprobs, for echo)."""
        return [ScoreParams(request_id=f"{request_id}-score{p}", prompt=_attention_prompt(prompt),
                            top_logprobs=self.logprobs or 0)
                for p, prompt in enumerate(self.prompts())]


def _attention_prompt(prompt: Prompt) -> str | tuple[int, ...]:
    return prompt if isinstance(prompt, str) else tuple(prompt)


# --------------------------------------------------------------------------------------- responses

class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "UsageInfo":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class ChatCompletionLogProb(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None
    refusal: list[ChatCompletionLogProbsContent] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # as vLLM and llama-server return it
    refusal: str | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """A stream delta: only the fields that changed (the first carries the role)."""
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class CompletionLogprobs(BaseModel):
    """The legacy format: parallel lists, one entry per token (the first prompt token has no logprob)."""
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """Both the full response and a stream chunk (OpenAI uses one shape for both)."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "splitmoe"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
