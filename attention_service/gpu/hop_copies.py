"""The expert hop's two copies when attention runs on a GPU: rows out to the host, answer back.

The expert backends (in-process CPU experts, expert services over shared memory or gRPC) work on
host tensors. On a GPU a layer call's hidden rows, expert ids and routing weights are copied to
the host together: three asynchronous copies on one side stream into page-locked buffers
(host_buffers.py), after an event that marks them computed, and ONE wait for the last copy: the
host needs the routing to split the work by service, and never syncs per tensor. The summed
answer goes back the same way: from a page-locked buffer to the device on the side stream, and
the compute stream waits for that copy on the GPU, not the host, so the next layer's kernels are
queued while it runs.

One side stream carries every hop copy in both directions, in order. That is what makes reusing
host memory safe: a later copy into a buffer (or a shared-memory slot) is queued behind every
earlier copy out of it. On the CPU (`HostSide`) the tensors are already where the backends want
them, and nothing is copied.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from splitmoe.attention_service.gpu.host_buffers import HostBuffers
from splitmoe.attention_service.gpu.send_ahead import SendAhead

# A backend's layer call on host tensors: (layer, hidden, expert ids, expert weights, new_output) ->
# its handle; new_output(shape) gives the float32 buffer its answer may be summed into (None: any).
HostStart = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, "Callable | None"], object]


@dataclass(slots=True)
class Staged:
    """A layer call's tensors on the host, and the lent buffers they live in (given back by
    `HopCopies.release` once the call no longer reads them: retries re-send from them).
    `ready`: the event of the copies into them, when they may still be running (`to_host_async`)."""

    tensors: tuple[torch.Tensor, ...]
    lent: list[torch.Tensor] = field(default_factory=list)
    ready: object = None

    def wait(self) -> tuple[torch.Tensor, ...]:
        """The tensors, once their copies have completed."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.tensors


class HopCopies(Protocol):
    device: torch.device
    buffers: HostBuffers | None

    def to_host(self, *tensors: torch.Tensor) -> Staged:
        """The tensors on the host, once every copy has completed (one wait for all)."""
        ...

    def to_host_async(self, *tensors: torch.Tensor) -> Staged:
        """`to_host` with the copies queued, not waited for: `Staged.wait()` waits."""
        ...

    def release(self, staged: Staged) -> None:
        ...

    def output_buffer(self, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        """A float32 host buffer for a layer call's summed answer (page-locked on a GPU)."""
        ...

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """`host` (float32) on the device; a buffer of `output_buffer`'s is given back after its copy."""
        ...


class HostSide:
    """Attention on the CPU: the experts' tensors are already host tensors; nothing to copy."""

    buffers = None

    def __init__(self, device: torch.device | None = None):
        self.device = device or torch.device("cpu")

    def to_host(self, *tensors: torch.Tensor) -> Staged:
        return Staged(tensors)

    def to_host_async(self, *tensors: torch.Tensor) -> Staged:
        return Staged(tensors)

    def release(self, staged: Staged) -> None:
        pass

    def output_buffer(self, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float32)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        return host


class CudaHopCopies:
    """Hop copies on one side stream with page-locked buffers; see the module docstring."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        self.buffers = HostBuffers(pin=True)

    def to_host(self, *tensors: torch.Tensor) -> Staged:
        staged = self.to_host_async(*tensors)
        staged.wait()
        return staged

    def to_host_async(self, *tensors: torch.Tensor) -> Staged:
        computed = torch.cuda.current_stream(self.device).record_event()
        staged = Staged(())
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(computed)
            host = []
            for t in tensors:
                if t.device.type == "cpu":
                    host.append(t)
                    continue
                buffer = self.buffers.take(t.shape, t.dtype)
                buffer.copy_(t, non_blocking=True)
                t.record_stream(self.stream)  # the caching allocator must not reuse it before the copy
                staged.lent.append(buffer)
                host.append(buffer)
            staged.ready = self.stream.record_event()
        staged.tensors = tuple(host)
        return staged

    def release(self, staged: Staged) -> None:
        for buffer in staged.lent:
            self.buffers.give_back(buffer)
        staged.lent.clear()

    def output_buffer(self, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        return self.buffers.take(shape, torch.float32)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        lent = self._is_lent(host)
        if not lent:  # an answer made elsewhere (a local shard's): through a page-locked buffer
            buffer = self.buffers.take(host.shape, host.dtype)
            buffer.copy_(host)
            host = buffer
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            device = host.to(self.device, non_blocking=True)
            copied = self.stream.record_event()
        compute.wait_event(copied)
        device.record_stream(compute)
        self.buffers.give_back(host, copied)
        return device

    def _is_lent(self, host: torch.Tensor) -> bool:
        return self.buffers.owns(host)


def hop_copies(device: torch.device) -> HopCopies:
    """The hop copies for attention on `device`."""
    return CudaHopCopies(device) if torch.device(device).type == "cuda" else HostSide(torch.device(device))


class CopiesByDevice:
    """Each device's hop copies, made at its first layer call: a backend serves whatever device
    the transformer's tensors are on (one, in practice), and is built before the model."""

    def __init__(self):
        self._by_device: dict[torch.device, HopCopies] = {}
        self._host = HostSide()

    def __call__(self, device: torch.device) -> HopCopies:
        return self._host if device.type == "cpu" else self._on_gpu(device)

    def _on_gpu(self, device: torch.device) -> HopCopies:
        copies = self._by_device.get(device)
        if copies is None:
            copies = self._by_device[device] = hop_copies(device)
        return copies

    def host_buffer_bytes(self) -> int:
        """Page-locked host memory the hops hold (for the memory report)."""
        return sum(c.buffers.num_bytes for c in self._by_device.values() if c.buffers is not None)

    def submit(self, start: HostStart, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
               expert_weights: torch.Tensor) -> "OnDevice":
        """`start(layer, hidden, ids, weights, new_output)` on host tensors: a backend's layer call
        from a GPU (the backend checked: host tensors skip this), its handle's answer on that GPU."""
        copies = self._on_gpu(hidden.device)
        staged = copies.to_host(hidden, expert_ids, expert_weights)
        try:
            handle = start(layer, *staged.tensors, copies.output_buffer)
        except BaseException:
            copies.release(staged)
            raise
        return OnDevice(handle, copies, staged)

    def submit_ahead(self, ahead: SendAhead, start: HostStart, layer: int, hidden: torch.Tensor,
                     expert_ids: torch.Tensor, expert_weights: torch.Tensor) -> "OnDevice":
        """`submit` that returns at once: the copies to the host are queued, and `ahead`'s thread
        waits for them and starts the call (gpu/send_ahead.py)."""
        copies = self._on_gpu(hidden.device)
        staged = copies.to_host_async(hidden, expert_ids, expert_weights)
        return OnDevice(ahead.submit(lambda: start(layer, *staged.wait(), copies.output_buffer)), copies, staged)


class OnDevice:
    """A layer call's handle whose host answer is copied to the device when waited for, after
    which the call's staged host buffers are given back."""

    __slots__ = ("_handle", "_copies", "_staged", "_result")

    def __init__(self, handle, copies: HopCopies, staged: Staged):
        self._handle, self._copies, self._staged = handle, copies, staged
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._result is None:  # the host answer's buffer is given back by the first copy
            try:
                out = self._handle.wait()
            finally:
                self._copies.release(self._staged)
            self._result = self._copies.to_device(out)
        return self._result
