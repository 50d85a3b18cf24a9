"""Shared memory between co-located services: the tensors live here, a small message rings the bell.

`ShmRegion` is one mapped file in /dev/shm, viewed as tensors at byte offsets without copying.
The attention service's fast path (proto/doorbell.py) keeps one region per hop slot and rings
over a Unix socket. The creator unlinks its file on close (or at interpreter exit), so nothing is
left behind even if the peer never unmaps.

The expert service maps a region only for the peer that created it (`ShmRegion.attach`): /dev/shm
is writable by every local user, and the service writes its output into the region it maps, so
a name alone must never make it write where the peer itself could not.
"""
from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
import stat
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")
ALIGN_BYTES = 64  # cache-line aligned slots: every dtype's view is aligned too
_NAME_PREFIX = "splitmoe-"
# Names arrive from another process: only our own pattern (the creator's pid first), never a path.
_NAME_PATTERN = re.compile(r"^splitmoe-([0-9]+)-[0-9a-f]+$")


def align_up(num_bytes: int) -> int:
    return -(-num_bytes // ALIGN_BYTES) * ALIGN_BYTES


def tensor_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    num_elements = 1
    for dim in shape:
        num_elements *= dim
    return num_elements * dtype.itemsize


@dataclass(frozen=True, slots=True)
class Peer:
    """The process at the other end of a Unix socket, as the kernel reports it (SO_PEERCRED)."""

    pid: int
    uid: int


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
        fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
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
    def attach(cls, name: str, num_bytes: int, creator: Peer) -> "ShmRegion":
        """Map a region `creator` made: its pid in the name, a regular file (no symlink) owned by
        its uid, writable by no one else, of exactly `num_bytes`. Anything else is refused."""
        match = _NAME_PATTERN.match(name)
        if not match:
            raise ValueError(f"shared memory: {name!r} is not a SplitMoE region name")
        if int(match.group(1)) != creator.pid:
            raise ValueError(f"shared memory {name}: not created by the peer (pid {creator.pid})")
        if num_bytes <= 0:
            raise ValueError(f"shared memory {name}: the region is empty")
        try:  # O_NONBLOCK: a FIFO planted under the name must not hang the open
            fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise ValueError(f"shared memory {name}: a symbolic link, not a region") from None
            raise
        try:
            _check_created_by(name, os.fstat(fd), num_bytes, creator)
            mm = mmap.mmap(fd, num_bytes)
        finally:
            os.close(fd)
        return cls(name, mm, owner=False)

    @property
    def address(self) -> int:
        """Where the region is mapped in this process (for native code that reads it in place)."""
        return self._bytes.data_ptr()

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


def _check_created_by(name: str, st: os.stat_result, num_bytes: int, creator: Peer) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"shared memory {name}: not a regular file")
    if st.st_uid != creator.uid:
        raise ValueError(f"shared memory {name}: owned by uid {st.st_uid}, not by the peer (uid {creator.uid})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(f"shared memory {name}: writable by group or others (mode {st.st_mode & 0o777:o})")
    if st.st_size != num_bytes:
        raise ValueError(f"shared memory {name}: {st.st_size} bytes, the peer announced {num_bytes}")
