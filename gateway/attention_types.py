"""What the gateway sends to and gets from the attention service, as our own frozen dataclasses.

openai_types.py builds the requests, the handlers read the answers; only attention_client.py turns
them into protobuf messages and back, so a change of wire format touches that one file.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

# ------------------------------------------------------------------------------------- requests

# The sampling options under their names in proto/attention.proto's SamplingParams, which declares them.
# The gateway only passes them on (attention_client copies them by name), so a new option needs the proto's
# field and openai_types' mapping to it, and nothing here.
SamplingParams = Mapping[str, int | float | bool | tuple[str, ...] | Mapping[int, float]]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call of an earlier assistant turn, sent back with the conversation."""
    id: str
    name: str
    arguments: str                      # JSON text


@dataclass(frozen=True, slots=True)
class ChatTurn:
    role: str
    content: str
    name: str = ""                      # "": none
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""              # a tool result: the call it answers


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """Messages the attention service renders with the model's own chat template."""
    messages: tuple[ChatTurn, ...]
    add_generation_prompt: bool = True
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)  # extra template variables
    tools: tuple[Mapping[str, Any], ...] = ()  # OpenAI tool definitions, rendered by the template


@dataclass(frozen=True, slots=True)
class ToolCalling:
    """How the attention service reads the reply's tool calls (proto ToolCalling)."""
    mode: str                           # "auto" | "named" | "required"
    function: str = ""                  # named: the function whose arguments the reply is
    single: bool = False                # parallel_tool_calls false


TokenIds = tuple[int, ...]
Prompt = str | TokenIds | ChatPrompt    # text to tokenize, token ids used as given, or a chat


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """What the output must be, enforced while sampling: any JSON object, or JSON valid against a schema.
    Built by structured_outputs.py, which checks the schema first."""
    kind: Literal["json_object", "json_schema"]
    json_schema: str = ""               # json_schema: the schema as JSON text


@dataclass(frozen=True, slots=True)
class GenerateParams:
    """One Generate call: one choice of one prompt."""
    request_id: str
    prompt: Prompt
    sampling: SamplingParams
    reasoning_inline: bool = False  # chat only: the model's reasoning as plain content
    structured_output: StructuredOutput | None = None  # None: free text
    tool_calling: ToolCalling | None = None  # chat only: parse the reply's tool calls
    lora_name: str = ""                 # a loaded LoRA adapter's name; "": the base model


@dataclass(frozen=True, slots=True)
class ScoreParams:
    """One Score call: the prompt's own logprobs, its decoded text and its length."""
    request_id: str
    prompt: str | TokenIds
    top_logprobs: int = 0
    lora_name: str = ""                 # as GenerateParams'


@dataclass(frozen=True, slots=True)
class TokenizeParams:
    """One Tokenize call: the tokenizer alone, no model."""
    prompt: str | ChatPrompt
    add_special_tokens: bool = True     # the tokenizer's BOS (or EOS) around the text


# -------------------------------------------------------------------------------------- answers

@dataclass(frozen=True, slots=True)
class TopLogprob:
    token: str           # the token decoded alone (U+FFFD where it holds part of a character)
    token_bytes: bytes   # exact: OpenAI's `bytes`, and the `bytes:\xNN` spelling of partial characters
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A sampled (or prompt) token with its logprob and the most likely candidates at its position."""
    token: str
    token_bytes: bytes
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of a reply's tool call: the first of a call has id and name, later ones argument text."""
    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(frozen=True, slots=True)
class GenerateChunk:
    """One message of a Generate stream."""
    text: str                                 # new text since the last chunk (stop strings held back)
    reasoning_text: str = ""                  # new reasoning (chat), apart from the answer
    tokens: tuple[TokenLogprob, ...] = ()     # the tokens behind it, when logprobs were asked for
    finish_reason: str | None = None          # "stop" or "length" on the last chunk
    usage: Usage | None = None                # on the last chunk only
    tool_calls: tuple[ToolCallDelta, ...] = ()  # pieces of tool calls, when they are parsed


@dataclass(frozen=True, slots=True)
class ScoreResult:
    tokens: tuple[TokenLogprob, ...]          # the first has no logprob: nothing precedes it
    prompt_tokens: int
    text: str                                 # the prompt decoded as a whole (echoed token ids)


@dataclass(frozen=True, slots=True)
class TokenizeResult:
    ids: tuple[int, ...]
    token_strs: tuple[str, ...]               # as the vocabulary spells each token
    context_tokens: int


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """A LoRA adapter the attention service has loaded: requests name it as their model."""
    name: str
    path: str                                 # the GGUF file it was loaded from
    rank: int


@dataclass(frozen=True, slots=True)
class ModelInfo:
    ready: bool
    model_id: str = ""                        # empty until ready
    context_tokens: int = 0
    lora_adapters: tuple[LoraAdapter, ...] = ()  # loaded now; they change at run time


@dataclass(frozen=True, slots=True)
class HopStats:
    """The attention service's exchanges with one expert service, summed since it started."""
    address: str
    healthy: bool
    num_hops: int = 0
    hop_s_total: float = 0.0
    compute_s_total: float = 0.0
    bytes_total: int = 0
    transport: str = ""                       # "grpc" | "shm" | "" while disconnected
    last_error: str = ""                      # why it is unhealthy


@dataclass(frozen=True, slots=True)
class ExpertTokens:
    layer: int
    expert: int
    tokens: int


@dataclass(frozen=True, slots=True)
class ExpertHeat:
    layer: int
    expert: int
    tokens: int                   # routed to it since start, as the attention service counts
    tokens_per_s: float           # decayed rate
    placed_on: tuple[str, ...]    # expert service addresses computing it; "local": the attention process


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    kind: str                     # proto/attention.proto DeviceMemory's kinds: weights, kv_cache, ...
    bytes: int


@dataclass(frozen=True, slots=True)
class AttentionStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0               # 0..1
    num_steps: int = 0
    max_batch_tokens_seen: int = 0
    max_batch_seqs_seen: int = 0
    hops: tuple[HopStats, ...] = ()
    expert_tokens: tuple[ExpertTokens, ...] = ()
    prefix_cache_queries: int = 0             # tokens of admitted requests
    prefix_cache_hits: int = 0                # of those, tokens found in the prefix cache
    expert_heat: tuple[ExpertHeat, ...] = ()
    expert_imbalance: float = 0.0             # max over mean tokens per expert service per layer call
    uncovered_layers: tuple[int, ...] = ()    # MoE layers with an expert no healthy service hosts
    device: str = ""                          # where attention runs: "cpu" or the GPU's name
    device_memory: tuple[DeviceMemory, ...] = ()  # on a GPU: its memory by use
    spec_num_drafts: int = 0                  # speculative decoding: drafts verified
    spec_num_draft_tokens: int = 0            # drafted tokens in them
    spec_num_accepted_tokens: int = 0         # of those, accepted
    spec_accepted_per_position: tuple[int, ...] = ()  # accepted, by position in the draft
    kv_cache_tokens: int = 0                  # the KV cache's capacity, over all sequences
    kv_cache_dtype: str = ""                  # how it stores values (--kv-cache-dtype)
    kv_cache_bytes_per_token: int = 0         # over every layer
