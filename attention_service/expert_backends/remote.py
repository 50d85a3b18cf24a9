"""The routed experts on expert services: the remote ExpertBackend (expert_backends/backend.py).

`RemoteExperts` splits each layer call's tokens by expert service (expert_backends/services.py: placement
and failover), sends each service its part over a persistent link (gRPC bytes, or shared memory
on one host), and sums the parts in float32 (expert_backends/layer_call.py). A dead service's part is
retried on a replica; with none left the call raises `ExpertsUnavailable` instead of hanging. Two
layer calls may be in flight at once (the transformer's two micro-batches: attention of one runs
while the experts of the other do). The first `local_layers` MoE layers run in this process, and
so do the hot experts (`local_by_heat`: expert_backends/hot.py).

Every layer call's routing is counted (expert_backends/heat.py). `rebalance` moves the experts while
serving: from the heat it plans which experts stay here and which service hosts (and replicates)
which (expert_backends/load_plan.py); the services load their new pairs beside the old, the placement
switches between two layer calls, then the old pairs are released. No call is dropped: each runs
entirely on one placement, whose experts stay loaded until it is done. A membership change (a
service joining or leaving while serving: expert_backends/membership.py) goes the same three steps,
with the new set of services.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from dataclasses import dataclass

import grpc
import torch

from splitmoe.attention_service.expert_backends.auto_rebalance import AutoRebalancer
from splitmoe.attention_service.expert_backends.backend import ExpertsHandle, HopStats, Ready, ServiceHealth
from splitmoe.attention_service.expert_backends.direct_hop import DirectHop
from splitmoe.attention_service.expert_backends.heat import ExpertHeat, HeatSnapshot, load_heat, save_heat
from splitmoe.attention_service.expert_backends.hot import HotExperts, PlusLocal
from splitmoe.attention_service.expert_backends.layer_call import InFlightCalls
from splitmoe.attention_service.expert_backends.load_plan import choose_hot, imbalance, plan_by_load
from splitmoe.attention_service.expert_backends.membership import Candidate, Change, Membership
from splitmoe.attention_service.expert_backends.placement import ExpertsUnavailable, Placement, ServiceShard, reshare
from splitmoe.attention_service.expert_backends.service_client import ExpertRequestError, HopFailed
from splitmoe.attention_service.expert_backends.services import ExpertServices, RemoteExpertsSettings
from splitmoe.attention_service.expert_backends.shm_link import HopLora
from splitmoe.attention_service.gpu.hop_copies import CopiesByDevice
from splitmoe.attention_service.gpu.send_ahead import SendAhead
from splitmoe.kernels.expert_lora import LoraRows
from splitmoe.kernels.repack_cache import RepackCache
from splitmoe.modelfile.expert_tensors import ExpertKey, ExpertShard, expert_count, load_layer_experts, moe_layers
from splitmoe.modelfile.gguf_file import GGUFFile
from splitmoe.modelfile.hparams import ModelConfig
from splitmoe.modelfile.lora_adapter import AdapterRef

__all__ = ["RemoteExperts", "RemoteExpertsSettings", "ExpertsUnavailable", "ExpertRequestError", "RebalanceReport"]
log = logging.getLogger(__name__)
MIN_GAIN = 0.02  # a new placement must cut the predicted imbalance by 2% to be worth moving experts


@dataclass(frozen=True, slots=True)
class RebalanceReport:
    changed: bool
    imbalance_before: float   # predicted from the heat: max over mean tokens per service, on the old placement
    imbalance_after: float    # the same, on the new one
    num_hot: int              # (layer, expert) pairs now computed in this process
    num_loaded: int           # pairs a service loaded that it did not host before
    seconds: float
    reason: str


class RemoteExperts:
    """Routed experts computed by expert services; see the module docstring."""

    max_in_flight = 2  # layer calls submitted and not yet waited for (proto.doorbell.NUM_SLOTS)
    # LoRA adapters on routed experts: each hop names its rows' adapters, which the services load
    # themselves (expert_service/adapters.py); local layers and hot experts apply them here.
    takes_lora = True

    def __init__(self, g: GGUFFile, settings: RemoteExpertsSettings, repack_cache: RepackCache | None = None):
        self.settings = settings
        all_layers = moe_layers(g, nextn=settings.nextn_layers)
        self._g, self._repack_cache = g, repack_cache
        self._num_experts = expert_count(g)
        self.heat = ExpertHeat(ModelConfig.from_gguf(g).num_blocks, self._num_experts, settings.heat_half_life_s)
        # read before connecting: a heat file of another model fails the start, and leaves nothing open
        rates = load_heat(settings.heat_file, g.file_id, self.heat.shape) if settings.heat_file else None
        self._local_layers = frozenset(all_layers[:settings.local_layers])
        self._local = (ExpertShard(g, layers=sorted(self._local_layers), repack_cache=repack_cache)
                       if self._local_layers else None)
        self._services = ExpertServices(g, settings, [layer for layer in all_layers if layer not in self._local_layers])
        self.copies = CopiesByDevice()
        self._ahead = SendAhead()
        self._in_flight = InFlightCalls(self._services, self.max_in_flight)
        self._hot: HotExperts | None = None
        self._rebalance_lock = threading.Lock()
        self._expert_bytes: dict[int, int] = {}
        if rates is not None:
            self.heat.seed(rates)  # the previous run's traffic decides what starts here
            self._hot = self._choose_hot(rates)
            if self._hot is not None:
                log.info("hot experts kept in this process (from %s): %d pairs, %d bytes",
                         settings.heat_file, len(self._hot.keys), self._hot.num_bytes)
        self._membership = Membership(settings.addresses, lambda: self._services.clients, self.change_members,
                                      settings.resolve_interval_s, settings.hosts_file)
        self._membership.start()
        self._auto = (AutoRebalancer(self._services.meter.read, self.rebalance, settings.auto_rebalance_imbalance,
                                     settings.auto_rebalance_interval_s)
                      if settings.auto_rebalance_imbalance else None)

    # ---- ExpertBackend --------------------------------------------------------------------------

    def forward(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
                expert_weights: torch.Tensor, lora: LoraRows | None = None) -> torch.Tensor:
        """The layer's summed expert output [T, D], float32, on hidden's device. `lora`: (an
        adapter's tensors for this layer, its rows) pairs (model/lora.py StepLora.expert_rows)."""
        return self.submit(layer, hidden, expert_ids, expert_weights, lora).wait()

    def submit(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
               expert_weights: torch.Tensor, lora: LoraRows | None = None) -> ExpertsHandle:
        """Send the layer's parts now; the handle's `wait()` collects them (see ExpertBackend).

        From a GPU the three tensors come to the host together (one wait: gpu/hop_copies.py) and
        the answer goes back asynchronously when waited for. The one device check of a layer call."""
        start = self._submit_host if not lora else functools.partial(self._submit_host, lora=lora)
        if hidden.device.type == "cpu":
            return start(layer, hidden, expert_ids, expert_weights)
        return self.copies.submit(start, layer, hidden, expert_ids, expert_weights)

    def submit_ahead(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
                     expert_weights: torch.Tensor) -> ExpertsHandle:
        """`submit` that returns at once: the send-ahead thread waits for the rows' copy to the host
        and sends them (gpu/send_ahead.py: the GPU's two micro-batches)."""
        return self.copies.submit_ahead(self._ahead, self._submit_host, layer, hidden, expert_ids, expert_weights)

    def _submit_host(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, expert_weights: torch.Tensor,
                     new_output=None, lora: LoraRows | None = None) -> ExpertsHandle:
        """`submit` on host tensors; `new_output`: where the services' sum goes (layer_call.py)."""
        self.heat.add(layer, ids)
        if layer in self._local_layers:  # computed here: the adapters' tensors as they are
            return Ready(self._local.forward(layer, hidden, ids, expert_weights, lora=lora))
        hop_lora = adapters_of(lora) if lora else None  # the services are told which files
        hot = self._hot  # read once: a rebalance replaces it whole
        if hot is None or not hot.has_layer(layer):
            return self._in_flight.submit(layer, hidden, ids, expert_weights, new_output, hop_lora)
        here, there = hot.split(layer, ids)
        handle = self._in_flight.submit(layer, hidden, there, expert_weights, new_output, hop_lora)  # services first
        return PlusLocal(handle, hot.forward(layer, hidden, here, expert_weights, lora))

    def direct_hop(self, layer: int, num_rows: int, top_k: int, hidden_size: int) -> DirectHop | None:
        """The layer's hop for native code to send and read itself (direct_hop.py), where the usual
        path would send the whole routing to one service: no local layer, no hot experts here, one
        service computing all of them; None otherwise. The heat counts the hop natively."""
        if layer in self._local_layers or (self._hot is not None and self._hot.has_layer(layer)):
            return None
        return self._in_flight.direct(layer, num_rows, top_k, hidden_size, self.heat.counts_row(layer))

    def prepare_lora(self, ref: AdapterRef) -> None:
        """Have every connected service load and check the adapter now: a file it cannot read, or
        another file than this one at the path, fails the load (ValueError, one line naming the
        service) instead of the first request that uses it. A service away now, or one that joins
        later, loads it at its first hop naming it."""
        for client in self._services.clients:
            if not client.healthy:
                continue
            try:
                client.prepare_lora(ref)
            except grpc.RpcError as e:
                raise ValueError(f"expert service {client.address}: {e.details() or e.code().name}") from None

    # ---- placement by load ----------------------------------------------------------------------

    def rebalance(self, dry_run: bool = False) -> RebalanceReport:
        """Re-place the experts by their measured heat (see the module docstring); `dry_run`:
        only report what the new placement would change."""
        with self._rebalance_lock:
            start_s = time.perf_counter()
            rates = self.heat.snapshot().tokens_per_s
            hot = self._choose_hot(rates)
            load = self._remote_load(rates, hot)
            services, layers = self._services, self._services.placement.layers
            targets = [ServiceShard.of_keys(address, keys)
                       for address, keys in zip(services.addresses, plan_by_load(
                           load, layers, services.num_services, self.settings.rebalance_spare_slots))]
            placement = Placement.build(targets, layers, self._num_experts, split_tokens=True, load=load)
            before, after = (imbalance(load, self._all_healthy_owners(p), layers, services.num_services)
                             for p in (services.placement, placement))
            hot_keys = hot.keys if hot is not None else ()
            same_hot = hot_keys == (self._hot.keys if self._hot is not None else ())
            num_loaded = sum(len(set(t.keys()) - set(old.keys())) for t, old in zip(targets, services.placement.shards))
            report = RebalanceReport(False, before, after, len(hot_keys), num_loaded, 0.0, "")
            if dry_run or (after > before * (1 - MIN_GAIN) and same_hot):
                why = "dry run" if dry_run else f"no gain: imbalance {before:.3f} -> {after:.3f}"
                return dataclasses.replace(report, seconds=time.perf_counter() - start_s, reason=why)
            self._switch(targets, placement, hot)
            self._save_heat(rates)
            report = dataclasses.replace(report, changed=True, seconds=time.perf_counter() - start_s,
                                         reason=f"imbalance {before:.3f} -> {after:.3f}")
            log.info("rebalanced in %.2f s: %s; %d pairs loaded, %d kept in this process",
                     report.seconds, report.reason, num_loaded, len(hot_keys))
            return report

    # ---- membership, while serving (membership.py) -------------------------------------------------

    def announce(self, address: str, server_name: str = "", instance_id: str = "") -> tuple[bool, str]:
        """An expert service announcing itself (JoinExperts): (already a member, what happens next)."""
        return self._membership.announce(Candidate(address, server_name, instance_id))

    def change_members(self, change: Change) -> None:
        """Add the joining services that pass their health check and let the leaving ones go: the
        new share of the experts is loaded first (newcomers load theirs, the staying services what
        the leavers hosted alone), the placement switches between two layer calls, then the old
        pairs are released and the leavers' links closed. On a failure the old set keeps serving."""
        with self._rebalance_lock:
            services = self._services
            leaving = [client for client, _ in change.leaving]
            staying = [c for c in services.clients if all(c is not gone for gone in leaving)]
            member_ids = {c.instance_id for c in staying if c.instance_id}
            newcomers = []
            for candidate in change.joining:
                client, why = services.check_candidate(candidate.address, candidate.server_name, member_ids)
                if client is None:
                    self._membership.candidate_failed(candidate, why)
                    continue
                newcomers.append(client)
                member_ids.add(client.instance_id)
            if not newcomers and not leaving:
                return
            members = staying + newcomers
            if not any(c.healthy for c in staying) and not newcomers:
                log.warning("not letting %s go: no other expert service would be left",
                            ", ".join(c.address for c in leaving))
                return
            try:
                targets, placement = self._plan_members(members, newcomers)
                services.load_beside(targets, members)
                for client in newcomers:
                    client.open_stream(client.shard)
            except (ExpertsUnavailable, HopFailed, grpc.RpcError) as e:
                why = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else str(e)
                log.warning("expert services unchanged (%s joining, %s leaving): %s",
                            ", ".join(c.address for c in newcomers) or "none",
                            ", ".join(c.address for c in leaving) or "none", why)
                for client in newcomers:
                    client.close()
                return
            with self._in_flight.drained():  # between two layer calls, as a rebalance switches
                services.replace_members(members, placement)
            services.release_old(targets, members)
            for client, why in change.leaving:
                client.close()  # a draining service sees its last link close, and exits
                log.info("expert service %s left (%s); its experts are computed by the others", client.address, why)
            for client in newcomers:
                self._membership.joined(client.address)
                log.info("expert service %s joined: %s over %s", client.address, client.shard.label(), client.transport)

    def _plan_members(self, members: list, newcomers: list) -> tuple[list[ServiceShard], Placement]:
        """The members' targets and the placement over them: by load (EPLB, as `rebalance`) where
        the placement is one already and every member can load; else the fewest pairs moved."""
        old, layers = self._services.placement, self._services.placement.layers
        movable = [c.healthy or any(c is n for n in newcomers) for c in members]
        if old.split_tokens and all(movable):
            load = self._remote_load(self.heat.snapshot().tokens_per_s, self._hot)
            keys = plan_by_load(load, layers, len(members), self.settings.rebalance_spare_slots)
            targets = [ServiceShard.of_keys(c.address, k, c.shard.hostname) for c, k in zip(members, keys)]
            return targets, Placement.build(targets, layers, self._num_experts, split_tokens=True, load=load)
        keys = reshare([c.shard for c in members], movable, layers, self._num_experts)
        targets = [ServiceShard.of_keys(c.address, k, c.shard.hostname) for c, k in zip(members, keys)]
        return targets, Placement.build(targets, layers, self._num_experts)

    @staticmethod
    def _remote_load(rates: torch.Tensor, hot: HotExperts | None) -> torch.Tensor:
        """The services' load: the rates, less the pairs this process computes itself."""
        load = rates.clone()
        for key in (hot.keys if hot is not None else ()):
            load[key] = 0.0
        return load

    def placement_now(self) -> tuple[Placement, HotExperts | None]:
        """The placement in use, to come back to with `restore_placement` (benchmarks compare
        placements on one workload)."""
        return self._services.placement, self._hot

    def restore_placement(self, saved: tuple[Placement, HotExperts | None]) -> None:
        placement, hot = saved
        with self._rebalance_lock:
            self._switch(list(placement.shards), placement, hot)

    def _switch(self, targets: list[ServiceShard], placement: Placement, hot: HotExperts | None) -> None:
        services = self._services
        services.require_all_up()
        services.load_beside(targets)
        with self._in_flight.drained():  # between two layer calls: nothing planned on the old one is in flight
            services.switch_to(placement)
            services.meter.reset()
            self._hot = hot
        services.release_old(targets)

    def _choose_hot(self, rates: torch.Tensor) -> HotExperts | None:
        budget = self.settings.local_by_heat
        layers = [layer for layer in self._services.placement.layers]
        keys = choose_hot(rates, layers, budget, self._bytes_of_expert) if budget else []
        if not keys:
            return None
        if self._hot is not None and self._hot.keys == tuple(sorted(keys)):
            return self._hot
        return HotExperts(self._g, keys, *self.heat.shape, self._repack_cache, prepare_fast=True)

    def _bytes_of_expert(self, layer: int) -> int:
        if layer not in self._expert_bytes:  # views of the mmap: nothing read
            self._expert_bytes[layer] = load_layer_experts(self._g, layer, [0])[0].num_bytes
        return self._expert_bytes[layer]

    @staticmethod
    def _all_healthy_owners(placement: Placement):
        healthy = [True] * len(placement.shards)
        return lambda layer: placement.owners(layer, healthy)

    def _save_heat(self, rates: torch.Tensor) -> None:
        if self.settings.heat_file:
            try:
                save_heat(self.settings.heat_file, self._g.file_id, rates)
            except OSError as e:
                log.warning("heat file %s not written: %s", self.settings.heat_file, e)

    def imbalance_meter(self) -> tuple[float, float, int]:
        """The traffic's measured imbalance since the last rebalance (services.ImbalanceMeter.read)."""
        return self._services.meter.read()

    def placement_view(self) -> dict[ExpertKey, tuple[str, ...]]:
        """Where each remote (layer, expert) is computed now: service addresses, or "local"."""
        placement, hot = self._services.placement, self._hot
        addresses = self._services.addresses
        view = {key: tuple(addresses[i] for i in services) for key, services in placement.replicas.items()}
        for key in (hot.keys if hot is not None else ()):
            view[key] = ("local",)
        for layer in self._local_layers:
            view.update({ExpertKey(layer, e): ("local",) for e in range(self._num_experts)})
        return view

    # ---- what the attention service publishes ----------------------------------------------------

    def health(self) -> dict[str, ServiceHealth]:
        return self._services.health()

    def stats(self) -> dict[str, HopStats]:
        return self._services.stats()

    def expert_token_counts(self) -> dict[ExpertKey, int]:
        """Tokens each (layer, expert) computed, summed over the services (GetStats)."""
        return self._services.expert_token_counts()

    def expert_heat(self) -> HeatSnapshot:
        return self.heat.snapshot()

    def uncovered_layers(self) -> list[int]:
        return self._services.uncovered_layers()

    def device_layers(self) -> frozenset[int]:
        return frozenset()

    def device_bytes(self) -> tuple[int, int]:
        return 0, self.copies.host_buffer_bytes()

    def close(self) -> None:
        self._membership.close()
        self._ahead.close()
        if self._auto is not None:
            self._auto.close()
        heat = self.heat.snapshot()
        if heat.tokens.any():  # a run that served nothing keeps the file of the one before
            self._save_heat(heat.tokens_per_s)
        self._services.close()

    def __enter__(self) -> "RemoteExperts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def adapters_of(lora: LoraRows) -> HopLora:
    """Each adapter's file (its name, path and identity, which a hop names) and rows."""
    found = []
    for layer_lora, rows in lora:
        if layer_lora.adapter is None:
            raise ValueError("LoRA expert tensors without their adapter file: expert services load the file themselves")
        found.append((layer_lora.adapter, rows.to("cpu", torch.int64)))
    return found
