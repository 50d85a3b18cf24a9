"""The attention service's gRPC surface: Generate, Score, Tokenize, Detokenize, ModelInfo, GetStats, Rebalance and grpc.health.v1.

The server answers at once and loads the model in the background: until it is ready, health is
NOT_SERVING, ModelInfo says `ready: false` and other calls get UNAVAILABLE. Handlers convert
messages to our own types and back; the engine never sees a protobuf.
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from opentelemetry import trace

from splitmoe.attention_service.engine.grammar import Grammar, StructuredOutput
from splitmoe.attention_service.engine.request import RequestOutput
from splitmoe.attention_service.engine.sampling import MAX_TOP_LOGPROBS, SamplingOptions
from splitmoe.attention_service.engine.scheduler import QueueFull
from splitmoe.attention_service.engine.tool_calls import ToolCalling, string_parameters
from splitmoe.attention_service.expert_backends.backend import ExpertBackend
from splitmoe.attention_service.expert_backends.placement import ExpertsUnavailable
from splitmoe.attention_service.lora_adapters import LoraLimit, UnknownLora
from splitmoe.attention_service.model.runner import dtype_name
from splitmoe.attention_service.service import ServingModel, classify_error, load_serving_model
from splitmoe.attention_service.settings import AttentionSettings
from splitmoe.modelfile.expert_tensors import ExpertKey
from splitmoe.proto import attention_pb2 as pb
from splitmoe.proto import attention_pb2_grpc
from splitmoe.runtime.heap import freeze_startup_heap
from splitmoe.runtime.telemetry import extract_grpc_context, tracer

log = logging.getLogger(__name__)
_tracer = tracer("splitmoe.attention")
SERVICE_NAME = "splitmoe.v1.AttentionService"
_ERROR_CODES = {"unavailable": grpc.StatusCode.UNAVAILABLE, "internal": grpc.StatusCode.INTERNAL}
PROMPT_THREADS = 4


# Options whose zero on the wire stands for "not sent" (proto3 cannot tell the two apart), so they take
# SamplingOptions' default; every other zero is meant (temperature 0: greedy).
ZERO_IS_UNSET = frozenset({"top_p", "repetition_penalty"})


def sampling_options(p: pb.SamplingParams, context_left: int) -> SamplingOptions:
    """The message's fields by name as SamplingOptions, which gives them meaning. `context_left`: the
    tokens the context has after the prompt, what max_tokens 0 asks for."""
    sent = {}
    for f in p.DESCRIPTOR.fields:
        value = getattr(p, f.name)
        if (f.has_presence and not p.HasField(f.name)) or (f.name in ZERO_IS_UNSET and not value):
            continue
        sent[f.name] = _field_value(f, value)
    sent["max_tokens"] = p.max_tokens if p.max_tokens > 0 else context_left
    sent["logprobs"] = p.logprobs or p.top_logprobs > 0  # top logprobs come with the sampled token's
    return SamplingOptions(**sent)


def _field_value(field, value):
    """A repeated field as a tuple, a map as sorted (key, value) pairs: SamplingOptions is frozen."""
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        return tuple(sorted(value.items()))
    return tuple(value) if field.is_repeated else value


def prompt_ids(model: ServingModel, request: pb.GenerateRequest | pb.ScoreRequest) -> list[int]:
    """The request's prompt as checked token ids; raises ValueError for the caller's mistakes."""
    kind = request.WhichOneof("prompt")
    if kind == "text":
        ids = model.text_prompt_ids(request.text)
    elif kind == "token_ids":
        ids = list(request.token_ids.ids)
    elif kind == "chat":
        ids = model.chat_prompt_ids([_chat_message(m) for m in request.chat.messages],
                                    request.chat.add_generation_prompt, _template_kwargs(request.chat),
                                    _tools(request.chat))
    else:
        raise ValueError("the request has no prompt")
    model.check_prompt(ids)
    return ids


_STRUCTURED_KINDS = {pb.StructuredOutput.JSON_OBJECT: "json_object", pb.StructuredOutput.JSON_SCHEMA: "json_schema"}


def structured_output(request: pb.GenerateRequest) -> StructuredOutput | None:
    s = request.structured_output
    if s.kind == pb.StructuredOutput.KIND_UNSPECIFIED:
        return None
    if s.kind not in _STRUCTURED_KINDS:
        raise ValueError(f"unknown structured output kind {s.kind}")
    return StructuredOutput(_STRUCTURED_KINDS[s.kind], s.json_schema)


def compile_grammar(model: ServingModel, request: pb.GenerateRequest) -> Grammar | None:
    """The request's structured output as a matcher; ValueError when the schema cannot be used."""
    constraint = structured_output(request)
    return None if constraint is None else model.grammars.compile(constraint)


def tokenize(model: ServingModel, request: pb.TokenizeRequest) -> list[int]:
    """Text, or a chat rendered by the template, as the tokenizer splits it; raises ValueError for the caller's
    mistakes. `add_special_tokens` adds the tokenizer's BOS (or EOS) unless the text already has it."""
    kind = request.WhichOneof("prompt")
    if kind == "text":
        text = request.text
    elif kind == "chat":
        text = model.chat_text([_chat_message(m) for m in request.chat.messages], request.chat.add_generation_prompt,
                               _template_kwargs(request.chat))
    else:
        raise ValueError("the request has no prompt")
    return model.tokenizer.encode(text, add_special_tokens=request.add_special_tokens)


def _chat_message(m: pb.ChatMessage) -> dict:
    """As transformers' callers pass a message; a call's arguments parsed into an object, as vLLM
    does before rendering (templates write them with `tojson`)."""
    message = {"role": m.role, "content": m.content}
    if m.name:
        message["name"] = m.name
    if m.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": _json(c.arguments, "tool_calls arguments")}}
                                 for c in m.tool_calls]
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    return message


def _tools(chat: pb.ChatPrompt) -> list | None:
    if not chat.tools:
        return None
    tools = _json(chat.tools, "tools")
    if not isinstance(tools, list):
        raise ValueError("tools must be a JSON array")
    return tools


def _json(text: str, what: str):
    try:
        return json.loads(text)  # a JSONDecodeError is a ValueError: the caller's mistake
    except RecursionError:
        raise ValueError(f"{what} is nested too deeply") from None


_TOOL_MODES = {pb.ToolCalling.AUTO: "auto", pb.ToolCalling.NAMED: "named", pb.ToolCalling.REQUIRED: "required"}


def tool_calling(request: pb.GenerateRequest) -> ToolCalling | None:
    t = request.tool_calling
    if t.mode == pb.ToolCalling.OFF:
        return None
    if t.mode == pb.ToolCalling.NAMED and not t.function:
        raise ValueError("tool_calling NAMED needs a function")
    tools = _tools(request.chat) if request.WhichOneof("prompt") == "chat" else None
    return ToolCalling(_TOOL_MODES[t.mode], t.function, t.single, string_parameters(tools or []))


def _template_kwargs(chat: pb.ChatPrompt) -> dict:
    if not chat.template_kwargs:
        return {}
    try:
        kwargs = json.loads(chat.template_kwargs)  # a JSONDecodeError is a ValueError: the caller's mistake
    except RecursionError:
        raise ValueError("chat_template_kwargs is nested too deeply") from None
    if not isinstance(kwargs, dict):
        raise ValueError("chat_template_kwargs must be a JSON object")
    return kwargs


class LoopMailbox:
    """Hands the engine thread's outputs to the event loop, one wake-up for all that arrive
    together: a decode step's outputs of every stream then cost the loop one self-pipe write
    and one callback, not one of each per stream."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, RequestOutput]] = []

    def post(self, queue: asyncio.Queue, output: RequestOutput) -> None:
        with self._lock:
            self._pending.append((queue, output))
            if len(self._pending) > 1:
                return  # a wake-up is on its way and takes this one too
        self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for queue, output in pending:
            queue.put_nowait(output)


class AttentionServicer(attention_pb2_grpc.AttentionServiceServicer):
    def __init__(self):
        self.model: ServingModel | None = None
        self.load_failure: Exception | None = None
        # Rendering and tokenizing a prompt take seconds for megabytes: never on the event loop, and on
        # threads of their own, so that GetStats' thread never waits behind them.
        self._prompts = ThreadPoolExecutor(max_workers=PROMPT_THREADS, thread_name_prefix="prompt")
        self._mailbox: LoopMailbox | None = None  # made on the serving loop, at the first request

    async def _ready(self, context: grpc.aio.ServicerContext) -> ServingModel:
        if self.model is None:
            failure = self.load_failure
            detail = f"model failed to load: {failure}" if failure is not None else "the model is still loading"
            await context.abort(grpc.StatusCode.UNAVAILABLE, detail)
        return self.model

    async def _prompt_ids(self, model: ServingModel, request, context) -> list[int]:
        return await self._off_loop(prompt_ids, model, request, context)

    async def _off_loop(self, convert, model: ServingModel, request, context):
        """`convert(model, request)` on the prompt threads; its ValueError is the caller's INVALID_ARGUMENT."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._prompts, convert, model, request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator[pb.GenerateResponse]:
        model = await self._ready(context)
        ids = await self._prompt_ids(model, request, context)
        grammar = await self._off_loop(compile_grammar, model, request, context)
        request_id = request.request_id or uuid.uuid4().hex
        parent = extract_grpc_context(context.invocation_metadata())
        with _tracer.start_as_current_span("attention.generate", context=parent) as span:
            span.set_attribute("splitmoe.request_id", request_id)
            span.set_attribute("splitmoe.prompt_tokens", len(ids))
            async for response in self._generate(model, request_id, ids, grammar, request, context):
                yield response

    async def _generate(self, model: ServingModel, request_id: str, ids: list[int], grammar: Grammar | None,
                        request: pb.GenerateRequest, context):
        try:
            options = sampling_options(request.sampling, model.max_context_tokens - len(ids))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if self._mailbox is None:
            self._mailbox = LoopMailbox(asyncio.get_running_loop())
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        try:
            gen_request = model.new_request(request_id, ids, options, functools.partial(self._mailbox.post, outputs),
                                            chat=request.WhichOneof("prompt") == "chat",
                                            reasoning_inline=request.reasoning_inline, grammar=grammar,
                                            tool_calling=tool_calling(request), lora_name=request.lora_name)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        gen_request.trace_context = trace.get_current_span().get_span_context()
        try:
            model.engine.submit(gen_request)
        except QueueFull as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                if out.error:
                    finished = True
                    await context.abort(_ERROR_CODES.get(out.error_kind, grpc.StatusCode.INTERNAL), out.error)
                finished = out.finished
                yield self._response(model, out)
        finally:
            if not finished:  # the client went away: stop computing for it
                model.engine.abort(request_id)

    def _response(self, model: ServingModel, out: RequestOutput) -> pb.GenerateResponse:
        response = pb.GenerateResponse(text=out.text, reasoning_text=out.reasoning_text,
                                       finish_reason=out.finish_reason,
                                       tool_calls=[pb.ToolCallDelta(index=c.index, id=c.id, name=c.name,
                                                                    arguments=c.arguments) for c in out.tool_calls],
                                       tokens=[_token_out(model, t.token_id, t.logprob, t.top) for t in out.tokens])
        if out.finished:
            response.usage.prompt_tokens = out.num_prompt_tokens
            response.usage.completion_tokens = out.num_output_tokens
        return response

    async def Score(self, request: pb.ScoreRequest, context) -> pb.ScoreResponse:
        model = await self._ready(context)
        ids = await self._prompt_ids(model, request, context)
        if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        try:
            lora = model.lora(request.lora_name)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        parent = extract_grpc_context(context.invocation_metadata())
        with _tracer.start_as_current_span("attention.score", context=parent):
            try:
                result = await asyncio.wrap_future(model.engine.score(ids, request.top_logprobs, lora))
            except Exception as e:  # noqa: BLE001 - surfaced to the client as a status
                await context.abort(_ERROR_CODES[classify_error(e)], str(e))
        tokens = []
        for token_id, logprob, top in zip(result.token_ids, result.logprobs, result.top):
            tokens.append(_token_out(model, token_id, 0.0 if logprob is None else logprob, top))
        return pb.ScoreResponse(tokens=tokens, usage=pb.Usage(prompt_tokens=len(ids)),
                                text=model.tokenizer.decode(ids))

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        """The tokenizer alone: no context check, so that a client can measure a prompt too long to run."""
        model = await self._ready(context)
        try:
            ids = await asyncio.get_running_loop().run_in_executor(self._prompts, tokenize, model, request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.TokenizeResponse(ids=ids, token_strs=[model.tokenizer.token_text(i) for i in ids],
                                   context_tokens=model.max_context_tokens)

    async def Detokenize(self, request: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        model = await self._ready(context)
        if any(not 0 <= i < model.vocab_size for i in request.ids):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"tokens: token ids must lie in [0, {model.vocab_size})")
        return pb.DetokenizeResponse(text=model.tokenizer.decode(request.ids))

    async def ModelInfo(self, request, context) -> pb.ModelInfoResponse:
        m = self.model
        if m is None:
            return pb.ModelInfoResponse(ready=False)
        adapters = m.adapters.listed() if m.adapters else []
        return pb.ModelInfoResponse(model_id=m.model_id, arch=m.runner.cfg.arch,
                                    context_tokens=m.max_context_tokens, vocab_size=m.vocab_size, ready=True,
                                    dtype=dtype_name(m.runner.options.dtype), device=str(m.runner.options.device),
                                    lora_adapters=[pb.LoraAdapterInfo(name=a.name, path=a.path, rank=a.rank)
                                                   for a in adapters])

    async def LoadLoraAdapter(self, request: pb.LoadLoraAdapterRequest, context) -> pb.LoraAdapterResponse:
        """vLLM's /v1/load_lora_adapter: read and check the file (off the event loop), then serve it."""
        m = await self._ready(context)
        try:
            await asyncio.get_running_loop().run_in_executor(self._prompts, m.adapters.load, request.lora_name,
                                                             request.lora_path)
        except LoraLimit as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.LoraAdapterResponse(message=f"Success: LoRA adapter '{request.lora_name}' added successfully.")

    async def UnloadLoraAdapter(self, request: pb.UnloadLoraAdapterRequest, context) -> pb.LoraAdapterResponse:
        m = await self._ready(context)
        try:
            m.adapters.unload(request.lora_name)
        except UnknownLora as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        return pb.LoraAdapterResponse(message=f"Success: LoRA adapter '{request.lora_name}' removed successfully.")

    async def Rebalance(self, request: pb.RebalanceRequest, context) -> pb.RebalanceResponse:
        m = await self._ready(context)
        if not hasattr(m.experts, "rebalance"):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "no expert services: every expert runs in the attention process")
        try:
            return await asyncio.to_thread(_rebalance, m, request.dry_run)
        except ExpertsUnavailable as e:  # the old placement keeps serving
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    async def JoinExperts(self, request: pb.JoinExpertsRequest, context) -> pb.JoinExpertsResponse:
        m = await self._ready(context)
        if not hasattr(m.experts, "announce"):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "no expert services: every expert runs in the attention process")
        try:
            address, server_name = joining_address(request.address, context.peer())
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        member, message = m.experts.announce(address, server_name, request.instance_id)
        return pb.JoinExpertsResponse(member=member, message=message)

    async def GetStats(self, request, context) -> pb.AttentionStats:
        m = await self._ready(context)
        running, waiting = m.engine.num_running_waiting()
        blocks = m.runner.blocks
        stats = pb.AttentionStats(
            num_running=running, num_waiting=waiting,
            kv_cache_usage=1.0 - blocks.num_free_blocks / blocks.pool.num_blocks,
            num_steps=m.engine.stats.num_steps, max_batch_seqs_seen=m.engine.stats.max_batch_seqs,
            max_batch_tokens_seen=m.engine.stats.max_batch_tokens,
            prefix_cache_queries=blocks.prefix_stats.queries, prefix_cache_hits=blocks.prefix_stats.hits,
            spec_num_drafts=m.engine.spec_stats.num_drafts, spec_num_draft_tokens=m.engine.spec_stats.num_draft_tokens,
            spec_num_accepted_tokens=m.engine.spec_stats.num_accepted_tokens,
            spec_accepted_per_position=list(m.engine.spec_stats.accepted_per_position),
            kv_cache_tokens=blocks.pool.num_blocks * blocks.kv_block_tokens, kv_cache_dtype=m.runner.kv.format.name,
            kv_cache_bytes_per_token=m.runner.kv.bytes_per_token,
            device=str(m.runner.options.device))
        _add_device_memory(stats, m)
        await asyncio.to_thread(_add_expert_stats, stats, m)
        return stats


def joining_address(announced: str, peer: str) -> tuple[str, str]:
    """(address to dial, TLS server name) of a JoinExperts caller: its announced host:port, or
    with no host (':port') the IP it called from, as gRPC names the peer ('ipv4:10.0.0.7:51234',
    'ipv6:[fd00::7]:51234')."""
    host, sep, port = announced.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"JoinExperts address {announced!r}: want host:port or :port")
    if host:
        return announced, host.strip("[]")
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        raise ValueError(f"JoinExperts from {peer!r}: announce host:port (--advertise), the caller's IP is unknown")
    ip = rest.rpartition(":")[0]
    return f"{ip}:{port}", ip.strip("[]")


def _add_device_memory(stats: pb.AttentionStats, model: ServingModel) -> None:
    """On a GPU: its name and what its memory holds, by use (gpu/memory.py)."""
    memory = model.runner.device_memory()
    if memory is not None:
        stats.device = memory.device
        for kind, num_bytes in memory.by_kind.items():
            stats.device_memory.add(kind=kind, bytes=num_bytes)


def _add_expert_stats(stats: pb.AttentionStats, model: ServingModel) -> None:
    """Per expert service health and hop figures, and tokens per expert (may ask the services)."""
    hops = model.experts.stats()
    for address, health in model.experts.health().items():
        h = hops.get(address)
        stats.hops.add(expert_address=address, healthy=health.healthy, num_hops=h.num_hops if h else 0,
                       hop_s_total=h.hop_s_total if h else 0.0, compute_s_total=h.compute_s_total if h else 0.0,
                       bytes_total=(h.sent_bytes + h.received_bytes) if h else 0,
                       overhead_us_median=h.overhead_us_median if h else 0.0,
                       overhead_us_mean=h.overhead_us_mean if h else 0.0, transport=health.transport,
                       last_error="" if health.healthy else health.last_error)
    stats.uncovered_layers.extend(model.experts.uncovered_layers())
    for key, tokens in sorted(model.experts.expert_token_counts().items()):
        stats.expert_tokens.add(layer=key.layer, expert=key.expert, tokens=tokens)
    _add_heat(stats, model.experts)


def _add_heat(stats: pb.AttentionStats, experts: ExpertBackend) -> None:
    """Every routed (layer, expert): its tokens, decayed rate and where it is computed now."""
    heat = experts.expert_heat()
    view = experts.placement_view()
    for layer, row in enumerate(heat.tokens_per_s.tolist()):
        tokens = heat.tokens[layer].tolist()
        for expert, rate in enumerate(row):
            placed = view.get(ExpertKey(layer, expert), ("local",) if not view else ())
            if tokens[expert] or placed:
                stats.expert_heat.add(layer=layer, expert=expert, tokens=tokens[expert], tokens_per_s=rate,
                                      placed_on=placed)
    busiest, mean, _ = experts.imbalance_meter()
    stats.expert_imbalance = busiest / mean if mean > 0 else 0.0


def _rebalance(model: ServingModel, dry_run: bool) -> pb.RebalanceResponse:
    report = model.experts.rebalance(dry_run=dry_run)
    return pb.RebalanceResponse(changed=report.changed, imbalance_before=report.imbalance_before,
                                imbalance_after=report.imbalance_after, num_local=report.num_hot,
                                num_loaded=report.num_loaded, seconds=report.seconds, reason=report.reason)


def _top(model: ServingModel, token_id: int, logprob: float) -> pb.TopLogprob:
    t = model.tokenizer
    return pb.TopLogprob(token_id=token_id, token=t.decode([token_id]), logprob=logprob,
                         token_bytes=t.token_bytes(token_id))


def _token_out(model: ServingModel, token_id: int, logprob: float, top) -> pb.TokenOut:
    t = model.tokenizer
    return pb.TokenOut(token_id=token_id, token=t.decode([token_id]), logprob=logprob,
                       token_bytes=t.token_bytes(token_id), top=[_top(model, i, lp) for i, lp in top])


async def serve(settings: AttentionSettings, ready: asyncio.Event | None = None,
                external_stop: threading.Event | None = None, freeze_heap: bool = False) -> None:
    """Run until SIGTERM/SIGINT (or `external_stop`, for servers run in a thread); in-flight requests
    are drained for up to the grace period. `freeze_heap`: the loaded model's Python objects out of
    the garbage collector's walks (runtime/heap.py), for a process that serves nothing else."""
    security = settings.security
    server = grpc.aio.server(options=[("grpc.max_send_message_length", 256 << 20),
                                      ("grpc.max_receive_message_length", 256 << 20)],
                             interceptors=security.aio_server_interceptors())
    servicer = AttentionServicer()
    attention_pb2_grpc.add_AttentionServiceServicer_to_server(servicer, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    await _set_health(health, health_pb2.HealthCheckResponse.NOT_SERVING)
    address = f"{settings.host}:{settings.port}"
    if security.add_port(server, address) == 0:
        raise OSError(f"cannot listen on {address}")
    await server.start()
    log.log(logging.INFO if security.token else logging.WARNING, "attention service listening on %s (%s), loading %s",
            address, security.describe_server(), settings.model_path)
    stop = _stop_event()
    if external_stop is not None:
        loop = asyncio.get_running_loop()
        loop.run_in_executor(None, lambda: (external_stop.wait(), loop.call_soon_threadsafe(stop.set)))
    loader = asyncio.create_task(_load(servicer, health, settings, stop, freeze_heap))
    if ready is not None:
        loader.add_done_callback(lambda _: ready.set())
    await stop.wait()
    log.info("attention service shutting down")
    await server.stop(grace=5.0)
    if servicer.model is not None:
        servicer.model.engine.stop()
        servicer.model.experts.close()
    elif servicer.load_failure is not None:
        raise servicer.load_failure  # the command's one line and exit code, as any command's


async def _load(servicer: AttentionServicer, health, settings: AttentionSettings, stop: asyncio.Event,
                freeze_heap: bool = False) -> None:
    started = time.monotonic()
    try:
        model = await asyncio.to_thread(load_serving_model, settings)
    except Exception as e:  # noqa: BLE001 - serve() raises it once the server stopped: the process exits
        servicer.load_failure = e
        log.debug("model failed to load", exc_info=True)
        stop.set()
        return
    if freeze_heap:
        freeze_startup_heap()
    model.engine.start()
    servicer.model = model
    await _set_health(health, health_pb2.HealthCheckResponse.SERVING)
    log.info("attention service ready in %.1f s", time.monotonic() - started)


async def _set_health(health, status) -> None:
    await health.set("", status)
    await health.set(SERVICE_NAME, status)


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests): no signals
            pass
    return stop
