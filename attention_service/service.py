"""Everything the attention service serves with, built from settings: model, engine, tokenizer.

Also the conversions the RPC handlers share: a prompt to token ids, a request to a
GenerationRequest. Raised `ValueError`s are the caller's fault (INVALID_ARGUMENT).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from splitmoe.attention_service.engine.engine import Engine
from splitmoe.attention_service.engine.grammar import Grammar, GrammarCompiler
from splitmoe.attention_service.engine.reasoning import ReasoningFormat, detect_reasoning_format, output_text
from splitmoe.attention_service.engine.request import GenerationRequest, OutputSink
from splitmoe.attention_service.engine.sampling import RequestSampler, SamplingOptions
from splitmoe.attention_service.engine.scheduler import Scheduler
from splitmoe.attention_service.engine.tool_calls import ToolCalling, ToolCallText, ToolFormat, detect_tool_format
from splitmoe.attention_service.expert_backends.backend import ExpertBackend, InProcessExperts
from splitmoe.attention_service.expert_backends.device_experts import DeviceExperts
from splitmoe.attention_service.expert_backends.gpu_hot import GpuHotExperts, choose_gpu_experts
from splitmoe.attention_service.expert_backends.heat import load_heat
from splitmoe.attention_service.expert_backends.remote import ExpertsUnavailable, RemoteExperts
from splitmoe.attention_service.lora_adapters import LoraAdapters, UnknownLora
from splitmoe.attention_service.model.lora import AdapterWeights
from splitmoe.attention_service.model.runner import ModelRunner, check_experts_per_token, dtype_name
from splitmoe.attention_service.model.sequence import Sequence
from splitmoe.attention_service.settings import AttentionSettings
from splitmoe.kernels.repack_cache import RepackCache
from splitmoe.modelfile.chat_template import ChatTemplate
from splitmoe.modelfile.expert_tensors import expert_count
from splitmoe.modelfile.gguf_file import GGUFFile
from splitmoe.modelfile.gguf_parts import model_stem
from splitmoe.modelfile.hparams import ModelConfig
from splitmoe.modelfile.tokenizer import Tokenizer
from splitmoe.runtime.memory import MIB, Resident, resident
from splitmoe.runtime.settings import repack_cache_dir

log = logging.getLogger(__name__)


def classify_error(error: Exception) -> str:
    """'unavailable' for failures of the expert services (retryable), else 'internal'."""
    return "unavailable" if isinstance(error, ExpertsUnavailable) else "internal"


# Unicode normalization (NFC) shrinks text by at most 3x: three 3-byte Hangul jamo compose to one syllable.
NORMALIZATION_SHRINK = 3
# What the chat template itself sets; chat_template_kwargs may not replace them.
TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools", "documents"})


@dataclass
class ServingModel:
    settings: AttentionSettings
    runner: ModelRunner
    engine: Engine
    tokenizer: Tokenizer
    template: ChatTemplate
    model_id: str
    max_context_tokens: int  # the smaller of the model's context and the KV cache
    reasoning: ReasoningFormat | None = None  # from the vocabulary; found even when settings say none
    tool_format: ToolFormat | None = None  # the model's call syntax (None: --tool-call-parser none)
    grammars: GrammarCompiler | None = None  # structured outputs: the vocabulary as the grammar engine's
    adapters: LoraAdapters | None = None  # LoRA adapters served beside the base (lora_adapters.py)

    def __post_init__(self):
        self._seq_ids = itertools.count()
        # Longer text cannot tokenize to fewer than max_context_tokens tokens: each token stands for at
        # most max_token_bytes bytes of the normalized text. None: the vocabulary gives no such bound.
        most = self.tokenizer.max_token_bytes
        self.max_prompt_bytes = None if most is None else NORMALIZATION_SHRINK * most * self.max_context_tokens

    @property
    def experts(self) -> ExpertBackend:
        return self.runner.model.experts

    @property
    def vocab_size(self) -> int:
        return self.runner.cfg.vocab_size

    def text_prompt_ids(self, text: str) -> list[int]:
        """Refuses text too long to fit before tokenizing it (seconds for megabytes)."""
        if self.max_prompt_bytes is not None and (size := len(text.encode())) > self.max_prompt_bytes:
            raise ValueError(f"This model's maximum context length is {self.max_context_tokens} tokens. However, "
                             f"the prompt has {size} bytes, more than {self.max_context_tokens} tokens of this "
                             f"vocabulary can hold ({self.max_prompt_bytes} bytes). "
                             "Please reduce the length of the messages.")
        return self.tokenizer.encode(text)

    def chat_prompt_ids(self, messages: list[dict], add_generation_prompt: bool,
                        template_kwargs: Mapping[str, Any] | None = None, tools: list | None = None) -> list[int]:
        """`template_kwargs`: extra template variables (vLLM's chat_template_kwargs); `tools`: OpenAI's
        tool definitions, which the template renders."""
        return self.text_prompt_ids(self.chat_text(messages, add_generation_prompt, template_kwargs, tools))

    def chat_text(self, messages: list[dict], add_generation_prompt: bool,
                  template_kwargs: Mapping[str, Any] | None = None, tools: list | None = None) -> str:
        """The messages (and tool definitions) rendered by the model's chat template."""
        extra = dict(template_kwargs or {})
        if reserved := sorted(TEMPLATE_VARIABLES & extra.keys()):
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        return self.template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **extra)

    def check_prompt(self, ids: list[int], max_tokens: int = 0) -> None:
        """`max_tokens`: what the request asks to generate (0: whatever the context leaves)."""
        if not ids:
            raise ValueError("the prompt is empty")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.vocab_size})")
        context, prompt = self.max_context_tokens, len(ids)
        if prompt >= context:
            raise ValueError(f"This model's maximum context length is {context} tokens. However, you requested "
                             f"{prompt} tokens in the messages. Please reduce the length of the messages.")
        if prompt + max_tokens > context:  # vLLM's words
            raise ValueError(f"This model's maximum context length is {context} tokens. However, you requested "
                             f"{prompt + max_tokens} tokens ({prompt} in the messages, {max_tokens} in the "
                             "completion). Please reduce the length of the messages or completion.")

    def new_request(self, request_id: str, prompt_ids: list[int], options: SamplingOptions, sink: OutputSink,
                    chat: bool = False, reasoning_inline: bool = False,
                    grammar: Grammar | None = None, tool_calling: ToolCalling | None = None,
                    lora_name: str = "") -> GenerationRequest:
        """`chat`: the prompt came from the chat template, so the reply's reasoning is parsed out
        (unless it is asked inline, here or in the settings); `tool_calling`: its tool calls too;
        `lora_name`: a loaded LoRA adapter's name ("": the base model)."""
        self.check_prompt(prompt_ids, options.max_tokens)
        lora = self.lora(lora_name)
        if options.num_experts_per_token:
            check_experts_per_token(options.num_experts_per_token, self.runner.cfg)
        inline = reasoning_inline or self.settings.reasoning_format == "none"
        return GenerationRequest(
            request_id=request_id,
            seq=Sequence(next(self._seq_ids), list(prompt_ids), num_experts_per_token=options.num_experts_per_token,
                         lora=lora),
            options=options,
            sampler=RequestSampler(options, self.vocab_size, prompt_ids,
                                   frozenset() if options.ignore_eos else self.tokenizer.stop_ids),
            detokenizer=self._output_text(options, prompt_ids, chat, inline, tool_calling),
            sink=sink,
            stop_ids=self.tokenizer.stop_ids,
            max_context_tokens=self.max_context_tokens,
            grammar=grammar,
        )

    def lora(self, name: str) -> AdapterWeights | None:
        """The adapter a request names; ValueError (INVALID_ARGUMENT) for a name not loaded."""
        if not name or name == self.model_id:
            return None
        if self.adapters is None:
            raise UnknownLora(f"The model `{name}` does not exist.")
        return self.adapters.get(name)

    def _output_text(self, options: SamplingOptions, prompt_ids: list[int], chat: bool, inline: bool,
                     tool_calling: ToolCalling | None):
        parse_calls = chat and tool_calling is not None and (self.tool_format is not None or tool_calling.mode != "auto")
        # Forced replies (named, required) are plain JSON: only the model's own syntax needs its markers.
        markup = self.tool_format.markers if parse_calls and tool_calling.mode == "auto" else None
        text = output_text(self.tokenizer, options.stop, self.reasoning, prompt_ids, parse=chat, inline=inline,
                           tool_markup=markup)
        if not parse_calls:
            return text
        fmt = self.tool_format or ToolFormat("", {})
        return ToolCallText(text, fmt.parser(tool_calling), tool_calling.single)


def load_serving_model(settings: AttentionSettings, experts: ExpertBackend | None = None) -> ServingModel:
    options = settings.runner
    before = resident()
    g = GGUFFile(settings.model_path)
    mtp = settings.speculation.method == "mtp"
    runner = ModelRunner.from_gguf(g, options, experts or build_expert_backend(g, settings, nextn=mtp))
    scheduler = Scheduler(runner.blocks, settings.max_batch_tokens, settings.max_running_seqs,
                          settings.max_waiting_requests)
    drafter = None
    if settings.speculation.method == "draft":
        from splitmoe.attention_service.engine.draft_model import DraftModelDrafter

        drafter = DraftModelDrafter(settings.speculation.draft_model, options, runner.cfg.vocab_size)
    elif mtp:
        from splitmoe.attention_service.engine.mtp import MTPDrafter

        drafter = MTPDrafter(runner)
    engine = Engine(runner, scheduler, classify_error, settings.speculation, drafter)
    tokenizer = Tokenizer.from_gguf_metadata(runner.gguf.metadata)
    model = ServingModel(
        settings=settings, runner=runner, engine=engine, tokenizer=tokenizer,
        template=ChatTemplate.from_gguf_metadata(runner.gguf.metadata, tokenizer),
        model_id=settings.served_model_name or model_stem(settings.model_path),
        max_context_tokens=min(runner.cfg.context_tokens, options.kv_cache_tokens),
        reasoning=(reasoning := detect_reasoning_format(tokenizer)),
        tool_format=detect_tool_format(tokenizer, runner.gguf.metadata.get("tokenizer.chat_template") or "",
                                       reasoning, settings.tool_call_parser),
        grammars=GrammarCompiler(tokenizer, runner.cfg.vocab_size),
    )
    backend = runner.model.experts
    model.adapters = LoraAdapters(g, model.model_id, settings.lora_settings,
                                  remote_experts=not getattr(backend, "takes_lora", False),
                                  prepare_experts=getattr(backend, "prepare_lora", None))
    log.info("model %s loaded: %s, %d layers, dtype %s on %s, reasoning format %s (%s), tool calls %s",
             model.model_id, runner.cfg.arch, runner.cfg.num_layers, dtype_name(options.dtype), options.device,
             model.reasoning.name if model.reasoning else "none", settings.reasoning_format,
             model.tool_format.name if model.tool_format else "none")
    kv = runner.kv
    log.info("KV cache: %d tokens over all sequences, stored as %s, %d bytes a token (%.0f MiB full)",
             runner.blocks.pool.num_blocks * kv.kv_block_tokens, kv.format.name, kv.bytes_per_token, kv.reserved_bytes / MIB)
    log_memory(runner, before)
    return model


def log_memory(runner: ModelRunner, before: Resident | None) -> None:
    """What the load cost in memory: the file is mapped; what the load added of the process's own
    pages is the dequantized copies (float32 norms and router, dense copies of types without a
    native kernel) and the buffers; the KV cache is reserved and filled as it is used."""
    device = runner.device_memory()
    if device is not None:
        log.info("GPU memory after load: %s", device.describe())
    after = resident()
    kv_bytes = runner.kv.reserved_bytes
    if after is None or before is None:
        log.info("KV cache: %.0f MiB reserved", kv_bytes / MIB)
        return
    log.info("memory after load: %s; the load added %.0f MiB of own memory (packed and dequantized copies, buffers); "
             "KV cache %.0f MiB reserved, filled as used", after.describe(),
             (after.own_bytes - before.own_bytes) / MIB, kv_bytes / MIB)


def build_expert_backend(g: GGUFFile, settings: AttentionSettings, nextn: bool = False) -> ExpertBackend:
    """`nextn`: the NextN/MTP layers' experts too (--speculative mtp drafts with them)."""
    cache = RepackCache(repack_cache_dir())
    if settings.experts is None:
        backend = InProcessExperts(g, cache, nextn=nextn)
    else:
        backend = RemoteExperts(g, dataclasses.replace(settings.experts, nextn_layers=nextn), cache)
    return with_gpu_experts(g, backend, settings) if settings.gpu_experts else backend


def with_gpu_experts(g: GGUFFile, backend: ExpertBackend, settings: AttentionSettings) -> ExpertBackend:
    """`backend` with the hottest experts (--gpu-experts) computed in GPU memory (expert_backends/gpu_hot.py)."""
    heat_file = settings.experts.heat_file if settings.experts is not None else ""
    num_layers, num_experts = ModelConfig.from_gguf(g).num_blocks, expert_count(g)
    rates = load_heat(heat_file, g.file_id, (num_layers, num_experts)) if heat_file else None
    keys = choose_gpu_experts(g, settings.gpu_experts, rates)
    if not keys:
        log.warning("--gpu-experts: no expert fits the budget; every routed expert stays on the CPU")
        return backend
    device = DeviceExperts(g, keys, settings.runner.device)
    return GpuHotExperts(backend, device, num_layers, num_experts)
