"""The engine: one thread that owns the model and runs steps while there is work.

Each step is four calls, as in nano-vllm: schedule, run the model, sample, hand out what finished.
Other threads talk to it only through `submit`, `abort` and `score`, which post commands to an
inbox under a lock; outputs leave through each request's sink. A failing step (an expert service
gone, say) fails only the requests in that step, and the engine goes on serving.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import torch
from opentelemetry import trace

from splitmoe.attention_service.engine.request import GenerationRequest, RequestOutput
from splitmoe.attention_service.engine.sampling import Sampled
from splitmoe.attention_service.engine.scheduler import QueueFull, ScheduledStep, Scheduler
from splitmoe.attention_service.engine.speculation import (
    Drafter,
    DrafterCost,
    SpeculationSettings,
    SpeculationStats,
    ngram_drafter,
)
from splitmoe.attention_service.engine.token_mask import TokenMasks
from splitmoe.attention_service.model.runner import ModelRunner
from splitmoe.attention_service.model.sequence import Sequence
from splitmoe.kernels import native

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("splitmoe.attention.engine")
PREFIX_LOG_INTERVAL_S = 10.0


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    token_ids: list[int]
    logprobs: list[float | None]  # None for the first token
    top: list[list[tuple[int, float]]]


@dataclass
class EngineStats:
    num_steps: int = 0
    max_batch_seqs: int = 0
    max_batch_tokens: int = 0


class Engine:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, classify_error: Callable[[Exception], str],
                 speculation: SpeculationSettings = SpeculationSettings(), drafter: Drafter | None = None):
        self.runner = runner
        self.scheduler = scheduler
        self.speculation = speculation
        self.drafter = drafter or ngram_drafter(speculation)  # proposes each request's next tokens
        self.stats = EngineStats()
        self.spec_stats = SpeculationStats()
        self.drafter_cost = DrafterCost()  # added to each drafted token's verification cost
        self.token_masks = TokenMasks(runner.cfg.vocab_size)
        self._classify_error = classify_error
        self._lock = threading.Condition()
        self._inbox: list[Callable[[], None]] = []
        self._num_queued = 0
        self._stopping = False
        self._logged_queries, self._logged_s = 0, 0.0  # the prefix cache's figures last logged
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    # ---- called from other threads ------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify()
        self._thread.join(timeout=10)

    def submit(self, request: GenerationRequest) -> None:
        """Queue a request; raises QueueFull at once when the waiting queue is full."""
        with self._lock:
            if len(self.scheduler.waiting) + self._num_queued >= self.scheduler.max_waiting:
                raise QueueFull(f"the request queue is full ({self.scheduler.max_waiting} waiting)")
            self._num_queued += 1
            self._post(lambda: self._add(request))

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._post(lambda: self._remove(request_id))

    def score(self, token_ids: list[int], top_logprobs: int, lora=None) -> Future:
        """Prompt logprobs, computed between steps; resolves to PromptLogprobs. `lora`: the adapter
        (model/lora.py AdapterWeights) the prompt is scored with; None: the base."""
        future: Future = Future()
        with self._lock:
            self._post(lambda: self._score(token_ids, top_logprobs, future, lora))
        return future

    def num_running_waiting(self) -> tuple[int, int]:
        with self._lock:
            return len(self.scheduler.running), len(self.scheduler.waiting) + self._num_queued

    # ---- the engine thread ---------------------------------------------------------------------

    def _post(self, command: Callable[[], None]) -> None:
        self._inbox.append(command)
        self._lock.notify()

    def _run(self) -> None:
        native.pin_caller()  # the steps call the native pool: on its first CPU (--pin-threads)
        while True:
            with self._lock:
                while not self._inbox and not self.scheduler.has_work() and not self._stopping:
                    self._lock.wait()
                if self._stopping:
                    return
                commands, self._inbox = self._inbox, []
                for command in commands:
                    command()
            self._propose_drafts()
            step = self.scheduler.schedule()
            if step is not None:
                self._run_step(step)
            self._log_prefix_cache(idle=not self.scheduler.has_work())

    def _add(self, request: GenerationRequest) -> None:
        self._num_queued -= 1
        self.scheduler.add(request)  # `submit` counted it against the queue's limit already

    def _remove(self, request_id: str) -> None:
        request = self.scheduler.remove(request_id)
        if request is not None:
            self.drafter.release(request.seq.seq_id)

    def _run_step(self, step: ScheduledStep) -> None:
        # A decoding request may carry drafts (speculation.py): they join its tokens for this one
        # pass, and the sampling below keeps what it accepts of them.
        drafts = [r.draft for r in step.requests]
        speculating = any(drafts)
        for request, draft in zip(step.requests, drafts):
            request.seq.token_ids.extend(draft)
            request.draft = []
        with _step_span(step, drafts) as span:
            try:
                # drafts: every drafted row's logits, and the blocks named once the drafts are checked
                verifying = dict(logits_tokens=[1 + len(d) for d in drafts], commit=False) if speculating else {}
                started = time.perf_counter()
                logits = self.runner.step([r.seq for r in step.requests], step.num_new_tokens, **verifying)
                if all(n == 1 + len(d) for n, d in zip(step.num_new_tokens, drafts)):  # decoding only
                    self.drafter_cost.add_step(time.perf_counter() - started, len(drafts), sum(map(len, drafts)),
                                               self.speculation.draft_token_cost)
            except Exception as e:  # noqa: BLE001 - any failure ends this step's requests, not the engine
                span.record_exception(e)
                span.set_status(trace.Status(trace.StatusCode.ERROR, str(e)))
                for request, draft in zip(step.requests, drafts):
                    del request.seq.token_ids[request.seq.num_tokens - len(draft):]
                self._fail(step.requests, e)
                return
            self._count(step)
            if speculating:
                accepted_before = self.spec_stats.num_accepted_tokens
                outputs = self._verify(step, drafts, logits.cpu())
                span.set_attribute("splitmoe.num_draft_tokens", sum(map(len, drafts)))
                span.set_attribute("splitmoe.num_accepted_tokens", self.spec_stats.num_accepted_tokens - accepted_before)
            else:
                outputs = self._sample(step, logits)
        # Handed over after the whole step's sampling: the receivers' threads (the serving loop)
        # wake once for the step and do not take the interpreter from the sampling in between.
        for sink, output in outputs:
            sink(output)

    def _sample(self, step: ScheduledStep, logits: torch.Tensor) -> list[tuple[Callable, RequestOutput]]:
        """Each request's next token from its row of `logits`."""
        # A prompt chunk has nothing to sample yet; the others sample, under their grammar if they have one.
        sampling = [i for i, r in enumerate(step.requests) if r.seq.num_cached_tokens >= r.seq.num_tokens]
        greedy, rows, logits = _on_host(logits, [step.requests[i] for i in sampling], sampling)
        masked = self.token_masks.masked_rows(
            logits, [(rows[i], step.requests[i].grammar) for i in rows if step.requests[i].grammar is not None])
        outputs = []
        for i in sampling:
            request = step.requests[i]
            if i in greedy:
                sampled = greedy[i]
            else:
                row = rows[i]
                sampled = request.sampler(masked[row] if row in masked else logits[row])
            output = request.accept(sampled)
            if output.finished:
                self._finish(request)
            outputs.append((request.sink, output))
        return outputs

    # ---- speculative decoding (speculation.py) ---------------------------------------------------

    def _propose_drafts(self) -> None:
        """Drafts for the decoding requests without a grammar, while few enough decode together."""
        spec = self.speculation
        running = self.scheduler.running
        if not spec.enabled or len(running) > spec.max_batch_seqs:
            return
        for request in running:
            seq = request.seq
            if seq.num_tokens - seq.num_cached_tokens != 1 or request.grammar is not None:
                continue  # a grammar's mask of each row would follow the drafts before it: not yet
            # every draft accepted still leaves room for the model's own token after them
            room = min(request.options.max_tokens - request.num_output_tokens,
                       request.max_context_tokens - seq.num_tokens) - 1
            cost = spec.draft_token_cost + self.drafter_cost.steps_per_token
            num_tokens = (0 if room <= 0 else min(spec.num_tokens, room) if spec.fixed_length
                          else request.draft_length.next(min(spec.num_tokens, room), cost))
            if num_tokens:
                try:
                    started = time.perf_counter()
                    request.draft = self.drafter.propose(seq.seq_id, seq.token_ids, num_tokens)
                    self.drafter_cost.add_proposal(time.perf_counter() - started, num_tokens)
                except Exception as e:  # noqa: BLE001 - a drafter's trouble (its KV cache full) costs only the draft
                    log.warning("request %s: no draft this step: %s", request.request_id, e)
                    self.drafter.release(seq.seq_id)

    def _verify(self, step: ScheduledStep, drafts: list[list[int]],
                logits: torch.Tensor) -> list[tuple[Callable, RequestOutput]]:
        """`_sample` for a step in which some requests verify drafts (`logits`: 1 + its draft's
        rows per request): each drafted position's token chosen in order by the request's sampler
        (`verify`: the argmax, or rejection sampling), drafts kept up to the first it did not keep,
        then that token; the sequence cut back to that, and only then its blocks named. Penalties
        and the like see the tokens before each row, as one token at a time."""
        outputs, row = [], 0
        for request, draft in zip(step.requests, drafts):
            seq, rows = request.seq, logits[row:row + 1 + len(draft)]
            row += 1 + len(draft)
            if seq.num_cached_tokens < seq.num_tokens:  # a prompt chunk: nothing to sample yet
                self.runner.commit(seq)
                continue
            del seq.token_ids[seq.num_tokens - len(draft):]
            seq.num_cached_tokens = seq.num_tokens  # the drafts' KV counts once each is accepted
            finished, num_accepted = False, 0
            for j in range(len(draft) + 1):
                sampled = request.sampler.verify(rows[j], draft[j]) if j < len(draft) else request.sampler(rows[j])
                output = request.accept(sampled)
                outputs.append((request.sink, output))
                finished = output.finished
                if finished or j == len(draft) or sampled.token_id != draft[j]:
                    break
                num_accepted += 1
                seq.num_cached_tokens += 1  # the draft's KV was computed for this very token
            if draft:
                self.spec_stats.add(len(draft), num_accepted)
                request.draft_length.update(len(draft), num_accepted)
            self.runner.commit(seq)
            if finished:
                self._finish(request)
        return outputs

    def _finish(self, request: GenerationRequest) -> None:
        with self._lock:
            self.scheduler.remove(request.request_id)
        self.drafter.release(request.seq.seq_id)

    def _fail(self, requests: list[GenerationRequest], error: Exception) -> None:
        kind = self._classify_error(error)
        if kind == "internal":
            log.exception("engine step failed", exc_info=error)
        else:
            log.warning("engine step failed: %s", error)
        for request in requests:
            self._finish(request)
            request.sink(RequestOutput(request.request_id, error=str(error), error_kind=kind,
                                       num_prompt_tokens=request.num_prompt_tokens))

    def _log_prefix_cache(self, idle: bool) -> None:
        """The prefix cache's hit rate, when it changed: every PREFIX_LOG_INTERVAL_S while busy, and
        when the engine runs out of work."""
        blocks = self.scheduler.blocks  # the runner's own: they share one block manager
        stats = blocks.prefix_stats
        now = time.monotonic()
        if stats.queries == self._logged_queries or not (idle or now - self._logged_s >= PREFIX_LOG_INTERVAL_S):
            return
        self._logged_queries, self._logged_s = stats.queries, now
        log.info("prefix cache: hit rate %.1f%% (%d of %d tokens of admitted requests found cached), %d blocks named",
                 100 * stats.hit_rate, stats.hits, stats.queries, blocks.pool.num_cached)

    def _count(self, step: ScheduledStep) -> None:
        s = self.stats
        s.num_steps += 1
        s.max_batch_seqs = max(s.max_batch_seqs, len(step.requests))
        s.max_batch_tokens = max(s.max_batch_tokens, step.num_tokens)

    def _score(self, token_ids: list[int], top_logprobs: int, future: Future, lora=None) -> None:
        if not future.set_running_or_notify_cancel():
            return
        seq = Sequence(seq_id=-1 - self.stats.num_steps, token_ids=token_ids, lora=lora)
        try:
            logits = self.runner.step([seq], all_logits=True).cpu()
            future.set_result(_prompt_logprobs(token_ids, logits, top_logprobs))
        except Exception as e:  # noqa: BLE001 - reported to the caller
            future.set_exception(e)
        finally:
            self.runner.release(seq)


def _on_host(logits: torch.Tensor, requests: list[GenerationRequest], indices: list[int],
             ) -> tuple[dict[int, Sampled], dict[int, int], torch.Tensor]:
    """(tokens chosen on the device, each other request's row in the host logits, the host logits).

    On a GPU the plainly greedy requests (no penalties, bias, grammar or logprobs) take their
    argmax there, so only their token ids cross to the host; the others' rows are copied, and only
    theirs. On the CPU nothing moves: every request samples from its own row."""
    if logits.device.type == "cpu":
        return {}, {i: i for i in indices}, logits
    by_index = dict(zip(indices, requests))
    plain = [i for i, r in by_index.items() if r.grammar is None and r.sampler.plain_greedy]
    greedy = {}
    if plain:
        tokens = logits[plain].argmax(dim=-1).tolist()  # the first maximum, as the CPU's argmax
        greedy = {i: by_index[i].sampler.take(token) for i, token in zip(plain, tokens)}
    rest = [i for i in indices if i not in greedy]
    return greedy, {i: j for j, i in enumerate(rest)}, logits[rest].cpu() if rest else logits.new_empty(0)


def _step_span(step: ScheduledStep, drafts: list[list[int]]):
    """A span per step, in the trace of its first request and linked from the others'. A step
    that only verifies drafts is a decode step."""
    contexts = [r.trace_context for r in step.requests if r.trace_context is not None]
    parent = trace.set_span_in_context(trace.NonRecordingSpan(contexts[0])) if contexts else None
    prefill = any(n > 1 + len(d) for n, d in zip(step.num_new_tokens, drafts))
    return _tracer.start_as_current_span(
        "attention.prefill_step" if prefill else "attention.decode_step", context=parent,
        links=[trace.Link(c) for c in contexts[1:]],
        attributes={"splitmoe.num_seqs": len(step.requests), "splitmoe.num_tokens": step.num_tokens})


def _prompt_logprobs(token_ids: list[int], logits: torch.Tensor, top_logprobs: int) -> PromptLogprobs:
    logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
    targets = torch.tensor(token_ids[1:], dtype=torch.long)
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    top: list[list[tuple[int, float]]] = [[]]
    if top_logprobs:
        values, ids = torch.topk(logprobs, top_logprobs, dim=-1)
        top += [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        top += [[] for _ in chosen]
    return PromptLogprobs(token_ids, [None, *chosen], top)
