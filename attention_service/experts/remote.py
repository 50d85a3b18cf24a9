"""The routed experts on expert services: the remote ExpertBackend (experts/backend.py).

`RemoteExperts` splits each layer call's tokens by expert service (placement), sends each service
its part over a persistent link (gRPC bytes, or shared memory on one host), and sums the parts in
float32. A dead service's part is retried on a replica; with none left the call raises
`ExpertsUnavailable` instead of hanging. Two layer calls may be in flight at once (the
transformer's two micro-batches: attention of one runs while the experts of the other do).
"""
from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import grpc
import torch

from splitmoe.attention_service.experts.placement import (ExpertsUnavailable, Placement, ServiceShard, assign_empty_services,
                                                format_keys)
from splitmoe.attention_service.experts.split import OwnerTable, ServicePart, add_part, split_by_service, unfinished_work
from splitmoe.attention_service.experts.service_client import (ConnectionSettings, ExpertRequestError, ExpertServiceClient,
                                                     Hop, HopFailed)
from splitmoe.attention_service.experts.backend import ExpertsHandle, HopStats, Ready, ServiceHealth
from splitmoe.kernels import native
from splitmoe.kernels.repack_cache import RepackCache
from splitmoe.modelfile.experts import ExpertKey, ExpertShard, expert_count, moe_layers
from splitmoe.modelfile.gguf_file import GGUFFile

__all__ = ["RemoteExperts", "RemoteExpertsSettings", "ExpertsUnavailable", "ExpertRequestError"]
log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoteExpertsSettings(ConnectionSettings):
    """Every expert service's connection settings, and how the backend uses the services."""

    addresses: tuple[str, ...]                 # host:port of every expert service (replicas included)
    reconnect_interval_s: float = 1.0          # how often unhealthy services are retried, healthy ones' shards checked
    startup_wait_s: float = 60.0               # how long startup waits for services to come up
    local_layers: int = 0                      # the first N MoE layers' experts run in-process (--n-cpu-moe)

    def __post_init__(self) -> None:
        super(RemoteExpertsSettings, self).__post_init__()
        if not self.addresses:
            raise ValueError("remote experts need at least one expert service address")
        if self.reconnect_interval_s <= 0:
            raise ValueError("the reconnect interval must be positive")
        if self.local_layers < 0:
            raise ValueError(f"local_layers {self.local_layers}: must be >= 0")
        if len(set(self.addresses)) != len(self.addresses):
            raise ValueError(f"expert service addresses repeat: {', '.join(self.addresses)}")


class RemoteExperts:
    """Routed experts computed by expert services; see the module docstring."""

    max_in_flight = 2  # layer calls submitted and not yet waited for (proto.doorbell.NUM_SLOTS)

    def __init__(self, g: GGUFFile, settings: RemoteExpertsSettings, repack_cache: RepackCache | None = None):
        self.settings = settings
        all_layers = moe_layers(g)
        self._local_layers = frozenset(all_layers[:settings.local_layers])
        self._local = (ExpertShard(g, layers=sorted(self._local_layers), repack_cache=repack_cache)
                       if self._local_layers else None)
        self._clients = [ExpertServiceClient(address, settings, server_name=host)
                         for address, host in resolve_addresses(settings.addresses)]
        self._owner_tables: dict[tuple[int, tuple[bool, ...]], OwnerTable] = {}
        # The data path, one thread at a time: every connection's hops are answered in order.
        self._lock = threading.Lock()
        self._in_flight: collections.deque[_LayerCall] = collections.deque()
        self._stop = threading.Event()
        try:
            remote_layers = [layer for layer in all_layers if layer not in self._local_layers]
            self.placement = _connect(g, self._clients, remote_layers, settings)
        except BaseException:
            self.close()
            raise
        self._reconnector = threading.Thread(target=self._reconnect_loop, name="expert-reconnect", daemon=True)
        self._reconnector.start()

    # ---- ExpertBackend --------------------------------------------------------------------------

    def forward(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
                expert_weights: torch.Tensor) -> torch.Tensor:
        """The layer's summed expert output [T, D], float32, on hidden's device."""
        return self.submit(layer, hidden, expert_ids, expert_weights).wait()

    def submit(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
               expert_weights: torch.Tensor) -> "ExpertsHandle":
        """Send the layer's parts now; the handle's `wait()` collects them (see ExpertBackend)."""
        if layer in self._local_layers:
            return Ready(self._local.forward(layer, hidden.cpu(), expert_ids.cpu(),
                                             expert_weights.cpu()).to(hidden.device))
        with self._lock:
            while len(self._in_flight) >= self.max_in_flight:
                self._in_flight[0].collect_locked()  # a third call: the oldest must finish first
            call = _LayerCall(self, layer, hidden, expert_ids, expert_weights)
            self._in_flight.append(call)
            call.send_locked(expert_ids if expert_ids.device.type == "cpu" else expert_ids.cpu())
        return call

    # ---- what the attention service publishes ----------------------------------------------------

    def health(self) -> dict[str, ServiceHealth]:
        return {c.address: ServiceHealth(c.healthy, c.shard, c.transport, c.last_error) for c in self._clients}

    def stats(self) -> dict[str, HopStats]:
        # Unlocked: a hop may hold the data path for up to expert_timeout_s; a torn read of the
        # counters is off by one hop at most.
        return {c.address: c.counters.snapshot(c.transport) for c in self._clients}

    def expert_token_counts(self) -> dict[ExpertKey, int]:
        """Tokens each (layer, expert) computed, summed over the healthy services (GetStats)."""
        totals: dict[ExpertKey, int] = {}
        for client in self._clients:
            if not client.healthy:
                continue
            try:
                counts = client.token_counts()
            except grpc.RpcError as e:
                log.warning("expert service %s: GetStats failed: %s", client.address, e.code().name)
                continue
            for key, num_tokens in counts.items():
                totals[key] = totals.get(key, 0) + num_tokens
        return totals

    def close(self) -> None:
        self._stop.set()
        for client in self._clients:
            client.close()

    def __enter__(self) -> "RemoteExperts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- one layer ------------------------------------------------------------------------------

    def _plan(self, layer: int, work: torch.Tensor) -> list[ServicePart]:
        parts, orphans = split_by_service(work, self._owners(layer))
        if orphans.numel() and self._revive_for(layer, orphans):
            parts, orphans = split_by_service(work, self._owners(layer))
        if orphans.numel():
            raise self._unavailable(layer, orphans)
        return parts

    def _owners(self, layer: int) -> OwnerTable:
        healthy = tuple(c.healthy for c in self._clients)
        table = self._owner_tables.get((layer, healthy))
        if table is None:  # once per layer and health state: a handful per run
            owners = self.placement.owners(layer, healthy)
            table = self._owner_tables[(layer, healthy)] = OwnerTable.of(owners, len(self._clients))
        return table

    def _revive_for(self, layer: int, orphans: torch.Tensor) -> bool:
        """Try once, now, the unhealthy replicas of experts nobody can compute (rate-limited)."""
        keys = [ExpertKey(layer, e) for e in orphans.tolist()]  # error path only
        now = time.monotonic()
        revived = False
        for i in self.placement.services_of(keys):
            client = self._clients[i]
            if not client.healthy and now - client.last_attempt_s >= self.settings.reconnect_interval_s:
                revived |= client.revive()
        return revived

    def _unavailable(self, layer: int, orphans: torch.Tensor) -> ExpertsUnavailable:
        keys = [ExpertKey(layer, e) for e in orphans.tolist()]
        services = [self._clients[i] for i in self.placement.services_of(keys)]
        down = "; ".join(f"{c.address} ({c.last_error})" for c in services)
        return ExpertsUnavailable(f"layer {layer}: no healthy expert service for {format_keys(keys)}: {down}")

    def _describe_failures(self) -> str:
        return "; ".join(f"{c.address} ({c.last_error})" for c in self._clients if not c.healthy)

    def _reconnect_loop(self) -> None:
        """Every reconnect_interval_s: revive the unhealthy services, and check that the healthy
        ones still host their part of the placement (health, and so /health, reports coverage)."""
        while not self._stop.wait(self.settings.reconnect_interval_s):
            for client in self._clients:
                if self._stop.is_set():
                    return
                if client.healthy:
                    client.check_shard()
                else:
                    client.revive()


class _LayerCall:
    """One submitted layer call: its parts in flight, then its result (or error)."""

    def __init__(self, backend: RemoteExperts, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
                 expert_weights: torch.Tensor):
        self._backend, self._layer, self._device = backend, layer, hidden.device
        # (each torch call costs microseconds: only the conversions needed)
        self._hidden = hidden.detach() if hidden.requires_grad else hidden
        weights = expert_weights.detach() if expert_weights.requires_grad else expert_weights
        self._weights = weights if weights.dtype == torch.float32 else weights.float()
        self._shape = expert_ids.shape
        self._parts: list[ServicePart] = []
        self._hops: list[Hop] = []
        self._rounds = 0
        self._out: torch.Tensor | None = None
        self._error: BaseException | None = None
        self._collected = False

    def wait(self) -> torch.Tensor:
        if not self._collected:
            with self._backend._lock:
                if not self._collected:
                    self.collect_locked()
        if self._error is not None:
            raise self._error
        return self._out

    def send_locked(self, work: torch.Tensor) -> None:
        """Plan `work` (a routing table, -1: not wanted) by service and submit every part; an
        error is kept for `collect_locked`, which first waits for whatever was sent."""
        b = self._backend
        self._rounds += 1
        self._parts, self._hops = [], []
        try:
            parts = b._plan(self._layer, work)
            hidden = self._hidden
            if hidden.device.type != "cpu" and any(p.rows is not None for p in parts):
                hidden = self._hidden = hidden.cpu()  # rows are gathered on the CPU
            weights = self._weights if self._weights.device.type == "cpu" else self._weights.cpu()
            for part in parts:
                self._hops.append(b._clients[part.service].submit(self._layer, hidden, part.rows, part.expert_ids,
                                                                  weights))
                self._parts.append(part)
        except Exception as e:  # noqa: BLE001 - handed to the waiter
            self._error = e

    def collect_locked(self) -> None:
        """Wait for every part (retrying failed ones on replicas) and sum them; keeps the error.

        Every hop is waited for before an error is kept: a service still working on an abandoned
        request would otherwise share its shared-memory slot with the next one.
        """
        b = self._backend
        b._in_flight.remove(self)
        self._collected = True
        native.park()  # the expert services compute now: this process's idle workers must not spin
        out = None  # float32 [T, D], made by the first part that arrives
        try:
            while True:
                failed, rejected = [], []
                for part, hop in zip(self._parts, self._hops):
                    try:
                        out = self._accumulate(out, part.rows, b._clients[part.service].wait(hop))
                    except HopFailed:
                        failed.append(part)
                    except ExpertRequestError as e:
                        rejected.append(e)
                self._parts, self._hops = [], []
                if self._error is not None:
                    raise self._error
                if rejected:
                    raise rejected[0]
                if not failed:
                    if out is None:  # nothing was routed anywhere
                        out = torch.zeros(self._hidden.shape, dtype=torch.float32)
                    self._out = out if self._device.type == "cpu" else out.to(self._device)
                    return
                if self._rounds > len(b._clients):  # each failed round marks a service unhealthy
                    raise ExpertsUnavailable(f"layer {self._layer}: expert services kept failing: "
                                             f"{b._describe_failures()}")
                self.send_locked(unfinished_work(self._shape, failed))
        except Exception as e:  # noqa: BLE001 - handed to the waiter
            self._error = e

    def _accumulate(self, out: torch.Tensor | None, rows: torch.Tensor | None, part_out: torch.Tensor) -> torch.Tensor:
        """out[rows] += part_out; the first part of every row is copied out of the hop's buffer."""
        if out is None:
            if rows is None:
                return part_out.to(torch.float32, copy=True)
            out = torch.zeros(self._hidden.shape, dtype=torch.float32)
        add_part(out, rows, part_out)
        return out


# ---- startup --------------------------------------------------------------------------------

def resolve_addresses(addresses: Sequence[str]) -> list[tuple[str, str]]:
    """(address to dial, host name as given) per service. A name resolving to several IPs stands
    for all of them: that is how `docker compose --scale expert=N` presents N replicas behind the
    one name `expert`; their TLS certificates name `expert`, not an IP."""
    resolved: dict[str, str] = {}
    for address in addresses:
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        ips = _resolve(host, port)
        for each in ([address] if len(ips) <= 1 else [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips]):
            resolved.setdefault(each, host)
    return list(resolved.items())


def _resolve(host: str, port: str) -> list[str]:
    """IPv4 addresses of `host` (else IPv6), in resolver order; [] when it does not resolve (yet)."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            infos = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError):
            continue
        return list(dict.fromkeys(info[4][0] for info in infos))
    return []


def _connect(g: GGUFFile, clients: list[ExpertServiceClient], layers: list[int],
             settings: RemoteExpertsSettings) -> Placement:
    """Ask every service for its shard, fill the empty ones, check coverage, open the streams."""
    shards = _describe_all(g, clients, settings.startup_wait_s)
    for i, (shard_layers, shard_experts) in assign_empty_services(shards, layers, expert_count(g)).items():
        try:
            shards[i] = clients[i].load_shard(shard_layers, shard_experts)
        except grpc.RpcError as e:
            raise ExpertsUnavailable(f"expert service {clients[i].address}: LoadShard failed: "
                                     f"{e.code().name}: {e.details()}") from None
        log.info("assigned %s", shards[i].label())
    placement = Placement.build(shards, layers, expert_count(g))
    for client, shard in zip(clients, shards):
        if not shard.is_empty:  # empty only when every layer runs locally
            try:
                client.open_stream(shard)
            except HopFailed as e:
                raise ExpertsUnavailable(f"expert service {client.address}: cannot open its stream: {e}") from None
            log.info("expert service %s over %s", shard.label(), client.transport)
    return placement


def _describe_all(g: GGUFFile, clients: list[ExpertServiceClient], wait_s: float) -> list[ServiceShard]:
    """Every service's reported shard, waiting up to `wait_s` in all for services still starting."""
    deadline_s = time.monotonic() + wait_s
    shards = []
    for client in clients:
        try:
            shard = client.describe(max(deadline_s - time.monotonic(), 0.001), wait_for_ready=True)
        except grpc.RpcError as e:
            why = (f"did not answer within {wait_s:g} s"
                   if e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE) else "refused us")
            raise ExpertsUnavailable(f"expert service {client.address} {why}: {e.code().name}: {e.details()}") from None
        _check_same_model(g, client)
        shards.append(shard)
    return shards


def _check_same_model(g: GGUFFile, client: ExpertServiceClient) -> None:
    info = client.info
    if info.file_id != g.file_id:
        raise ExpertsUnavailable(f"expert service {client.address} serves {info.file_id!r}, "
                                 f"not this model {g.file_id!r}")
    hidden_size = int(g.arch_require("embedding_length"))
    if info.hidden_size != hidden_size:
        raise ExpertsUnavailable(f"expert service {client.address}: hidden size {info.hidden_size}, ours {hidden_size}")
