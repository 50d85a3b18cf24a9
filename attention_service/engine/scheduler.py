"""Continuous batching: which requests run in the next step, and how many tokens each.

Running requests go first (a decode is one token), so streams never stall behind a long prompt;
prompts are prefilled in chunks within the step's token budget, and new requests join whenever
the budget and the KV cache allow. When the cache runs out, the newest running request is
preempted: its blocks are freed and it is recomputed later from its tokens. No tensors here.

With prefix caching, a request starts from the longest cached run of whole blocks matching its
tokens (block_manager.py), and only the rest is prefilled; a preempted request so recomputes only
what was evicted meanwhile. A prompt cut into chunks is cut on block boundaries, so that before
each chunk it can also take the blocks that requests running beside it have filled since (16
requests with one system prompt, arriving together: the first computes the prompt, the others
take its blocks as soon as they are full).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from splitmoe.attention_service.engine.request import GenerationRequest
from splitmoe.attention_service.model.block_manager import BlockManager


class QueueFull(RuntimeError):
    pass


@dataclass(frozen=True)
class ScheduledStep:
    requests: list[GenerationRequest]
    num_new_tokens: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch_tokens: int, max_running_seqs: int, max_waiting: int):
        self.blocks = blocks
        self.max_batch_tokens = max_batch_tokens
        self.max_running_seqs = max_running_seqs
        self.max_waiting = max_waiting
        self.waiting: deque[GenerationRequest] = deque()
        self.running: list[GenerationRequest] = []

    def add(self, request: GenerationRequest) -> None:
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"the request queue is full ({self.max_waiting} waiting)")
        self.waiting.append(request)

    def remove(self, request_id: str) -> GenerationRequest | None:
        """Take a request out wherever it is, freeing its KV blocks."""
        for queue in (self.running, self.waiting):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    self.blocks.free(request.seq.seq_id)
                    return request
        return None

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def schedule(self) -> ScheduledStep | None:
        chosen: list[GenerationRequest] = []
        counts: list[int] = []
        budget = self.max_batch_tokens
        for request in list(self.running):
            if budget <= 0:
                break
            if request not in self.running:  # preempted to make room for an earlier one
                continue
            self.blocks.take(request.seq, self.blocks.cached_prefix(request.seq), admitted=False)
            n = self._chunk_tokens(request, request.seq.num_cached_tokens, budget, admitting=False)
            n += self._drafts(request, n, budget)
            if n and self._reserve_or_preempt(request, n, protect=chosen):
                chosen.append(request)
                counts.append(n)
                budget -= n
        budget = self._admit(chosen, counts, budget)
        return ScheduledStep(chosen, counts) if chosen else None

    def _drafts(self, request: GenerationRequest, n: int, budget: int) -> int:
        """Drafted tokens a decoding request verifies this step (speculation.py), within the budget
        and the free KV blocks (a draft never preempts anyone: it is dropped instead)."""
        if not request.draft:
            return 0
        seq = request.seq
        if n != 1 or seq.num_tokens - seq.num_cached_tokens != 1:
            request.draft = []  # a prompt chunk is not a decode: no draft
            return 0
        draft = request.draft[:max(0, budget - 1)]
        if self.blocks.blocks_needed(seq.seq_id, seq.num_tokens + len(draft)) > self.blocks.num_free_blocks:
            draft = []
        request.draft = draft
        return len(draft)

    def _admit(self, chosen: list[GenerationRequest], counts: list[int], budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_running_seqs:
            request = self.waiting[0]
            hit = self.blocks.cached_prefix(request.seq)
            start = request.seq.num_cached_tokens + len(hit.blocks) * self.blocks.kv_block_tokens
            n = self._chunk_tokens(request, start, budget, admitting=True)
            if not n or self.blocks.blocks_to_take(request.seq, hit, start + n) > self.blocks.num_free_blocks:
                break
            self.blocks.take(request.seq, hit, admitted=True)
            self.blocks.reserve(request.seq.seq_id, start + n)
            self.running.append(self.waiting.popleft())
            chosen.append(request)
            counts.append(n)
            budget -= n
        return budget

    def _chunk_tokens(self, request: GenerationRequest, start: int, budget: int, admitting: bool) -> int:
        """Tokens to run from `start` with `budget` left in the step; 0: none this step.

        With prefix caching a prompt that does not fit is cut where a block ends (whole blocks are
        what the cache names and what the next chunk may take from it). When the budget left
        reaches no block end, a running prompt goes on unaligned (it must not stall), while a new
        request waits for a step with room for a block, unless the step's whole budget is that small."""
        remaining = request.seq.num_tokens - start
        n = min(remaining, budget)
        if n == remaining or not self.blocks.prefix_caching:
            return n
        B = self.blocks.kv_block_tokens
        aligned = (start + n) // B * B - start
        if aligned > 0:
            return aligned
        return 0 if admitting and budget < self.max_batch_tokens else n

    def _reserve_or_preempt(self, request: GenerationRequest, n: int, protect: list[GenerationRequest]) -> bool:
        end = request.seq.num_cached_tokens + n
        while self.blocks.blocks_needed(request.seq.seq_id, end) > self.blocks.num_free_blocks:
            victim = next((r for r in reversed(self.running) if r is not request and r not in protect), None)
            if victim is None:
                return False
            self._preempt(victim)
        self.blocks.reserve(request.seq.seq_id, end)
        return True

    def _preempt(self, request: GenerationRequest) -> None:
        self.running.remove(request)
        self.blocks.free(request.seq.seq_id)
        request.seq.num_cached_tokens = 0
        self.waiting.appendleft(request)
