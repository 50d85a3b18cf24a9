"""What the attention device's memory holds, by use: the figure a GPU user asks for first.

Counted from what the service itself allocated (the weights it loaded, the KV cache it reserved,
the hot experts it placed, what graph captures added) and from torch's caching allocator for the
rest: `workspace` is everything else torch holds (activations, the static decode's buffers,
freed blocks kept for reuse). Logged after the model loads, and published by GetStats on every
/metrics scrape (`splitmoe:gpu_memory_bytes{kind}`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

MIB = 2**20
GIB = 2**30


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    device: str                 # the GPU's name
    by_kind: dict[str, int]     # proto/attention.proto DeviceMemory's kinds

    def describe(self) -> str:
        """One log line: what each use takes, and what the device has."""
        kinds = ("weights", "kv_cache", "gpu_experts", "graphs", "workspace")
        used = ", ".join(f"{kind.replace('_', ' ')} {self.by_kind.get(kind, 0) / GIB:.2f} GiB" for kind in kinds)
        return (f"{self.device}: {used}; torch holds {self.by_kind['reserved'] / GIB:.2f} of "
                f"{self.by_kind['capacity'] / GIB:.1f} GiB; {self.by_kind.get('pinned_host', 0) / MIB:.0f} MiB of "
                "page-locked host buffers")


def tensor_bytes(root: object, device: torch.device) -> int:
    """Bytes of the distinct tensors on `device` reachable from `root` (dataclasses, lists, tuples,
    dicts): a tensor shared by two fields (tied embeddings) counts once."""
    device = resolved(device)
    seen: set[int] = set()
    total = 0
    stack = [root]
    visited: set[int] = set()
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            if node.device == device and node.untyped_storage().data_ptr() not in seen:
                seen.add(node.untyped_storage().data_ptr())
                total += node.untyped_storage().nbytes()
            continue
        if id(node) in visited:
            continue
        visited.add(id(node))
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            stack.extend(getattr(node, f.name) for f in dataclasses.fields(node))
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
        elif isinstance(node, dict):
            stack.extend(node.values())
    return total


def resolved(device: torch.device) -> torch.device:
    """`cuda` as the tensors made on it name it (`cuda:0`)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def device_memory(device: torch.device, *, weights_bytes: int, kv_cache_bytes: int, gpu_experts_bytes: int = 0,
                  graphs_bytes: int = 0, pinned_host_bytes: int = 0) -> DeviceMemory | None:
    """The report for a CUDA device; None for the CPU (its memory is the process's: runtime/memory.py)."""
    if device.type != "cuda":
        return None
    reserved = torch.cuda.memory_reserved(device)
    counted = weights_bytes + kv_cache_bytes + gpu_experts_bytes + graphs_bytes
    return DeviceMemory(torch.cuda.get_device_name(device), {
        "weights": weights_bytes, "kv_cache": kv_cache_bytes, "gpu_experts": gpu_experts_bytes,
        "graphs": graphs_bytes, "workspace": max(0, reserved - counted), "reserved": reserved,
        "capacity": torch.cuda.get_device_properties(device).total_memory, "pinned_host": pinned_host_bytes})
