"""One scheduler step's tokens, flattened across sequences, with where each one's KV lives."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from splitmoe.attention_service.model.lora import StepLora
from splitmoe.kernels.decode_attention import AttentionContext


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's rows in the flat batch and the KV slots of its whole context so far."""

    start: int
    end: int
    context_slots: torch.Tensor  # [C], position order, the new tokens' slots last


@dataclass(frozen=True)
class PagedContext:
    """Every row's context as a fixed-shape table, for attention without per-sequence shapes
    (model/device_attention.py): what a decode step on a GPU attends over, and what a CUDA graph
    of it reads. Rows past a sequence's context point at any valid slot; they are masked."""

    slot_table: torch.Tensor    # int64 [T, C]: the cache slot of each row's context positions 0..C-1
    context_lens: torch.Tensor  # int64 [T]: how many of them the row's sequence has

    def rows(self, start: int, end: int) -> "PagedContext":
        return PagedContext(self.slot_table[start:end], self.context_lens[start:end])


@dataclass(frozen=True)
class StepBatch:
    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    new_slots: torch.Tensor  # [T]: where each new token's KV is written
    seqs: tuple[SeqSlice, ...]
    logits_rows: torch.Tensor  # rows of the batch whose logits are wanted
    experts_per_token: torch.Tensor | None = None  # [T]; None: every token uses the model's own k
    paged: PagedContext | None = None  # set: attention reads the cache through this table (decode on a GPU)
    verification: bool = False  # some sequence verifies drafted tokens (engine/speculation.py)
    lora: StepLora | None = None  # the rows of requests that name a LoRA adapter (model/lora.py)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @cached_property
    def max_new_tokens(self) -> int:
        """The most new tokens any one sequence brings to this step (1 in a pure decode step)."""
        return max((s.end - s.start for s in self.seqs), default=0)

    @cached_property
    def attention_context(self) -> AttentionContext:
        """Which cached slots each row attends over, for the native decode attention: built once
        per step, read by every layer."""
        return AttentionContext.build([(s.start, s.end - s.start, s.context_slots) for s in self.seqs])

    @cached_property
    def _chunked_contexts(self) -> dict[int, AttentionContext]:
        return {}

    def chunked_attention_context(self, chunk_tokens: int) -> AttentionContext:
        """`attention_context` for chunked attention (Llama 4): each sequence's rows grouped by the
        chunk their position falls in, each group over its chunk's slots up to its last row. Built
        once per step and chunk size."""
        context = self._chunked_contexts.get(chunk_tokens)
        if context is None:
            rows = []
            for s in self.seqs:
                num_context = len(s.context_slots)
                first = num_context - (s.end - s.start)  # the first row's position
                while first < num_context:
                    chunk_start = first // chunk_tokens * chunk_tokens
                    last = min(num_context, chunk_start + chunk_tokens)  # past the group's last row
                    rows.append((s.start + first - (num_context - (s.end - s.start)), last - first,
                                 s.context_slots[chunk_start:last]))
                    first = last
            context = self._chunked_contexts[chunk_tokens] = AttentionContext.build(rows)
        return context

    def split(self, num_parts: int) -> list[tuple["StepBatch", slice]]:
        """The batch cut by sequence into up to `num_parts` micro-batches of about equal tokens,
        each with its rows of this batch; rows, logits rows and slots renumbered within each."""
        num_parts = min(num_parts, len(self.seqs))
        if num_parts <= 1:
            return [(self, slice(0, self.num_tokens))]
        cuts, share = [0], self.num_tokens / num_parts
        for i, s in enumerate(self.seqs[:-1]):  # after sequence i, when its end is nearest the next target
            target = share * len(cuts)
            if len(cuts) < num_parts and abs(s.end - target) <= abs(self.seqs[i + 1].end - target):
                cuts.append(i + 1)
        cuts.append(len(self.seqs))
        parts = []
        for first, last in zip(cuts, cuts[1:]):
            seqs = self.seqs[first:last]
            start, end = seqs[0].start, seqs[-1].end
            logits = self.logits_rows[(self.logits_rows >= start) & (self.logits_rows < end)] - start
            parts.append((StepBatch(
                token_ids=self.token_ids[start:end], positions=self.positions[start:end],
                new_slots=self.new_slots[start:end],
                seqs=tuple(SeqSlice(s.start - start, s.end - start, s.context_slots) for s in seqs),
                logits_rows=logits,
                experts_per_token=None if self.experts_per_token is None else self.experts_per_token[start:end],
                paged=None if self.paged is None else self.paged.rows(start, end),
            ), slice(start, end)))
        return parts
