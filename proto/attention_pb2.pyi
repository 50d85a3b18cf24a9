from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "name", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    name: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., name: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class ChatPrompt(_message.Message):
    __slots__ = ("messages", "add_generation_prompt", "template_kwargs", "tools")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    template_kwargs: str
    tools: str
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., template_kwargs: _Optional[str] = ..., tools: _Optional[str] = ...) -> None: ...

class ToolCalling(_message.Message):
    __slots__ = ("mode", "function", "single")
    class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OFF: _ClassVar[ToolCalling.Mode]
        AUTO: _ClassVar[ToolCalling.Mode]
        NAMED: _ClassVar[ToolCalling.Mode]
        REQUIRED: _ClassVar[ToolCalling.Mode]
    OFF: ToolCalling.Mode
    AUTO: ToolCalling.Mode
    NAMED: ToolCalling.Mode
    REQUIRED: ToolCalling.Mode
    MODE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    SINGLE_FIELD_NUMBER: _ClassVar[int]
    mode: ToolCalling.Mode
    function: str
    single: bool
    def __init__(self, mode: _Optional[_Union[ToolCalling.Mode, str]] = ..., function: _Optional[str] = ..., single: _Optional[bool] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty", "frequency_penalty", "top_logprobs", "logprobs", "ignore_eos", "num_experts_per_token", "repetition_penalty", "logit_bias", "stop_token_ids", "min_tokens")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    presence_penalty: float
    frequency_penalty: float
    top_logprobs: int
    logprobs: bool
    ignore_eos: bool
    num_experts_per_token: int
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    min_tokens: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., top_logprobs: _Optional[int] = ..., logprobs: _Optional[bool] = ..., ignore_eos: _Optional[bool] = ..., num_experts_per_token: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., min_tokens: _Optional[int] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("kind", "json_schema")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[StructuredOutput.Kind]
        JSON_OBJECT: _ClassVar[StructuredOutput.Kind]
        JSON_SCHEMA: _ClassVar[StructuredOutput.Kind]
    KIND_UNSPECIFIED: StructuredOutput.Kind
    JSON_OBJECT: StructuredOutput.Kind
    JSON_SCHEMA: StructuredOutput.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    kind: StructuredOutput.Kind
    json_schema: str
    def __init__(self, kind: _Optional[_Union[StructuredOutput.Kind, str]] = ..., json_schema: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "chat", "sampling", "reasoning_inline", "structured_output", "tool_calling", "lora_name")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REASONING_INLINE_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLING_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    chat: ChatPrompt
    sampling: SamplingParams
    reasoning_inline: bool
    structured_output: StructuredOutput
    tool_calling: ToolCalling
    lora_name: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatPrompt, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., reasoning_inline: _Optional[bool] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., tool_calling: _Optional[_Union[ToolCalling, _Mapping]] = ..., lora_name: _Optional[str] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "token_bytes")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    token_bytes: bytes
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., token_bytes: _Optional[bytes] = ...) -> None: ...

class TokenOut(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "top", "token_bytes")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    token_bytes: bytes
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., token_bytes: _Optional[bytes] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class ToolCallDelta(_message.Message):
    __slots__ = ("index", "id", "name", "arguments")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    index: int
    id: str
    name: str
    arguments: str
    def __init__(self, index: _Optional[int] = ..., id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "tokens", "finish_reason", "usage", "reasoning_text", "tool_calls")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    REASONING_TEXT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    text: str
    tokens: _containers.RepeatedCompositeFieldContainer[TokenOut]
    finish_reason: str
    usage: Usage
    reasoning_text: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCallDelta]
    def __init__(self, text: _Optional[str] = ..., tokens: _Optional[_Iterable[_Union[TokenOut, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., reasoning_text: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCallDelta, _Mapping]]] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "top_logprobs", "lora_name")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    top_logprobs: int
    lora_name: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., top_logprobs: _Optional[int] = ..., lora_name: _Optional[str] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("tokens", "usage", "text")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[TokenOut]
    usage: Usage
    text: str
    def __init__(self, tokens: _Optional[_Iterable[_Union[TokenOut, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., text: _Optional[str] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "chat", "add_special_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: ChatPrompt
    add_special_tokens: bool
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[ChatPrompt, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("ids", "token_strs", "context_tokens")
    IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STRS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    token_strs: _containers.RepeatedScalarFieldContainer[str]
    context_tokens: int
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., token_strs: _Optional[_Iterable[str]] = ..., context_tokens: _Optional[int] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfoResponse(_message.Message):
    __slots__ = ("model_id", "arch", "context_tokens", "vocab_size", "ready", "dtype", "device", "lora_adapters")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ARCH_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    arch: str
    context_tokens: int
    vocab_size: int
    ready: bool
    dtype: str
    device: str
    lora_adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapterInfo]
    def __init__(self, model_id: _Optional[str] = ..., arch: _Optional[str] = ..., context_tokens: _Optional[int] = ..., vocab_size: _Optional[int] = ..., ready: _Optional[bool] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., lora_adapters: _Optional[_Iterable[_Union[LoraAdapterInfo, _Mapping]]] = ...) -> None: ...

class LoraAdapterInfo(_message.Message):
    __slots__ = ("name", "path", "rank")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    rank: int
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class LoraAdapterResponse(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: str
    def __init__(self, message: _Optional[str] = ...) -> None: ...

class AttentionStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HopStats(_message.Message):
    __slots__ = ("expert_address", "num_hops", "hop_s_total", "compute_s_total", "bytes_total", "healthy", "overhead_us_median", "overhead_us_mean", "transport", "last_error")
    EXPERT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOPS_FIELD_NUMBER: _ClassVar[int]
    HOP_S_TOTAL_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_US_MEDIAN_FIELD_NUMBER: _ClassVar[int]
    OVERHEAD_US_MEAN_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    expert_address: str
    num_hops: int
    hop_s_total: float
    compute_s_total: float
    bytes_total: int
    healthy: bool
    overhead_us_median: float
    overhead_us_mean: float
    transport: str
    last_error: str
    def __init__(self, expert_address: _Optional[str] = ..., num_hops: _Optional[int] = ..., hop_s_total: _Optional[float] = ..., compute_s_total: _Optional[float] = ..., bytes_total: _Optional[int] = ..., healthy: _Optional[bool] = ..., overhead_us_median: _Optional[float] = ..., overhead_us_mean: _Optional[float] = ..., transport: _Optional[str] = ..., last_error: _Optional[str] = ...) -> None: ...

class ExpertTokenCount(_message.Message):
    __slots__ = ("layer", "expert", "tokens")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    expert: int
    tokens: int
    def __init__(self, layer: _Optional[int] = ..., expert: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class AttentionStats(_message.Message):
    __slots__ = ("num_running", "num_waiting", "kv_cache_usage", "num_steps", "max_batch_tokens_seen", "max_batch_seqs_seen", "hops", "expert_tokens", "prefix_cache_queries", "prefix_cache_hits", "uncovered_layers", "expert_heat", "expert_imbalance", "device", "device_memory", "spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens", "spec_accepted_per_position", "kv_cache_tokens", "kv_cache_dtype", "kv_cache_bytes_per_token")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_SEEN_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SEQS_SEEN_FIELD_NUMBER: _ClassVar[int]
    HOPS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    UNCOVERED_LAYERS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_HEAT_FIELD_NUMBER: _ClassVar[int]
    EXPERT_IMBALANCE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_steps: int
    max_batch_tokens_seen: int
    max_batch_seqs_seen: int
    hops: _containers.RepeatedCompositeFieldContainer[HopStats]
    expert_tokens: _containers.RepeatedCompositeFieldContainer[ExpertTokenCount]
    prefix_cache_queries: int
    prefix_cache_hits: int
    uncovered_layers: _containers.RepeatedScalarFieldContainer[int]
    expert_heat: _containers.RepeatedCompositeFieldContainer[ExpertHeat]
    expert_imbalance: float
    device: str
    device_memory: _containers.RepeatedCompositeFieldContainer[DeviceMemory]
    spec_num_drafts: int
    spec_num_draft_tokens: int
    spec_num_accepted_tokens: int
    spec_accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    kv_cache_tokens: int
    kv_cache_dtype: str
    kv_cache_bytes_per_token: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., num_steps: _Optional[int] = ..., max_batch_tokens_seen: _Optional[int] = ..., max_batch_seqs_seen: _Optional[int] = ..., hops: _Optional[_Iterable[_Union[HopStats, _Mapping]]] = ..., expert_tokens: _Optional[_Iterable[_Union[ExpertTokenCount, _Mapping]]] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., uncovered_layers: _Optional[_Iterable[int]] = ..., expert_heat: _Optional[_Iterable[_Union[ExpertHeat, _Mapping]]] = ..., expert_imbalance: _Optional[float] = ..., device: _Optional[str] = ..., device_memory: _Optional[_Iterable[_Union[DeviceMemory, _Mapping]]] = ..., spec_num_drafts: _Optional[int] = ..., spec_num_draft_tokens: _Optional[int] = ..., spec_num_accepted_tokens: _Optional[int] = ..., spec_accepted_per_position: _Optional[_Iterable[int]] = ..., kv_cache_tokens: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ..., kv_cache_bytes_per_token: _Optional[int] = ...) -> None: ...

class DeviceMemory(_message.Message):
    __slots__ = ("kind", "bytes")
    KIND_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    kind: str
    bytes: int
    def __init__(self, kind: _Optional[str] = ..., bytes: _Optional[int] = ...) -> None: ...

class ExpertHeat(_message.Message):
    __slots__ = ("layer", "expert", "tokens", "tokens_per_s", "placed_on")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PLACED_ON_FIELD_NUMBER: _ClassVar[int]
    layer: int
    expert: int
    tokens: int
    tokens_per_s: float
    placed_on: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, layer: _Optional[int] = ..., expert: _Optional[int] = ..., tokens: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., placed_on: _Optional[_Iterable[str]] = ...) -> None: ...

class RebalanceRequest(_message.Message):
    __slots__ = ("dry_run",)
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    dry_run: bool
    def __init__(self, dry_run: _Optional[bool] = ...) -> None: ...

class RebalanceResponse(_message.Message):
    __slots__ = ("changed", "imbalance_before", "imbalance_after", "num_local", "num_loaded", "seconds", "reason")
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    IMBALANCE_BEFORE_FIELD_NUMBER: _ClassVar[int]
    IMBALANCE_AFTER_FIELD_NUMBER: _ClassVar[int]
    NUM_LOCAL_FIELD_NUMBER: _ClassVar[int]
    NUM_LOADED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    changed: bool
    imbalance_before: float
    imbalance_after: float
    num_local: int
    num_loaded: int
    seconds: float
    reason: str
    def __init__(self, changed: _Optional[bool] = ..., imbalance_before: _Optional[float] = ..., imbalance_after: _Optional[float] = ..., num_local: _Optional[int] = ..., num_loaded: _Optional[int] = ..., seconds: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class JoinExpertsRequest(_message.Message):
    __slots__ = ("address", "instance_id")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    address: str
    instance_id: str
    def __init__(self, address: _Optional[str] = ..., instance_id: _Optional[str] = ...) -> None: ...

class JoinExpertsResponse(_message.Message):
    __slots__ = ("member", "message")
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    member: bool
    message: str
    def __init__(self, member: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...
