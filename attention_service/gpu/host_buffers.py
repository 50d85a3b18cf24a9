"""Reusable host buffers for the copies between the GPU and the expert hop, page-locked on a GPU.

A copy between device and host memory runs asynchronously (DMA, no CPU) only from and into
page-locked ("pinned") memory; from pageable memory the driver copies through a staging buffer of
its own, synchronously. Allocating pinned memory is slow (a system call that locks every page,
~1 ms for a few MB), so the hop takes its buffers from here, once, and gives them back: a layer
call's rows go device -> pinned buffer each hop, and the summed answer pinned buffer -> device.

A buffer given back with the event of the copy that still reads it is lent again only once that
event has completed, so an asynchronous copy never reads memory that the next hop overwrites.
Buffers are raw bytes viewed as whatever dtype and shape the caller asks; they are never freed
(the pool is as large as the most buffers ever in flight at once: a handful).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

MIN_BLOCK_BYTES = 1 << 20  # small requests share a size: decode steps' rows are KBs


@dataclass(slots=True, eq=False)  # compared by identity (list.remove): never by the tensors
class _Block:
    data: torch.Tensor       # uint8 [capacity]
    ready: Any = None        # an event the last lender's copy records; None: free now


class HostBuffers:
    """Host buffers lent for one hop's copies and given back after; see the module docstring."""

    def __init__(self, pin: bool):
        self.pin = pin
        self._free: list[_Block] = []
        self._lent: dict[int, _Block] = {}  # by the data pointer of the block lent
        self._lock = threading.Lock()
        self.num_bytes = 0  # of every block, free or lent

    def take(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A buffer of `shape` and `dtype` that no pending copy reads; give it back when done."""
        num_bytes = max(1, torch.Size(shape).numel() * dtype.itemsize)
        with self._lock:
            block = self._reusable(num_bytes) or self._allocate(num_bytes)
            self._lent[block.data.data_ptr()] = block
        return block.data[:num_bytes].view(dtype).view(shape)

    def give_back(self, buffer: torch.Tensor, ready: Any = None) -> None:
        """`ready`: the event of a copy still reading or writing `buffer` (None: nothing is)."""
        with self._lock:
            block = self._lent.pop(buffer.untyped_storage().data_ptr(), None)
            if block is None:
                raise ValueError("give_back: not a buffer lent by this pool (or given back twice)")
            block.ready = ready
            self._free.append(block)

    def owns(self, buffer: torch.Tensor) -> bool:
        """Whether `buffer` is one of this pool's, lent now."""
        with self._lock:
            return buffer.untyped_storage().data_ptr() in self._lent

    @property
    def num_lent(self) -> int:
        return len(self._lent)

    def _reusable(self, num_bytes: int) -> _Block | None:
        """The smallest free block that holds `num_bytes` and whose last copy has completed."""
        best = None
        for block in self._free:
            if block.data.numel() >= num_bytes and (best is None or block.data.numel() < best.data.numel()):
                if block.ready is None or block.ready.query():
                    best = block
        if best is not None:
            self._free.remove(best)
            best.ready = None
        return best

    def _allocate(self, num_bytes: int) -> _Block:
        capacity = max(MIN_BLOCK_BYTES, 1 << (num_bytes - 1).bit_length())
        self.num_bytes += capacity
        with torch.inference_mode(False):  # a normal tensor, whichever mode the first lender is in
            return _Block(torch.empty(capacity, dtype=torch.uint8, pin_memory=self.pin))
