"""The HTTP vocabulary: OpenAI's request and response bodies, in the order of OpenAI's docs.

Requests validate strictly (a string where a number belongs is a 400, as at OpenAI), bound every
integer to what its protobuf field holds, refuse the parameters they do not implement, accept and
log other unknown fields, and convert themselves to the attention service's `GenerateParams` (and
`ScoreParams`) in one method. Responses are plain models; the handlers (handlers/) fill them.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any, ClassVar, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_serializer, model_validator

from splitmoe.gateway import tools as tool_rules
from splitmoe.gateway.attention_types import (
    ChatPrompt,
    ChatTurn,
    GenerateParams,
    SamplingParams,
    ScoreParams,
    StructuredOutput,
    ToolCall,
    ToolCalling,
)
from splitmoe.gateway.structured_outputs import JSON_OBJECT, SchemaError, json_schema_output

log = logging.getLogger(__name__)

INT32_MAX = 2**31 - 1                # token ids, max_tokens, top_k, ...: int32 in proto/attention.proto
INT64_MAX = 2**63 - 1                # seed: int64, as vLLM bounds it
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0               # OpenAI's bound on a logit_bias value
MAX_N = 128
# Stop strings are matched on the engine's thread at every token, at a cost that grows with their
# number and length: bounded, so that one request's stops cannot slow every stream (OpenAI allows 4).
MAX_STOPS = 32
MAX_STOP_CHARS = 256
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
    request_id: str | None = None  # also the `x-request-id` header: what the gateway's log says about it


class ErrorResponse(BaseModel):
    """An error as a value: the body OpenAI sends, plus the HTTP status (not serialized)."""
    error: ErrorInfo
    status_code: int = Field(default=400, exclude=True)


def error_response(status: int, message: str, *, code: str | None = None, param: str | None = None) -> ErrorResponse:
    info = ErrorInfo(message=message, type=ERROR_TYPES.get(status, "server_error"), param=param, code=code)
    return ErrorResponse(error=info, status_code=status)


class ParamError(ValueError):
    """A request validator's complaint about one parameter: the 400 names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def validation_error(error: ValidationError) -> ErrorResponse:
    """The first pydantic error as OpenAI's 400, naming the offending parameter."""
    first = error.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return error_response(400, f"the request body is not valid JSON: {first['ctx']['error']}", code="invalid_json")
    param = getattr(first.get("ctx", {}).get("error"), "param", None) or _param(first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    if param and not message.startswith(f"{param}: "):
        message = f"{param}: {message}"
    return error_response(400, message, code="invalid_value", param=param)


def _param(loc: tuple) -> str | None:
    """`stop` for ("stop", "str"): pydantic names the union member it tried; clients know only fields."""
    parts = [str(p) for p in loc if not (isinstance(p, str) and (p in _UNION_TAGS or "[" in p))]
    return ".".join(parts) or None


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list"})


# ------------------------------------------------------------------------------------ base types

class UnknownFieldLog:
    """Logs each unknown field name once per process, cut short: a client that sends thousands of
    fields, or huge names, writes a few short lines, not its body."""
    MAX_NAMES = 1024      # distinct names remembered; later new names are no longer logged
    MAX_NAME_CHARS = 40

    def __init__(self) -> None:
        self._seen: set[tuple[str, str]] = set()

    def report(self, model: str, names: Iterable[str]) -> None:
        new = []
        for name in names:
            key = (model, name[:self.MAX_NAME_CHARS])
            if key not in self._seen and len(self._seen) < self.MAX_NAMES:
                self._seen.add(key)
                new.append(key[1] + ("..." if len(name) > self.MAX_NAME_CHARS else ""))
        if new:
            shown = ", ".join(new[:10]) + (f" and {len(new) - 10} more" if len(new) > 10 else "")
            log.warning("%s: ignoring unknown fields %s (each name is logged once)", model, shown)


UNKNOWN_FIELDS = UnknownFieldLog()


class OpenAIBaseModel(BaseModel):
    """Request models: strict types, finite numbers, unknown fields accepted (clients send many) but logged."""
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    @model_validator(mode="after")
    def _log_unknown_fields(self):
        if self.model_extra:  # the unsupported ones get their own 400
            UNKNOWN_FIELDS.report(type(self).__name__, (k for k in self.model_extra if k not in UNSUPPORTED_PARAMETERS))
        return self


# Parameters of vLLM, llama-server or OpenAI that would change the output and that SplitMoE does not
# implement: a 400 names them, unless they hold their no-op value (clients send defaults explicitly).
UNSUPPORTED_PARAMETERS: dict[str, Any] = {
    "use_beam_search": False, "length_penalty": 1.0,
    "include_stop_str_in_output": False, "prompt_logprobs": None, "allowed_token_ids": None, "bad_words": [],
    "truncate_prompt_tokens": None, "guided_json": None, "guided_regex": None, "guided_choice": None,
    "guided_grammar": None, "structured_outputs": None, "structural_tag": None, "logits_processors": None,
    "chat_template": None, "continue_final_message": False, "echo": False, "documents": None,
    "mm_processor_kwargs": None, "prompt_embeds": None, "kv_transfer_params": None, "vllm_xargs": None,
    # vLLM's defaults are what SplitMoE does: special tokens left out of the text, reasoning returned apart.
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "include_reasoning": True,
    "return_tokens_as_token_ids": False, "return_token_ids": False, "priority": 0,
    "n_predict": -1, "repeat_penalty": 1.0, "repeat_last_n": 64,
    "typical_p": 1.0, "tfs_z": 1.0, "mirostat": 0, "dry_multiplier": 0.0, "xtc_probability": 0.0, "grammar": "",
    "json_schema": None, "n_probs": 0, "functions": None, "function_call": None, "prediction": None,
    "audio": None, "modalities": ["text"], "reasoning_effort": None, "web_search_options": None, "verbosity": None,
}
INSTEAD = {"n_predict": "max_tokens", "repeat_penalty": "repetition_penalty",
           "reasoning_effort": "chat_template_kwargs", "n_probs": "logprobs"}


def check_supported(extra: dict[str, Any] | None) -> None:
    for name, value in (extra or {}).items():
        if name in UNSUPPORTED_PARAMETERS and value is not None and value != UNSUPPORTED_PARAMETERS[name]:
            hint = f"; use {INSTEAD[name]}" if name in INSTEAD else ""
            raise ParamError(name, f"{name} is not supported{hint}")


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class SamplingRequest(OpenAIBaseModel):
    """The parameters chat and completions share; the subclasses list them in OpenAI's order."""
    model: str | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (as a JSON key) -> bias in [-100, 100]
    n: int = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, ge=-INT64_MAX - 1, le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    user: str | None = None  # OpenAI's end-user id for abuse monitoring: nothing to generate differently
    # Beyond OpenAI, as vLLM and llama-server accept them:
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)          # -1 or 0: off
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)  # vLLM's; 1: off
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None                               # vLLM's: these end it too
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)               # vLLM's: no stop token before
    num_experts_per_token: int | None = Field(default=None, ge=0, le=INT32_MAX)  # SplitMoE: 0 is the model's own

    @model_validator(mode="after")
    def _check_common(self):
        check_supported(self.model_extra)
        self.logit_bias_ids()  # checked here, so that a bad key is a 400 before any call
        if any(not 0 <= t <= INT32_MAX for t in self.stop_token_ids or ()):
            raise ParamError("stop_token_ids", f"stop_token_ids must lie in [0, {INT32_MAX}]")
        if self.min_tokens and self.stop_strings():  # vLLM holds stop strings back until min_tokens; we do not
            raise ParamError("min_tokens", "min_tokens together with stop strings is not supported")
        # A template's own BOS is the chat's; completions add the tokenizer's: each endpoint's default, as vLLM's.
        if (self.model_extra or {}).get("add_special_tokens", self.ADD_SPECIAL_TOKENS) != self.ADD_SPECIAL_TOKENS:
            raise ParamError("add_special_tokens", f"add_special_tokens other than {self.ADD_SPECIAL_TOKENS} is not supported")
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options is only allowed when stream is true")
        stops = self.stop_strings()
        if len(stops) > MAX_STOPS or any(len(stop) > MAX_STOP_CHARS for stop in stops):
            raise ParamError("stop", f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters each")
        return self

    ADD_SPECIAL_TOKENS: ClassVar[bool] = True

    @property
    def num_generations(self) -> int:
        """Choices of this request, each a Generate call: what admission counts."""
        return self.n

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def logit_bias_ids(self) -> dict[int, float]:
        """OpenAI's logit_bias with its keys as token ids; the attention service checks them against the
        vocabulary, which the gateway does not know."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit() and int(key) <= INT32_MAX):
                raise ParamError("logit_bias", f"logit_bias keys must be token ids in [0, {INT32_MAX}], not {key[:40]!r}")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ParamError("logit_bias", f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
            bias[int(key)] = value
        return bias

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [s for s in stops if s]

    def sampling_params(self, max_tokens: int, top_logprobs: int | None) -> SamplingParams:
        """The request's sampling under the wire's names, each one sent (OpenAI's default where the request
        has none), but the seed, which `seeded` adds. `top_logprobs` None: no logprobs; 0: the sampled token's only."""
        temperature = 1.0 if self.temperature is None else self.temperature
        top_p = 1.0 if self.top_p is None else self.top_p
        if top_p == 0.0:  # the attention service reads top_p 0 as 1.0; a nucleus of 0 keeps only the top token
            temperature, top_p = 0.0, 1.0
        return dict(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=max(self.top_k or 0, 0),
            min_p=self.min_p or 0.0, stop=tuple(self.stop_strings()),
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            logprobs=top_logprobs is not None, top_logprobs=top_logprobs or 0, ignore_eos=self.ignore_eos,
            num_experts_per_token=self.num_experts_per_token or 0, logit_bias=self.logit_bias_ids(),
            stop_token_ids=tuple(self.stop_token_ids or ()), min_tokens=self.min_tokens)

    def seeded(self, params: SamplingParams, choice: int) -> SamplingParams:
        """Choice i of n samples with seed + i, so `n` choices differ yet replay exactly."""
        if self.seed is None:
            return params
        return {**params, "seed": (self.seed + choice + INT64_MAX + 1) % 2**64 - INT64_MAX - 1}  # wraps in int64


def fan_out(request_id: str, n: int) -> list[str]:
    """Request ids of the n choices (the id itself when n is 1, so logs match the response id)."""
    return [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]


# -------------------------------------------------------------------------------------------- chat

class TextContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ChatMessageToolCall(OpenAIBaseModel):
    """A call of an earlier assistant turn, sent back."""
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ChatMessageToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool: the call this result answers

    @model_validator(mode="after")
    def _check_tool_fields(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool_call_id: a tool message needs the tool_call_id of the call it answers")
        for j, call in enumerate(self.tool_calls or ()):
            try:
                tool_rules.check_arguments(call.function.arguments, f"tool_calls.{j}.function.arguments")
            except tool_rules.ToolError as e:
                raise ValueError(str(e)) from None  # a plain ValueError: the 400 names the message's place
        return self

    def to_turn(self) -> ChatTurn:
        role = "system" if self.role == "developer" else self.role  # chat templates know no "developer"
        content = self.content or ""
        if not isinstance(content, str):
            content = "\n".join(part.text for part in content)
        calls = tuple(ToolCall(c.id, c.function.name, c.function.arguments) for c in self.tool_calls or ())
        return ChatTurn(role=role, content=content, name=self.name or "", tool_calls=calls,
                        tool_call_id=self.tool_call_id or "")


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's rule, plus the dots some namespaces use
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class ChatTool(OpenAIBaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class JsonSchemaFormat(OpenAIBaseModel):
    """response_format.json_schema. Every schema is enforced whatever `strict` says, as vLLM does."""
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")  # None: any JSON value
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    _output: StructuredOutput | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _check_schema(self):
        """The constraint, checked once here: a schema the grammar engine refuses is the client's 400."""
        if self.type == "json_object":
            self._output = JSON_OBJECT
        elif self.type == "json_schema":
            if self.json_schema is None:
                raise ParamError("response_format", "response_format of type json_schema needs json_schema")
            schema = self.json_schema.schema_
            try:
                self._output = json_schema_output(True if schema is None else schema)
            except SchemaError as e:
                raise ParamError("response_format", f"invalid JSON schema: {e}") from None
        return self

    @property
    def structured_output(self) -> StructuredOutput | None:
        return self._output


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions, fields in the order of OpenAI's API reference."""
    ADD_SPECIAL_TOKENS: ClassVar[bool] = False
    messages: list[ChatMessage] = Field(min_length=1)
    # model, frequency_penalty, logit_bias: SamplingRequest
    logprobs: bool = False
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    # n, presence_penalty: SamplingRequest
    response_format: ResponseFormat | None = None
    # seed, stop, stream, stream_options, temperature: SamplingRequest
    tool_choice: str | dict | None = None
    tools: list[ChatTool] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # top_p, user: SamplingRequest
    parallel_tool_calls: bool = True
    _tool_output: StructuredOutput | None = PrivateAttr(default=None)  # the shape tool_choice forces
    add_generation_prompt: bool = True  # vLLM's extension: False continues the last message
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra variables for the chat template
    # llama-server's per-request switch: "none" returns the reasoning inline in `content`
    reasoning_format: Literal["auto", "none"] | None = None

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs requires logprobs to be true")
        self._check_tools()
        return self

    def _check_tools(self) -> None:
        tools = self.tool_dicts()
        names = [t["function"]["name"] for t in tools]
        if len(set(names)) < len(names):
            raise ParamError("tools", "tools name the same function twice")
        try:
            schema = tool_rules.output_schema(tools, self.tool_calling())
        except tool_rules.ToolError as e:
            raise ParamError(e.param, str(e).removeprefix(f"{e.param}: ")) from None
        if schema is None:
            return
        if self.response_format is not None and self.response_format.type != "text":
            raise ParamError("response_format", "response_format cannot constrain a reply that tool_choice "
                                                "required or a named function already constrains")
        try:  # the reply is forced into the calls' shape: checked by the grammar engine here, a 400 if refused
            self._tool_output = json_schema_output(schema)
        except SchemaError as e:
            raise ParamError("tools", f"invalid JSON schema in the tools' parameters: {e}") from None

    def tool_dicts(self) -> list[dict]:
        """The tools as OpenAI's JSON (what the chat template renders)."""
        return [t.model_dump(exclude_none=True) for t in self.tools or ()]

    def tool_calling(self) -> ToolCalling | None:
        return tool_rules.tool_calling(self.tool_dicts(), self.tool_choice, self.parallel_tool_calls)

    def to_generate_params(self, request_id: str, lora_name: str = "") -> list[GenerateParams]:
        """One Generate call per choice (`n` of them); `lora_name`: the adapter `model` named, "" for the base."""
        max_tokens = self.max_completion_tokens or self.max_tokens or UNTIL_CONTEXT_END
        params = self.sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)
        tools = self.tool_dicts()
        chat = ChatPrompt(messages=tuple(m.to_turn() for m in self.messages),
                          add_generation_prompt=self.add_generation_prompt,
                          template_kwargs=self.chat_template_kwargs or {}, tools=tuple(tools))
        inline = self.reasoning_format == "none"
        calling = self.tool_calling()
        output = self._tool_output or (self.response_format.structured_output if self.response_format else None)
        return [GenerateParams(request_id=rid, prompt=chat, sampling=self.seeded(params, i), reasoning_inline=inline,
                               structured_output=output, tool_calling=calling, lora_name=lora_name)
                for i, rid in enumerate(fan_out(request_id, self.n))]


# ------------------------------------------------------------------------------------- completions

Prompt = str | list[int]  # one prompt: text, or token ids used as given


class CompletionRequest(SamplingRequest):
    """POST /v1/completions (legacy), fields in the order of OpenAI's API reference."""
    # model: SamplingRequest
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    echo: bool = False
    # frequency_penalty, logit_bias: SamplingRequest
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    max_tokens: int = Field(default=COMPLETION_DEFAULT_MAX_TOKENS, ge=0, le=INT32_MAX)
    # n, presence_penalty, seed, stop, stream, stream_options: SamplingRequest
    suffix: str | None = None
    # temperature, top_p, user: SamplingRequest

    @model_validator(mode="after")
    def _check_completion(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ParamError("best_of", "best_of other than n is not supported")
        if self.suffix:
            raise ParamError("suffix", "suffix is not supported")
        prompts = self.prompts()
        if not prompts or any(len(p) == 0 and not isinstance(p, str) for p in prompts):
            raise ParamError("prompt", "the prompt is empty")
        # Checked here, not as an int constraint of the union: pydantic would report every member's error.
        if any(not 0 <= t <= INT32_MAX for p in prompts if not isinstance(p, str) for t in p):
            raise ParamError("prompt", f"token ids must lie in [0, {INT32_MAX}]")
        return self

    @property
    def num_generations(self) -> int:
        """Choices of this request (each a Generate call unless max_tokens is 0): what admission counts."""
        return len(self.prompts()) * self.n

    def prompts(self) -> list[Prompt]:
        """The batch: a string or an id list is one prompt; a list of either is several."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)

    @property
    def needs_prompt_scores(self) -> bool:
        """Score the prompt for its logprobs (echo), its text (echoed ids) or its length (max_tokens 0)."""
        return self.max_tokens == 0 or (self.echo and (self.logprobs is not None or not isinstance(self.prompt, str)))

    def to_generate_params(self, request_id: str, lora_name: str = "") -> list[GenerateParams]:
        """One Generate call per (prompt, choice), prompt-major: choice index = prompt * n + i."""
        params, prompts = self.sampling_params(self.max_tokens, self.logprobs), self.prompts()
        calls = []
        for p, prompt in enumerate(prompts):
            ids = fan_out(f"{request_id}-p{p}" if len(prompts) > 1 else request_id, self.n)
            calls += [GenerateParams(request_id=rid, prompt=_attention_prompt(prompt), sampling=self.seeded(params, i),
                                     lora_name=lora_name)
                      for i, rid in enumerate(ids)]
        return calls

    def to_score_params(self, request_id: str, lora_name: str = "") -> list[ScoreParams]:
        """One Score call per prompt (the prompt's own logprobs, for echo), under the same adapter as its choices."""
        return [ScoreParams(request_id=f"{request_id}-score{p}", prompt=_attention_prompt(prompt),
                            top_logprobs=self.logprobs or 0, lora_name=lora_name)
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


Choice = TypeVar("Choice", bound=BaseModel)


class ChoicesBody(BaseModel, Generic[Choice]):
    """The fields, in OpenAI's order, of every generation response and stream chunk. A body names its
    `object` and may narrow more; a narrowed field keeps its place here, so the JSON's order stays OpenAI's."""
    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Choice]
    usage: UsageInfo | None = None


class ChatCompletionLogProb(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None
    refusal: list[ChatCompletionLogProbsContent] | None = None


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # as vLLM and llama-server return it
    refusal: str | None = None
    tool_calls: list[ResponseToolCall] | None = None


class _WithoutNulls(BaseModel):
    """Stream deltas: only the fields that are set, as OpenAI sends them."""

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_WithoutNulls):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_WithoutNulls):
    """A piece of a call: the first has id, type and name (arguments ""), later ones argument text."""
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatChoiceBase(BaseModel):
    """What a chat choice carries whether it is whole or a stream's delta."""
    index: int
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChoice(ChatChoiceBase):
    message: ChatResponseMessage


class ChatCompletionResponse(ChoicesBody[ChatCompletionChoice]):
    object: Literal["chat.completion"] = "chat.completion"
    usage: UsageInfo


class DeltaMessage(_WithoutNulls):
    """A stream delta: only the fields that changed (the first carries the role)."""
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(ChatChoiceBase):
    delta: DeltaMessage


class ChatCompletionChunk(ChoicesBody[ChatCompletionStreamChoice]):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int


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


class CompletionResponse(ChoicesBody[CompletionChoice]):
    """Both the full response and a stream chunk (OpenAI uses one shape for both)."""
    object: Literal["text_completion"] = "text_completion"


class ModelCard(BaseModel):
    """vLLM's card: a LoRA adapter's has its file as `root` and the base model's id as `parent`."""
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "splitmoe"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
