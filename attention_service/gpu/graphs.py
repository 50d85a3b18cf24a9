"""CUDA graphs of the decode step's segments: captured per bucket at first use, replayed after.

A decode step on a GPU is a few hundred small kernels per layer call, and launching them from
Python costs more than running them (tens of microseconds each, for kernels of a few). A graph
launches a whole segment (the GPU work between two expert hops: model/static_decode.py) with one
call. A graph replays fixed shapes at fixed addresses, so steps are padded to a bucket: the batch
to the next of 1, 2, 4, 8, ... rows, the context to the next power of two from 256 tokens; each
(rows, context) bucket's segments are captured the first time a step needs them.

Every graph shares one memory pool: segments run one after another, never at once, and what one
segment leaves for the next lives in buffers allocated outside the pool.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Hashable

import torch

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # decode rows a step is padded to; larger steps run unpadded, eagerly
MIN_CONTEXT_BUCKET_TOKENS = 256
WARMUP_RUNS = 2  # before a capture, on a side stream: lazy initialisations (cuBLAS handles) stay out of the graph


def batch_bucket(num_rows: int, buckets: tuple[int, ...] = BATCH_BUCKETS) -> int | None:
    """The smallest bucket that holds `num_rows` rows; None past the largest."""
    for size in buckets:
        if num_rows <= size:
            return size
    return None


def context_bucket(num_tokens: int, max_tokens: int) -> int | None:
    """The context width a step's slot table is padded to: the next power of two from
    MIN_CONTEXT_BUCKET_TOKENS, at most `max_tokens` (the cache's capacity); None past it.

    Decode attention reads the whole padded width, so a power of two at most doubles its cost
    while keeping the number of graphs per batch bucket to log2 of the capacity."""
    if num_tokens < 1 or num_tokens > max_tokens:
        return None
    width = MIN_CONTEXT_BUCKET_TOKENS
    while width < num_tokens:
        width *= 2
    return min(width, max_tokens)


class SegmentGraphs:
    """Captured segments by key; `run` captures a key's function the first time, then replays it."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self.num_bytes = 0  # device memory the captures reserved (the pool's growth)
        self.capture_s = 0.0

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, key: Hashable, segment: Callable[[], None]) -> None:
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(segment)
        graph.replay()

    def _capture(self, segment: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """Warm up on a side stream (torch's recipe), then capture. The segment runs for real in
        the warm-up: it reads its inputs and writes its outputs only, so running it again is harmless."""
        start_s = time.perf_counter()
        reserved = torch.cuda.memory_reserved(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                segment()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            segment()
        self.num_bytes += max(0, torch.cuda.memory_reserved(self.device) - reserved)
        self.capture_s += time.perf_counter() - start_s
        return graph
