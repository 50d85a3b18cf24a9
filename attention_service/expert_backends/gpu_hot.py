"""Hot experts on the GPU (`--gpu-experts N|SIZE`): an expert backend that computes some (layer,
expert) pairs in GPU memory (expert_backends/device_experts.py) and hands the rest to another backend.

Each layer call's routing is split on the device: the GPU's part is queued there, the rest goes
to the wrapped backend (expert services, or the CPU in this process) as -1 slots it skips, and the
two sums are added in float32 when the call is waited for, as any two services' parts are. A layer
whose every expert is on the GPU never leaves it: no hop, no host wait, and the static decode step
runs it inside a segment (`device_layers`), so with every layer there the whole step is one graph.

Which pairs: the hottest by the heat file's rates (`--heat-file`, written by an earlier run), within
the budget; without one, whole MoE layers from the first, as many as fit (llama.cpp's `--n-cpu-moe`
keeps the last layers' experts on the CPU in the same way). The set is chosen once, at start: a
restart with the heat file moves the current hottest in (the CPU's `--local-experts-by-heat` is
the one that follows the traffic while serving).
"""
from __future__ import annotations

import logging

import torch

from splitmoe.attention_service.expert_backends.backend import (
    ExpertsHandle,
    HopStats,
    InProcessExperts,
    Ready,
    ServiceHealth,
)
from splitmoe.attention_service.expert_backends.device_experts import (
    DeviceExperts,
    choose_device_experts,
    expert_device_bytes,
)
from splitmoe.attention_service.expert_backends.heat import HeatSnapshot
from splitmoe.attention_service.expert_backends.load_plan import HeatBudget
from splitmoe.attention_service.expert_backends.remote import RemoteExperts
from splitmoe.modelfile.expert_tensors import ExpertKey, expert_count, moe_layers
from splitmoe.modelfile.gguf_file import GGUFFile

log = logging.getLogger(__name__)


def choose_gpu_experts(g: GGUFFile, budget: HeatBudget, tokens_per_s: torch.Tensor | None,
                       dtype: torch.dtype = torch.bfloat16) -> list[ExpertKey]:
    """The pairs for the GPU (see the module docstring): by heat when there is some, else whole
    layers from the first."""
    if tokens_per_s is not None and bool((tokens_per_s > 0).any()):
        return choose_device_experts(g, tokens_per_s, budget, dtype)
    num_experts = expert_count(g)
    keys: list[ExpertKey] = []
    used_bytes = 0
    for layer in moe_layers(g):
        layer_bytes = num_experts * expert_device_bytes(g, layer, dtype)
        count_full = budget.num_experts and len(keys) + num_experts > budget.num_experts
        if count_full or (budget.num_bytes and used_bytes + layer_bytes > budget.num_bytes):
            break
        keys += [ExpertKey(layer, e) for e in range(num_experts)]
        used_bytes += layer_bytes
    return keys


class PlusDevice:
    """A layer call's handle whose other backend's sum gets the GPU's part added (float32)."""

    __slots__ = ("_handle", "_local")

    def __init__(self, handle: ExpertsHandle, local: torch.Tensor):
        self._handle, self._local = handle, local

    def wait(self) -> torch.Tensor:
        return self._handle.wait() + self._local


class GpuHotExperts:
    """An ExpertBackend: the GPU's pairs here, the rest through `inner`; see the module docstring."""

    def __init__(self, inner: InProcessExperts | RemoteExperts, device_experts: DeviceExperts, num_layers: int,
                 num_experts: int):
        self.inner, self.gpu = inner, device_experts
        full = {layer: set() for layer in device_experts.layers}
        for key in device_experts.keys:
            full[key.layer].add(key.expert)
        self._full = frozenset(layer for layer, experts in full.items() if len(experts) == num_experts)
        # Tokens the GPU's pairs computed, counted on the device (no host wait), folded into the
        # wrapped backend's heat when it is read: the heat must see every routed token.
        self._counts = torch.zeros(num_layers, num_experts + 1, dtype=torch.int64, device=device_experts.device)
        self._folded = torch.zeros(num_layers, num_experts, dtype=torch.int64)
        if hasattr(inner, "rebalance"):  # the Rebalance RPC asks whether the backend can
            self.rebalance = self._rebalance
        log.info("hot experts on %s: %d pairs (%d whole layers), %.0f MiB", device_experts.device,
                 len(device_experts.keys), len(self._full), device_experts.num_bytes / 2**20)

    def device_layers(self) -> frozenset[int]:
        """Layers computed entirely on the device, with no host wait (model/static_decode.py)."""
        return self._full

    def forward(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
                expert_weights: torch.Tensor) -> torch.Tensor:
        return self.submit(layer, hidden, expert_ids, expert_weights).wait()

    def submit(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
               expert_weights: torch.Tensor) -> ExpertsHandle:
        return self._submit(self.inner.submit, layer, hidden, expert_ids, expert_weights)

    def submit_ahead(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
                     expert_weights: torch.Tensor) -> ExpertsHandle:
        """`submit` with the wrapped backend's part sent ahead (gpu/send_ahead.py)."""
        return self._submit(self.inner.submit_ahead, layer, hidden, expert_ids, expert_weights)

    def _submit(self, inner_submit, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
                expert_weights: torch.Tensor) -> ExpertsHandle:
        """The GPU's part queued on the device first, the rest through `inner_submit`."""
        if not self.gpu.has_layer(layer) or hidden.device != self.gpu.device:
            return inner_submit(layer, hidden, expert_ids, expert_weights)
        if layer in self._full:  # no hop
            self._count(layer, expert_ids)
            return Ready(self.gpu.forward(layer, hidden, expert_ids, expert_weights))
        here, there = self.gpu.split(layer, expert_ids)
        local = self.gpu.forward(layer, hidden, here, expert_weights)
        self._count(layer, here)
        return PlusDevice(inner_submit(layer, hidden, there, expert_weights), local)

    def _count(self, layer: int, expert_ids: torch.Tensor) -> None:
        ids = expert_ids.reshape(-1) + 1  # -1 (not here) lands in column 0
        self._counts[layer].scatter_add_(0, ids, torch.ones_like(ids))

    # ---- what the attention service publishes: the wrapped backend's, with the GPU's tokens ------

    def expert_heat(self) -> HeatSnapshot:
        self._fold_counts()
        return self.inner.expert_heat()

    def expert_token_counts(self) -> dict[ExpertKey, int]:
        counts = dict(self.inner.expert_token_counts())
        table = self._counts[:, 1:].cpu()
        for key in self.gpu.keys:
            counts[key] = counts.get(key, 0) + int(table[key.layer, key.expert])
        return counts

    def placement_view(self) -> dict[ExpertKey, tuple[str, ...]]:
        view = dict(self.inner.placement_view())
        for key in self.gpu.keys:
            view[key] = ("gpu", *(p for p in view.get(key, ()) if p != "local"))
        return view

    def _fold_counts(self) -> None:
        table = self._counts[:, 1:].to("cpu", copy=True)  # a copy also where the device is the CPU
        self.inner.heat.add_table(table - self._folded)
        self._folded = table

    def health(self) -> dict[str, ServiceHealth]:
        return self.inner.health()

    def stats(self) -> dict[str, HopStats]:
        return self.inner.stats()

    def imbalance_meter(self) -> tuple[float, float, int]:
        return self.inner.imbalance_meter()

    def uncovered_layers(self) -> list[int]:
        return self.inner.uncovered_layers()

    def device_bytes(self) -> tuple[int, int]:
        return self.gpu.num_bytes, self.inner.device_bytes()[1]

    def _rebalance(self, dry_run: bool = False):
        """The wrapped backend's placement by load (the GPU's set stays: see the module docstring)."""
        self._fold_counts()
        return self.inner.rebalance(dry_run=dry_run)

    def close(self) -> None:
        self.inner.close()
