"""The shard this process serves: which (layer, expert) pairs, their FFN, and how busy each is.

Wraps `modelfile.expert_tensors.ExpertShard` (memory-mapped views: building one touches no expert
bytes) so that LoadShard can replace it while streams are open: a request reads the current
shard once and finishes on it. Its `forward` is `kernels.expert_kernels.ExpertCompute`'s, where
each hop takes the fast path or the float32 reference (the attention side's in-process experts
compute the same way, so the choice lives in kernels/). Token counts are kept per (layer,
expert) for load statistics.

The shard's fast path (bfloat16/float16 requests) is prepared when the shard is built, not at
the first request: with the native kernels that is cheap (pointers into the mmap); without
them it is the int4 repack (cached on disk), which could otherwise outlast a request deadline.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from splitmoe.expert_service.native_hops import NativeHops
from splitmoe.kernels import native
from splitmoe.kernels.expert_kernels import format_ranges
from splitmoe.kernels.expert_lora import LoraRows
from splitmoe.kernels.repack_cache import RepackCache
from splitmoe.modelfile.expert_tensors import (
    ExpertKey,
    ExpertShard,
    ExpertTokenCounts,
    expert_count,
    moe_layers,
)
from splitmoe.modelfile.gguf_file import GGUFFile
from splitmoe.modelfile.hparams import ModelConfig

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True, slots=True)
class ShardDescription:
    layers: tuple[int, ...]
    experts: tuple[int, ...]    # the union over the layers
    num_bytes: int
    by_layer: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (layer, its experts): exactly what is hosted


@dataclass(frozen=True, slots=True)
class ShardTotals:
    num_requests: int
    compute_s: float


class HostedShard:
    """The replaceable expert shard of one GGUF file, with per-(layer, expert) token counts."""

    def __init__(self, g: GGUFFile, layers: Iterable[int] | None = None, experts: Iterable[int] | None = None,
                 prepare_fast: bool = True, repack_cache: RepackCache | None = None):
        self.g, self.repack_cache = g, repack_cache
        self._prepare_fast = prepare_fast
        cfg = ModelConfig.from_gguf(g)  # checked: the sizes below come from the file
        self.hidden_size = cfg.hidden_size
        self.num_experts = expert_count(g)
        # The NextN/MTP layer's experts too, as any other layer's: an attention service drafting
        # with the file's MTP block (--speculative mtp) calls that layer as well.
        self.moe_layers = tuple(moe_layers(g, nextn=True))
        self._tokens = ExpertTokenCounts(cfg.num_blocks, self.num_experts)
        self._lock = threading.Lock()
        self._num_requests, self._compute_s = 0, 0.0
        # The shared-memory hop loop in C++ serves decode hops itself and counts them there.
        self.native_hops = NativeHops(cfg.num_blocks, self.num_experts) if prepare_fast and native.AVAILABLE else None
        self._shard, self._hosted = self._build(layers, experts)

    def describe(self) -> ShardDescription:
        shard = self._shard
        return ShardDescription(tuple(shard.layers), tuple(shard.experts), shard.num_bytes,
                                tuple(shard.by_layer.items()))

    def load(self, layers: Iterable[int], experts: Iterable[int],
             by_layer: Mapping[int, Iterable[int]] | None = None) -> ShardDescription:
        """Replace the hosted shard (every expert of `experts` in every layer of `layers`, or
        exactly `by_layer`'s pairs); requests already running finish on the old one."""
        self._shard, self._hosted = self._build(layers, experts, by_layer)
        return self.describe()

    def forward(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
                lora: LoraRows | None = None) -> tuple[torch.Tensor, float]:
        """(this shard's part of the layer's expert sum in `hidden.dtype`, seconds computing it).

        Ids this shard does not host (and -1, "computed elsewhere") add nothing. `lora`: each
        adapter's tensors on this layer and its rows (kernels/expert_lora.py), the others use the base.
        """
        shard, hosted = self._shard, self._hosted
        self._check_inputs(hidden, expert_ids, expert_weights)
        if hidden.shape[0] == 0:  # also the client's handshake: no layer needed
            return torch.empty_like(hidden), 0.0
        if layer not in shard.layers:
            raise ValueError(f"layer {layer} is not hosted here ({format_ranges('layers', shard.layers)})")
        start_s = time.perf_counter()
        if lora:
            out = shard.forward(layer, hidden, expert_ids.long(), expert_weights, lora=lora)
        else:
            out = shard.forward(layer, hidden, expert_ids.long(), expert_weights)
        compute_s = time.perf_counter() - start_s
        self._count(layer, expert_ids, hosted, compute_s)
        return out, compute_s

    def token_counts(self) -> dict[ExpertKey, int]:
        """Tokens routed to each hosted (layer, expert) since start."""
        shard = self._shard
        with self._lock:
            counts = self._tokens.read(shard.layers, shard.experts,
                                       None if self.native_hops is None else self.native_hops.tokens)
        return {key: n for key, n in counts.items() if shard.holds(key)}

    def totals(self) -> ShardTotals:
        with self._lock:
            requests, compute_s = self._num_requests, self._compute_s
        if self.native_hops is not None:
            hops, compute_ns = self.native_hops.totals.tolist()
            requests, compute_s = requests + hops, compute_s + compute_ns * 1e-9
        return ShardTotals(requests, compute_s)

    def _build(self, layers: Iterable[int] | None, experts: Iterable[int] | None,
               by_layer: Mapping[int, Iterable[int]] | None = None) -> tuple[ExpertShard, torch.Tensor]:
        if not by_layer:
            layers = self.moe_layers if layers is None else tuple(sorted(set(layers)))
            experts = tuple(range(self.num_experts)) if experts is None else tuple(sorted(set(experts)))
            by_layer = {layer: experts for layer in layers}
        by_layer = {layer: tuple(sorted(set(es))) for layer, es in by_layer.items()}
        if not set(by_layer) <= set(self.moe_layers):
            raise ValueError(f"layers {sorted(set(by_layer) - set(self.moe_layers))} have no routed experts "
                             f"(MoE layers: {format_ranges('layers', self.moe_layers)})")
        if any(not 0 <= e < self.num_experts for es in by_layer.values() for e in es):
            raise ValueError(f"expert ids must lie in [0, {self.num_experts})")
        by_layer = {layer: es for layer, es in by_layer.items() if es}  # half-empty is empty: nothing to compute
        hosted = torch.zeros(len(self._tokens.table), self.num_experts, dtype=torch.int64)  # [layer, expert] 0/1
        for layer, es in by_layer.items():
            hosted[layer, list(es)] = 1
        shard = ExpertShard(self.g, by_layer=by_layer, repack_cache=self.repack_cache)
        layers = shard.layers
        fast = shard.prepare_fast() if self._prepare_fast and layers else {}
        if self.native_hops is not None:
            self.native_hops.set_layers(fast)
        return shard, hosted

    def _check_inputs(self, hidden: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor) -> None:
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size or hidden.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"hidden must be [tokens, {self.hidden_size}] float, got {list(hidden.shape)} {hidden.dtype}")
        if expert_ids.dim() != 2 or expert_ids.shape[0] != hidden.shape[0] or expert_ids.dtype not in _INT_DTYPES:
            raise ValueError(f"expert_ids must be [{hidden.shape[0]}, top_k] int, got {list(expert_ids.shape)} {expert_ids.dtype}")
        if expert_weights.shape != expert_ids.shape or expert_weights.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"expert_weights must be {list(expert_ids.shape)} float, got {list(expert_weights.shape)}")

    def _count(self, layer: int, expert_ids: torch.Tensor, hosted: torch.Tensor, compute_s: float) -> None:
        with self._lock:
            self._tokens.add(layer, expert_ids, hosted[layer])
            self._num_requests += 1
            self._compute_s += compute_s
