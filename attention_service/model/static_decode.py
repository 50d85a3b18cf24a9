"""A decode step over fixed-shape buffers: how a GPU decodes, in segments between expert hops.

The step is cut at every MoE layer whose routed experts are computed off the device (by expert
services, or by the CPU in this process): a segment is the device's work from one such hop to
the next (the previous hop's answer added in, whole layers, the next hop layer's attention and
router), then the hop itself, while a second small piece (that layer's shared expert) runs on
the device. Every shape is fixed by a bucket (gpu/graphs.py: rows padded to 1, 2, 4, ...; the
context to a power of two), every tensor a segment reads or writes lives in this bucket's
buffers, and attention reads the cache through a padded slot table (model/device_attention.py).
So each segment can be captured once as a CUDA graph and replayed (`--cuda-graphs on`), and the
eager run (`off`) launches the same kernels on the same shapes: both give the same outputs.

Padded rows are harmless: they read token 0 at position 0, attend to one scratch slot that no
sequence owns, write their KV there, and never reach a hop or the logits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from splitmoe.attention_service.gpu.graphs import SegmentGraphs, batch_bucket, context_bucket
from splitmoe.attention_service.gpu.host_buffers import HostBuffers
from splitmoe.attention_service.model.batch import PagedContext, StepBatch
from splitmoe.attention_service.model.kv_cache import KVCache
from splitmoe.attention_service.model.transformer import FFNStart, MoETransformer

# Columns of a bucket's input table before the slot table: one host-to-device copy per step.
_TOKEN, _POSITION, _NEW_SLOT, _CONTEXT_LEN, _SLOTS = 0, 1, 2, 3, 4


@dataclass(frozen=True)
class Segment:
    layers: range          # run in full, except `hop`, whose routed experts follow the segment
    hop: int | None        # the MoE layer handed to the expert backend after it; None: the last segment


@dataclass(frozen=True)
class DecodeRows:
    """One decode step's sequences, one new token each, as the host knows them."""

    token_ids: list[int]
    contexts: list[torch.Tensor]  # each sequence's cache slots, its new token's last (host, int64)


def plan_segments(model: MoETransformer, device_layers: frozenset[int] = frozenset()) -> list[Segment]:
    """The segments of a step: a hop after each MoE layer not in `device_layers` (whose experts
    the backend computes on the device, without the host: those run inside a segment)."""
    hops = [i for i, layer in enumerate(model.weights.layers) if layer.moe is not None and i not in device_layers]
    starts = [0, *(h + 1 for h in hops)]
    ends = [*(h + 1 for h in hops), len(model.weights.layers)]
    return [Segment(range(a, b), h) for a, b, h in zip(starts, ends, [*hops, None])]


class _Rows:
    """A batch bucket's buffers: what segments hand each other, and the step's logits."""

    def __init__(self, model: MoETransformer, num_rows: int, device: torch.device):
        c, f32 = model.cfg, torch.float32
        self.num_rows = num_rows
        self.x = [torch.zeros(num_rows, c.hidden_size, dtype=f32, device=device) for _ in range(2)]
        self.logits = torch.zeros(num_rows, c.vocab_size, dtype=f32, device=device)
        self.hop: FFNStart | None = None  # the hop's inputs: made by the first capture or run
        self.h32 = torch.zeros(num_rows, c.hidden_size, dtype=f32, device=device)  # what the shared expert reads
        self.shared: torch.Tensor | None = None
        self.answer: torch.Tensor | None = None  # the routed experts' sum, per hop row

    def keep_hop(self, start: FFNStart, h32: torch.Tensor) -> None:
        """Copy a hop's inputs into this bucket's buffers (made at the first hop: the shapes are
        the same for every hop of a model)."""
        if self.hop is None:
            self.hop = FFNStart(torch.zeros_like(start.hidden), torch.zeros_like(start.ids),
                                torch.zeros_like(start.weights), start.tokens)
            self.answer = torch.zeros(start.hidden.shape, dtype=torch.float32, device=start.hidden.device)
        self.hop.hidden.copy_(start.hidden)
        self.hop.ids.copy_(start.ids)
        self.hop.weights.copy_(start.weights)
        self.h32.copy_(h32)


class _Bucket:
    """A (rows, context width) bucket: its input table and the step batch that views it."""

    def __init__(self, rows: _Rows, context_tokens: int, device: torch.device):
        self.rows, self.context_tokens = rows, context_tokens
        self.inputs = torch.zeros(rows.num_rows, _SLOTS + context_tokens, dtype=torch.int64, device=device)
        self.logits_rows = torch.arange(rows.num_rows, device=device)

    def batch(self) -> StepBatch:
        """Views of the input table as a StepBatch: new view objects each step, so that caches
        keyed on a tensor's identity (the rope tables') never see last step's contents as this one's."""
        t = self.inputs
        return StepBatch(token_ids=t[:, _TOKEN], positions=t[:, _POSITION], new_slots=t[:, _NEW_SLOT], seqs=(),
                         logits_rows=self.logits_rows,
                         paged=PagedContext(t[:, _SLOTS:], t[:, _CONTEXT_LEN]))


class StaticDecode:
    """Decode steps in fixed-shape segments, replayed from CUDA graphs when `graphs` is given."""

    def __init__(self, model: MoETransformer, kv: KVCache, scratch_slot: int, graphs: SegmentGraphs | None = None,
                 device_layers: frozenset[int] = frozenset(), max_context_tokens: int | None = None):
        self.model, self.kv, self.scratch_slot, self.graphs = model, kv, scratch_slot, graphs
        self.device = model.weights.output_norm.device
        self.plan = plan_segments(model, device_layers)
        self.max_context_tokens = max_context_tokens or kv.num_blocks * kv.kv_block_tokens
        self._rows: dict[int, _Rows] = {}
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._host = HostBuffers(pin=self.device.type == "cuda")  # where each step's input table is built

    def accepts(self, num_rows: int, max_context_tokens: int) -> bool:
        return (batch_bucket(num_rows) is not None
                and context_bucket(max_context_tokens, self.max_context_tokens) is not None)

    @torch.inference_mode()
    def run(self, step: DecodeRows) -> torch.Tensor:
        """Float32 logits [rows, vocab] of each sequence's new token (a copy: buffers are reused)."""
        num_rows = len(step.token_ids)
        bucket = self._bucket(num_rows, max(len(c) for c in step.contexts))
        self._upload(bucket, step)
        batch = bucket.batch()
        rows = bucket.rows
        for k, segment in enumerate(self.plan):
            self._launch(("segment", rows.num_rows, bucket.context_tokens, k),
                         lambda: self._segment(k, segment, rows, batch))
            if segment.hop is not None:
                self._hop(k, segment.hop, rows, num_rows)
        return rows.logits[:num_rows].clone()

    # ---- the segments ---------------------------------------------------------------------------

    def _segment(self, k: int, segment: Segment, rows: _Rows, batch: StepBatch) -> None:
        """Segment k: reads rows.x[k % 2] (the embeddings for k = 0) and the previous hop's
        answer; writes rows.x[(k + 1) % 2] and this hop's inputs, or the logits."""
        m = self.model
        if k == 0:
            x = m.weights.token_embedding[batch.token_ids].float()
        else:
            shared = rows.shared if m.weights.layers[self.plan[k - 1].hop].moe.shared is not None else None
            x = rows.x[k % 2] + FFNStart.finish(rows.answer, shared, rows.hop.tokens)
        top_k = m.cfg.num_experts_used
        for i in segment.layers:
            layer = m.weights.layers[i]
            x = m.attention_block(i, layer, x, batch, self.kv)
            h32 = m.ffn_norm(layer, x)
            if i == segment.hop:
                rows.keep_hop(m.start_ffn(layer, h32.to(m.dtype), h32, batch, top_k), h32)
            else:
                x = x + m.ffn(i, layer, h32, batch, top_k)
        if segment.hop is None:
            rows.logits.copy_(m.head(x))
        else:
            rows.x[(k + 1) % 2].copy_(x)

    def _shared(self, layer: int, rows: _Rows) -> None:
        m = self.model
        h32 = rows.h32
        shared = m.shared_ffn(m.weights.layers[layer], h32.to(m.dtype), h32)
        if shared is not None:
            if rows.shared is None:
                rows.shared = torch.zeros_like(shared)
            rows.shared.copy_(shared)

    def _hop(self, k: int, layer: int, rows: _Rows, num_rows: int) -> None:
        """The routed experts of the real rows, off the device; the shared expert meanwhile on it."""
        hop = rows.hop
        n = num_rows * (hop.hidden.shape[0] // rows.num_rows)  # rows per token: 1, or K (Llama 4)
        handle = self.model.experts.submit(layer, hop.hidden[:n], hop.ids[:n], hop.weights[:n])
        if self.model.weights.layers[layer].moe.shared is not None:
            self._launch(("shared", rows.num_rows, k), lambda: self._shared(layer, rows))
        rows.answer[:n].copy_(handle.wait())

    def _launch(self, key: tuple, segment) -> None:
        if self.graphs is None:
            segment()
        else:
            self.graphs.run(key, segment)

    # ---- buffers --------------------------------------------------------------------------------

    def _bucket(self, num_rows: int, context_tokens: int) -> _Bucket:
        padded_rows = batch_bucket(num_rows)
        width = context_bucket(context_tokens, self.max_context_tokens)
        key = (padded_rows, width)
        bucket = self._buckets.get(key)
        if bucket is None:
            rows = self._rows.get(padded_rows)
            if rows is None:
                rows = self._rows[padded_rows] = _Rows(self.model, padded_rows, self.device)
            bucket = self._buckets[key] = _Bucket(rows, width, self.device)
        return bucket

    def _upload(self, bucket: _Bucket, step: DecodeRows) -> None:
        """The step's inputs into the bucket's table, padded rows pointing at the scratch slot:
        built on the host in a lent (page-locked) buffer, one copy to the device, ordered before
        the segments on its stream; the buffer is lent again once the copy has completed."""
        host = self._host.take(bucket.inputs.shape, torch.int64)
        fill_inputs(host, step, self.scratch_slot)
        bucket.inputs.copy_(host, non_blocking=True)
        copied = torch.cuda.current_stream(self.device).record_event() if self.device.type == "cuda" else None
        self._host.give_back(host, copied)


def fill_inputs(table: torch.Tensor, step: DecodeRows, scratch_slot: int) -> None:
    """table [rows, 4 + C]: token, position, new slot, context length, then the context's slots
    (padding: the scratch slot). A handful of tensor operations, whatever the number of rows."""
    n = len(step.token_ids)
    lens = torch.tensor([len(c) for c in step.contexts], dtype=torch.int64)
    slots = torch.cat(step.contexts)
    table.fill_(scratch_slot)
    table[:, _TOKEN] = 0
    table[:, _POSITION] = 0
    table[:, _CONTEXT_LEN] = 1
    table[:n, _TOKEN] = torch.tensor(step.token_ids, dtype=torch.int64)
    table[:n, _POSITION] = lens - 1
    table[:n, _CONTEXT_LEN] = lens
    table[:n, _NEW_SLOT] = slots[lens.cumsum(0) - 1]  # each context's last slot: its new token's
    row = torch.repeat_interleave(torch.arange(n), lens)
    column = torch.arange(slots.numel()) - torch.repeat_interleave(lens.cumsum(0) - lens, lens)
    table[row, _SLOTS + column] = slots

