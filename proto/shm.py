"""Shared memory between co-located services: the tensors live here, a small message rings the bell.

`ShmRegion` is one mapped file in /dev/shm, viewed as tensors at byte offsets without copying.
The attention service's fast path (proto/doorbell.py) keeps one region per hop slot and rings
over a Unix socket. A gRPC `Tensor` may refer to shared memory too (`Tensor.shm`): a client lays
a request out with `ShmArena` and the expert service maps the regions by name (`ShmMappings`).
The creator unlinks its file on close (or at interpreter exit), so nothing is left behind even
if the peer never unmaps.
"""
from __future__ import annotations

import mmap
import os
import re
import secrets
import weakref
from collections import OrderedDict
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")
ALIGN_BYTES = 64  # cache-line aligned slots: every dtype's view is aligned too
_NAME_PREFIX = "splitmoe-"
# Names arrive from the network: only our own pattern, never a path.
_NAME_PATTERN = re.compile(r"^splitmoe-[0-9]+-[0-9a-f]+$")


def align_up(num_bytes: int) -> int:
    return -(-num_bytes // ALIGN_BYTES) * ALIGN_BYTES


def tensor_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    num_elements = 1
    for dim in shape:
        num_elements *= dim
    return num_elements * dtype.itemsize


class ShmRegion:
    """One mapped shared-memory file, viewed as tensors at byte offsets."""

    def __init__(self, name: str, mm: mmap.mmap, owner: bool):
        self.name = name
        self.num_bytes = len(mm)
        self._mm = mm
        self._bytes = torch.frombuffer(mm, dtype=torch.uint8)
        # The creator's unlink must run even when close() is never called.
        self._unlink = weakref.finalize(self, _unlink, SHM_DIR / name) if owner else None

    @classmethod
    def create(cls, num_bytes: int) -> "ShmRegion":
        name = f"{_NAME_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, num_bytes)
            mm = mmap.mmap(fd, num_bytes)
        except BaseException:
            _unlink(SHM_DIR / name)
            raise
        finally:
            os.close(fd)
        return cls(name, mm, owner=True)

    @classmethod
    def attach(cls, name: str) -> "ShmRegion":
        if not _NAME_PATTERN.match(name):
            raise ValueError(f"shared memory: {name!r} is not a SplitMoE region name")
        fd = os.open(SHM_DIR / name, os.O_RDWR)
        try:
            size_bytes = os.fstat(fd).st_size
            if not size_bytes:
                raise ValueError(f"shared memory {name}: the region is empty")
            mm = mmap.mmap(fd, size_bytes)
        finally:
            os.close(fd)
        return cls(name, mm, owner=False)

    def view(self, offset_bytes: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A writable tensor over bytes [offset, offset + size) of the region (no copy)."""
        num_bytes = tensor_nbytes(shape, dtype)
        if offset_bytes < 0 or offset_bytes + num_bytes > self.num_bytes:
            raise ValueError(f"shared memory {self.name}: bytes {offset_bytes}..{offset_bytes + num_bytes} "
                             f"outside the region ({self.num_bytes} bytes)")
        if offset_bytes % dtype.itemsize:
            raise ValueError(f"shared memory {self.name}: offset {offset_bytes} not aligned for {dtype}")
        return self._bytes[offset_bytes:offset_bytes + num_bytes].view(dtype).view(shape)

    def close(self) -> None:
        if self._unlink is not None:
            self._unlink()
        self._bytes = torch.empty(0, dtype=torch.uint8)
        try:
            self._mm.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes when that view does


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class ShmArena:
    """A region for requests sent one at a time: a bump allocator reset per request.

    Every request reuses the region from offset 0.
    A request that does not fit gets a larger region (the old one is unlinked; the peer maps the
    new name on its next request).
    """

    def __init__(self, initial_bytes: int = 1 << 20):
        self._region = ShmRegion.create(align_up(max(initial_bytes, ALIGN_BYTES)))
        self._used_bytes = 0

    @property
    def name(self) -> str:
        return self._region.name

    def reset(self, needed_bytes: int) -> None:
        """Start a request that will allocate at most `needed_bytes` (aligned slots included)."""
        if needed_bytes > self._region.num_bytes:
            grown = ShmRegion.create(max(needed_bytes, 2 * self._region.num_bytes))
            self._region.close()
            self._region = grown
        self._used_bytes = 0

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        """(a writable view, its byte offset) for the next slot of this request."""
        offset_bytes = self._used_bytes
        view = self._region.view(offset_bytes, shape, dtype)
        self._used_bytes = offset_bytes + align_up(tensor_nbytes(shape, dtype))
        return view, offset_bytes

    def close(self) -> None:
        self._region.close()


class ShmMappings:
    """The expert side's view of one stream's regions, mapped by name on first use.

    A client that grows its arena sends a new name; the oldest mappings are dropped beyond
    `max_regions`, so a long-lived stream holds a bounded amount of address space.
    """

    def __init__(self, max_regions: int = 2):
        self._regions: OrderedDict[str, ShmRegion] = OrderedDict()
        self._max_regions = max_regions

    def get(self, name: str) -> ShmRegion:
        region = self._regions.get(name)
        if region is None:
            region = self._regions[name] = ShmRegion.attach(name)
            while len(self._regions) > self._max_regions:
                self._regions.popitem(last=False)[1].close()
        return region

    def close(self) -> None:
        for region in self._regions.values():
            region.close()
        self._regions.clear()
