"""Where the attention side sends each MoE layer's routed tokens: the transport seam.

Every backend computes `kernels.moe`'s interface for one layer. `InProcessExperts` runs the
shard here; `RemoteExperts` splits the layer's tokens by expert service (placement), sends each
service its part over a persistent stream (gRPC bytes, or shared memory on one host), and sums
the parts in float32. A dead service's part is retried on a replica; with none left the call
raises `ExpertsUnavailable` instead of hanging.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Protocol, Sequence

import grpc
import torch

from attention_service.expert_placement import (ExpertsUnavailable, Placement, ServiceShard, assign_empty_services,
                                                format_keys)
from attention_service.expert_split import OwnerTable, ServicePart, add_part, split_by_service, unfinished_work
from attention_service.expert_service_client import (ConnectionSettings, ExpertRequestError, ExpertServiceClient,
                                                     HopFailed)
from modelfile.experts import ExpertKey, ExpertShard, expert_count, moe_layers
from modelfile.gguf_file import GGUFFile

__all__ = ["ExpertBackend", "InProcessExperts", "RemoteExperts", "RemoteExpertsSettings", "ExpertsUnavailable",
           "ExpertRequestError", "ServiceHealth", "HopStats"]
log = logging.getLogger(__name__)
TRANSPORTS = ("auto", "grpc", "shm")


class ExpertBackend(Protocol):
    def forward(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
                expert_weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, D], expert_ids [T, K], expert_weights [T, K] -> summed expert output [T, D]."""
        ...

    def health(self) -> dict[str, "ServiceHealth"]:
        """Per expert service address; empty when no service is involved."""
        ...

    def stats(self) -> dict[str, "HopStats"]:
        ...

    def expert_token_counts(self) -> dict[ExpertKey, int]:
        ...

    def close(self) -> None:
        ...


class InProcessExperts:
    """All routed experts of the file, computed in this process."""

    def __init__(self, g: GGUFFile):
        self.shard = ExpertShard(g)
        self._counts = {layer: torch.zeros(expert_count(g), dtype=torch.long) for layer in self.shard.layers}

    def forward(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
                expert_weights: torch.Tensor) -> torch.Tensor:
        ids = expert_ids.cpu()
        counts = self._counts[layer]
        counts += torch.bincount(ids[ids >= 0], minlength=counts.numel())  # -1: a dropped slot
        out = self.shard.forward(layer, hidden.cpu(), ids, expert_weights.cpu())
        return out.to(hidden.device)

    def health(self) -> dict[str, "ServiceHealth"]:
        return {}

    def stats(self) -> dict[str, "HopStats"]:
        return {}

    def expert_token_counts(self) -> dict[ExpertKey, int]:
        return {ExpertKey(layer, e): n for layer, c in self._counts.items()
                for e, n in enumerate(c.tolist()) if n}

    def close(self) -> None:
        pass


@dataclass(frozen=True, slots=True)
class RemoteExpertsSettings:
    addresses: tuple[str, ...]                 # host:port of every expert service (replicas included)
    expert_timeout_s: float = 10.0             # deadline of every hop and every control RPC
    connect_timeout_s: float = 1.0             # one reconnect attempt to a service marked unhealthy
    reconnect_interval_s: float = 1.0          # how often unhealthy services are retried in the background
    startup_wait_s: float = 60.0               # how long startup waits for services to come up
    transport: str = "auto"                    # auto: shared memory with services on this host, else gRPC
    local_layers: int = 0                      # the first N MoE layers' experts run in-process (--n-cpu-moe)
    max_message_bytes: int = 1 << 30           # 1 GiB: a long prefill's hidden states in one message
    shm_initial_bytes: int = 4 << 20           # per connection; grows to the largest request

    def __post_init__(self) -> None:
        if not self.addresses:
            raise ValueError("remote experts need at least one expert service address")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport {self.transport!r}: want one of {', '.join(TRANSPORTS)}")
        if min(self.expert_timeout_s, self.connect_timeout_s, self.reconnect_interval_s) <= 0:
            raise ValueError("expert timeouts and intervals must be positive")
        if self.local_layers < 0:
            raise ValueError(f"local_layers {self.local_layers}: must be >= 0")
        if len(set(self.addresses)) != len(self.addresses):
            raise ValueError(f"expert service addresses repeat: {', '.join(self.addresses)}")

    def connection(self) -> ConnectionSettings:
        return ConnectionSettings(self.expert_timeout_s, self.connect_timeout_s, self.transport,
                                  self.max_message_bytes, self.shm_initial_bytes)


@dataclass(frozen=True, slots=True)
class ServiceHealth:
    healthy: bool
    shard: ServiceShard
    transport: str       # "grpc" | "shm" | "" while disconnected
    last_error: str


@dataclass(frozen=True, slots=True)
class HopStats:
    num_hops: int
    hop_s_total: float       # request sent -> answer received, per hop, summed
    compute_s_total: float   # time inside the service's expert kernels
    sent_bytes: int
    received_bytes: int


class RemoteExperts:
    """Routed experts computed by expert services; see the module docstring."""

    def __init__(self, g: GGUFFile, settings: RemoteExpertsSettings):
        self.settings = settings
        all_layers = moe_layers(g)
        self._local_layers = frozenset(all_layers[:settings.local_layers])
        self._local = ExpertShard(g, layers=sorted(self._local_layers)) if self._local_layers else None
        self._clients = [ExpertServiceClient(a, settings.connection()) for a in resolve_addresses(settings.addresses)]
        self._owner_tables: dict[tuple[int, tuple[bool, ...]], OwnerTable] = {}
        # One layer call at a time: each connection has one request in flight (and one shm arena).
        self._layer_lock = threading.Lock()
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
        if layer in self._local_layers:
            return self._local.forward(layer, hidden.cpu(), expert_ids.cpu(), expert_weights.cpu()).to(hidden.device)
        with self._layer_lock:
            return self._forward_remote(layer, hidden, expert_ids, expert_weights)

    def _forward_remote(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
                        expert_weights: torch.Tensor) -> torch.Tensor:
        x, weights = hidden.detach().cpu(), expert_weights.detach().cpu().float()
        out = torch.zeros(x.shape, dtype=torch.float32)
        work = expert_ids.cpu()
        # Each failed round marks a service unhealthy, so this ends; the bound stops flapping services.
        for _ in range(len(self._clients) + 1):
            failed = self._exchange(layer, x, weights, self._plan(layer, work), out)
            if not failed:
                return out.to(hidden.device)
            work = unfinished_work(work.shape, failed)
        raise ExpertsUnavailable(f"layer {layer}: expert services kept failing: {self._describe_failures()}")

    # ---- what the attention service publishes ----------------------------------------------------

    def health(self) -> dict[str, ServiceHealth]:
        return {c.address: ServiceHealth(c.healthy, c.shard, c.transport, c.last_error) for c in self._clients}

    def stats(self) -> dict[str, HopStats]:
        return {c.address: HopStats(c.counters.num_hops, c.counters.hop_s, c.counters.compute_s,
                                    c.counters.sent_bytes, c.counters.received_bytes) for c in self._clients}

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

    def _exchange(self, layer: int, x: torch.Tensor, weights: torch.Tensor, parts: list[ServicePart],
                  out: torch.Tensor) -> list[ServicePart]:
        """Send every part, then collect them all into `out`; returns the parts that got no answer.

        Every hop is waited for before an error is raised: a service still working on an
        abandoned request would otherwise share its shared-memory slots with the next one.
        """
        hops = [self._clients[p.service].submit(layer, x, p.rows, p.expert_ids, weights) for p in parts]
        failed, rejected = [], []
        for part, hop in zip(parts, hops):
            try:
                add_part(out, part.rows, self._clients[part.service].wait(hop))
            except HopFailed:
                failed.append(part)
            except ExpertRequestError as e:
                rejected.append(e)
        if rejected:
            raise rejected[0]
        return failed

    def _owners(self, layer: int) -> OwnerTable:
        healthy = tuple(c.healthy for c in self._clients)
        table = self._owner_tables.get((layer, healthy))
        if table is None:  # once per layer and health state: a handful per run
            table = self._owner_tables[(layer, healthy)] = OwnerTable.of(self.placement.owners(layer, healthy), len(self._clients))
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
        while not self._stop.wait(self.settings.reconnect_interval_s):
            for client in self._clients:
                if not client.healthy and not self._stop.is_set():
                    client.revive()


# ---- startup --------------------------------------------------------------------------------

def resolve_addresses(addresses: Sequence[str]) -> list[str]:
    """One address per service. A name resolving to several IPs stands for all of them: that is
    how `docker compose --scale expert=N` presents N replicas behind the one name `expert`."""
    resolved: list[str] = []
    for address in addresses:
        host, _, port = address.rpartition(":")
        ips = _resolve(host.strip("[]"), port)
        for each in ([address] if len(ips) <= 1 else [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips]):
            if each not in resolved:
                resolved.append(each)
    return resolved


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
            raise ExpertsUnavailable(f"expert service {client.address} did not answer within "
                                     f"{wait_s:g} s: {e.code().name}: {e.details()}") from None
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
