"""The routed experts on expert services: the remote ExpertBackend (experts/backend.py).

`RemoteExperts` splits each layer call's tokens by expert service (experts/services.py: placement
and failover), sends each service its part over a persistent link (gRPC bytes, or shared memory
on one host), and sums the parts in float32 (experts/layer_call.py). A dead service's part is
retried on a replica; with none left the call raises `ExpertsUnavailable` instead of hanging. Two
layer calls may be in flight at once (the transformer's two micro-batches: attention of one runs
while the experts of the other do). The first `local_layers` MoE layers run in this process.
"""
from __future__ import annotations

import torch

from splitmoe.attention_service.experts.backend import ExpertsHandle, HopStats, Ready, ServiceHealth
from splitmoe.attention_service.experts.layer_call import InFlightCalls
from splitmoe.attention_service.experts.placement import ExpertsUnavailable
from splitmoe.attention_service.experts.service_client import ExpertRequestError
from splitmoe.attention_service.experts.services import ExpertServices, RemoteExpertsSettings
from splitmoe.kernels.repack_cache import RepackCache
from splitmoe.modelfile.experts import ExpertKey, ExpertShard, moe_layers
from splitmoe.modelfile.gguf_file import GGUFFile

__all__ = ["RemoteExperts", "RemoteExpertsSettings", "ExpertsUnavailable", "ExpertRequestError"]


class RemoteExperts:
    """Routed experts computed by expert services; see the module docstring."""

    max_in_flight = 2  # layer calls submitted and not yet waited for (proto.doorbell.NUM_SLOTS)

    def __init__(self, g: GGUFFile, settings: RemoteExpertsSettings, repack_cache: RepackCache | None = None):
        self.settings = settings
        all_layers = moe_layers(g)
        self._local_layers = frozenset(all_layers[:settings.local_layers])
        self._local = (ExpertShard(g, layers=sorted(self._local_layers), repack_cache=repack_cache)
                       if self._local_layers else None)
        self._services = ExpertServices(g, settings, [layer for layer in all_layers if layer not in self._local_layers])
        self._in_flight = InFlightCalls(self._services, self.max_in_flight)

    # ---- ExpertBackend --------------------------------------------------------------------------

    def forward(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
                expert_weights: torch.Tensor) -> torch.Tensor:
        """The layer's summed expert output [T, D], float32, on hidden's device."""
        return self.submit(layer, hidden, expert_ids, expert_weights).wait()

    def submit(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
               expert_weights: torch.Tensor) -> ExpertsHandle:
        """Send the layer's parts now; the handle's `wait()` collects them (see ExpertBackend)."""
        if layer in self._local_layers:
            return Ready(self._local.forward(layer, hidden.cpu(), expert_ids.cpu(),
                                             expert_weights.cpu()).to(hidden.device))
        return self._in_flight.submit(layer, hidden, expert_ids, expert_weights)

    # ---- what the attention service publishes ----------------------------------------------------

    def health(self) -> dict[str, ServiceHealth]:
        return self._services.health()

    def stats(self) -> dict[str, HopStats]:
        return self._services.stats()

    def expert_token_counts(self) -> dict[ExpertKey, int]:
        """Tokens each (layer, expert) computed, summed over the services (GetStats)."""
        return self._services.expert_token_counts()

    def uncovered_layers(self) -> list[int]:
        return self._services.uncovered_layers()

    def close(self) -> None:
        self._services.close()

    def __enter__(self) -> "RemoteExperts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
