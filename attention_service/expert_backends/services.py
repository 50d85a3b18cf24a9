"""The expert services the remote backend uses: their clients, the placement over them, and failover.

Startup asks every service for its shard, assigns the empty ones a part of what no one hosts,
checks that every remote (layer, expert) is hosted, and opens each service's link. Then each
layer's routed slots are planned by service (`split_by_service`, below) under the current health: a dead
service's experts go to a replica, one marked unhealthy is tried again once its reconnect interval
has passed, and a background thread revives the unhealthy services and checks the healthy ones'
shards. A hop late past its service's learned budget is re-sent to a replica when one is healthy
(the late service is then left out while `lagging`: service_client.py), so a silent host costs a
stream a fraction of a second, not the hop deadline.

Splitting by service works on routing tables `work_ids` [T, K]: slot (t, k) asks for expert
`work_ids[t, k]`, and -1 means "not wanted here" (already computed, or computed elsewhere).
Every slot goes to exactly one service, so the parts add up to the whole sum even when
replicas overlap; a service's shard skips the -1 slots and any id it does not host. The layer
call (layer_call.py) sends the parts to the services' clients itself and sums them.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import logging
import random
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import grpc
import torch

from splitmoe.attention_service.expert_backends.backend import HopStats, ServiceHealth
from splitmoe.attention_service.expert_backends.load_plan import HeatBudget
from splitmoe.attention_service.expert_backends.placement import (
    NO_OWNER,
    ExpertsUnavailable,
    Placement,
    ServiceShard,
    assign_empty_services,
    format_keys,
)
from splitmoe.attention_service.expert_backends.service_client import ConnectionSettings, ExpertServiceClient, HopFailed
from splitmoe.modelfile.expert_tensors import ExpertKey, expert_count
from splitmoe.modelfile.gguf_file import GGUFFile

log = logging.getLogger(__name__)

# ---- a layer call's routing, split by service ----------------------------------------------------

NOT_WANTED = -1
NOT_WANTED_SLOT = NO_OWNER - 1  # owner of the slots nobody should compute


@dataclass(frozen=True, slots=True)
class ServicePart:
    service: int
    rows: torch.Tensor | None  # [n] token rows the service needs; None: every row
    expert_ids: torch.Tensor   # [n, K] int32, -1 in the slots other services compute


@dataclass(frozen=True, slots=True)
class OwnerTable:
    """One layer's owners under the current health, ready for indexing by routing tables."""

    slots: torch.Tensor  # [E + 1]: service per expert, then NOT_WANTED_SLOT (what id -1 indexes);
                         # or [R, E + 1], token row t's owners in row t % R (tokens split between replicas)
    complete: bool       # every expert has an owner: no orphan check needed
    single: int | None   # the one service owning every expert of the layer, if so
    num_services: int
    few_rows_slots: torch.Tensor | None = None  # [E + 1]: owners for calls of under `split_min_rows` rows
    split_min_rows: int = 0

    @classmethod
    def of(cls, owners: torch.Tensor, num_services: int, few_rows_owners: torch.Tensor | None = None,
           split_min_rows: int = 0) -> "OwnerTable":
        """owners: [E], or [R, E] for a table dealt by token row; few_rows_owners: [E], used
        instead for calls of fewer than `split_min_rows` rows."""
        slots = _with_not_wanted(owners)
        distinct = set(owners.reshape(-1).tolist())
        if few_rows_owners is not None:
            distinct |= set(few_rows_owners.tolist())
        single = distinct.pop() if len(distinct) == 1 and NO_OWNER not in distinct else None
        if slots.dim() == 2 and slots.shape[0] == 1:
            slots = slots[0]
        few = None if few_rows_owners is None else _with_not_wanted(few_rows_owners)
        return cls(slots, NO_OWNER not in distinct, single, num_services, few, split_min_rows)

    def owner_of_slots(self, work_ids: torch.Tensor) -> torch.Tensor:
        """[T, K] owning service of every slot (id -1 indexes the last entry: not wanted)."""
        if self.few_rows_slots is not None and work_ids.shape[0] < self.split_min_rows:
            return self.few_rows_slots[work_ids]
        if self.slots.dim() == 1:
            return self.slots[work_ids]
        rows = torch.arange(work_ids.shape[0]).remainder_(self.slots.shape[0]).unsqueeze(1)
        return self.slots[rows, work_ids]


def _with_not_wanted(owners: torch.Tensor) -> torch.Tensor:
    return torch.cat([owners, owners.new_full((*owners.shape[:-1], 1), NOT_WANTED_SLOT)], dim=-1)


def split_by_service(work_ids: torch.Tensor, table: OwnerTable) -> tuple[list[ServicePart], torch.Tensor]:
    """(one part per owning service, the wanted expert ids that no service owns now)."""
    if table.single is not None:  # the common decode case: send the routing as is
        return [ServicePart(table.single, None, work_ids.to(torch.int32))], work_ids.new_empty(0)
    slot_owner = table.owner_of_slots(work_ids)
    if not table.complete:
        orphans = slot_owner == NO_OWNER
        if orphans.any():
            return [], torch.unique(work_ids[orphans])
    # Owners are >= NOT_WANTED_SLOT (-2): shift to count slots per service in one pass.
    shift = -NOT_WANTED_SLOT
    slots_per_owner = torch.bincount(slot_owner.reshape(-1) + shift, minlength=table.num_services + shift)
    services = slots_per_owner[shift:].nonzero().squeeze(1).tolist()  # a few services, not tokens
    return [_part(s, slot_owner, work_ids) for s in services], work_ids.new_empty(0)


def _part(service: int, slot_owner: torch.Tensor, work_ids: torch.Tensor) -> ServicePart:
    mine = slot_owner == service
    ids = torch.where(mine, work_ids, NOT_WANTED).to(torch.int32)
    rows = mine.any(dim=1).nonzero().squeeze(1)
    if rows.numel() == work_ids.shape[0]:
        return ServicePart(service, None, ids)
    return ServicePart(service, rows, ids[rows])


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoteExpertsSettings(ConnectionSettings):
    """Every expert service's connection settings, and how the backend uses the services."""

    addresses: tuple[str, ...]                 # host:port of every expert service (replicas included)
    reconnect_interval_s: float = 1.0          # how often unhealthy services are retried, healthy ones' shards checked
    startup_wait_s: float = 60.0               # how long startup waits for services to come up
    local_layers: int = 0                      # the first N MoE layers' experts run in-process (--n-cpu-moe)
    local_by_heat: HeatBudget = HeatBudget()   # the hottest experts (by measured rate) run in-process
    heat_file: str = ""                        # heat read at start, written at each rebalance and at close
    heat_half_life_s: float = 60.0             # of the decayed token rate per (layer, expert)
    rebalance_spare_slots: int = 1             # per service and layer, beyond an even share: room for replicas
    split_tokens_min_rows: int = 64            # from this many rows a call deals a replicated expert's tokens
                                               # between its replicas; below, each expert goes whole to one
    auto_rebalance_imbalance: float = 0.0      # rebalance when measured max/mean tokens per service passes it (0: never)
    auto_rebalance_interval_s: float = 30.0    # how often the measured imbalance is checked
    resolve_interval_s: float = 1.0            # how often the names of `addresses` are resolved again (0: never)
    hosts_file: str = ""                       # /etc/hosts-style lines read at every resolution, before DNS
    nextn_layers: bool = False                 # the NextN/MTP layers' experts placed too (--speculative mtp)

    def __post_init__(self) -> None:
        super(RemoteExpertsSettings, self).__post_init__()
        if not self.addresses:
            raise ValueError("remote experts need at least one expert service address")
        if self.reconnect_interval_s <= 0:
            raise ValueError("the reconnect interval must be positive")
        if self.local_layers < 0:
            raise ValueError(f"local_layers {self.local_layers}: must be >= 0")
        if self.resolve_interval_s < 0:
            raise ValueError(f"resolve interval {self.resolve_interval_s:g} s: must be >= 0 (0: never)")
        if self.rebalance_spare_slots < 0 or self.auto_rebalance_interval_s <= 0 or self.heat_half_life_s <= 0:
            raise ValueError("rebalance spare slots must be >= 0, intervals and half-lives positive")
        if self.auto_rebalance_imbalance and self.auto_rebalance_imbalance <= 1.0:
            raise ValueError(f"auto-rebalance threshold {self.auto_rebalance_imbalance}: max over mean is >= 1, "
                             "want e.g. 1.3 (or 0: off)")
        if len(set(self.addresses)) != len(self.addresses):
            raise ValueError(f"expert service addresses repeat: {', '.join(self.addresses)}")


class ExpertServices:
    """Every expert service's client and the placement over them, connected at construction.

    The data path (`plan`, then each part's client: layer_call.py) is for one thread at a time, as
    each client's is.
    """

    def __init__(self, g: GGUFFile, settings: RemoteExpertsSettings, layers: Sequence[int]):
        self.settings = settings
        self._g = g
        self._clients = [ExpertServiceClient(address, settings, server_name=host)
                         for address, host in resolve_addresses(settings.addresses, read_hosts_file(settings.hosts_file))]
        self._owner_tables: dict[tuple[int, tuple[bool, ...]], OwnerTable] = {}
        self.meter = ImbalanceMeter(len(self._clients))
        self._hedgeable: dict[tuple[int, int, tuple[bool, ...]], bool] = {}
        self._stop = threading.Event()
        try:
            self.placement = _connect(g, self._clients, list(layers), settings)
        except BaseException:
            self.close()
            raise
        self._reconnector = threading.Thread(target=self._reconnect_loop, name="expert-reconnect", daemon=True)
        self._reconnector.start()

    @property
    def num_services(self) -> int:
        return len(self._clients)

    @property
    def clients(self) -> list[ExpertServiceClient]:
        """By service index, as `ServicePart.service` numbers them."""
        return self._clients

    # ---- the data path --------------------------------------------------------------------------

    def plan(self, layer: int, work: torch.Tensor) -> list[ServicePart]:
        """`work` (a layer's routing table, -1: not wanted) split by the healthy service computing
        each slot; ExpertsUnavailable when some wanted expert has none."""
        if self._lagging:
            for client in self._clients:
                client.read_abandoned()
        parts, orphans = split_by_service(work, self._owners(layer, self._available()))
        if orphans.numel():  # a lagging service is better than none
            parts, orphans = split_by_service(work, self._owners(layer, self._healthy()))
        if orphans.numel() and self._revive_for(layer, orphans):
            parts, orphans = split_by_service(work, self._owners(layer, self._healthy()))
        if orphans.numel():
            raise self._unavailable(layer, orphans)
        self.meter.add(parts)
        return parts

    def single_owner(self, layer: int) -> int | None:
        """The service that computes every expert of `layer` now, where one does and none is
        lagging (the common decode case: `plan` then sends the routing to it as is); else None."""
        if self._lagging:
            return None
        return self._owners(layer, self._available()).single

    def describe_failures(self) -> str:
        return "; ".join(f"{c.address} ({c.last_error})" for c in self._clients if not c.healthy)

    # ---- what the attention service publishes ----------------------------------------------------

    def health(self) -> dict[str, ServiceHealth]:
        """Per service; a lagging one is reported unhealthy (it is left out), before keepalive or its
        deadline decides whether it is."""
        health = {}
        for c in self._clients:
            lag = c.lag_reason() if c.healthy else ""
            health[c.address] = ServiceHealth(c.healthy and not lag, c.shard, c.transport, lag or c.last_error)
        return health

    def stats(self) -> dict[str, HopStats]:
        # Unlocked: a hop may hold the data path for up to expert_timeout_s; a torn read of the
        # counters is off by one hop at most.
        return {c.address: c.counters.snapshot(c.transport) for c in self._clients}

    def expert_token_counts(self) -> dict[ExpertKey, int]:
        """Tokens each (layer, expert) computed, summed over the services (GetStats, asked of all at
        once, within stats_timeout_s; a service that does not answer counts with its last answer)."""
        asked = [client.ask_token_counts() for client in self._clients]
        totals: dict[ExpertKey, int] = {}
        for client, future in zip(self._clients, asked):
            for key, num_tokens in client.token_counts(future).items():
                totals[key] = totals.get(key, 0) + num_tokens
        return totals

    # ---- a new placement, while serving -----------------------------------------------------------

    @property
    def addresses(self) -> list[str]:
        return [c.address for c in self._clients]

    def require_all_up(self) -> None:
        """A rebalance moves experts between the services there are: none may be down meanwhile."""
        if down := self.describe_failures():
            raise ExpertsUnavailable(f"not moving experts while a service is down: {down}")

    def load_beside(self, targets: Sequence[ServiceShard], clients: Sequence[ExpertServiceClient] | None = None) -> None:
        """First step of a new placement: every service loads its new pairs beside its old ones,
        so that a layer call planned on either placement finds its experts (a service whose target
        it hosts already is not called). `clients`: the services of the new placement, when a
        membership change makes them others (default: ours)."""
        for client, target in zip(self._clients if clients is None else clients, targets):
            union = ServiceShard.of_keys(client.address, [*client.shard.keys(), *target.keys()])
            if not client.shard.covers(union):
                client.shard = client.load(union)

    def switch_to(self, placement: Placement) -> None:
        """Second step, between layer calls (InFlightCalls.drained): plan on the new placement."""
        self.placement = placement
        self._owner_tables, self._hedgeable = {}, {}

    def check_candidate(self, address: str, server_name: str,
                        member_ids: set[str]) -> tuple[ExpertServiceClient | None, str]:
        """A connected client of a service that may join (health-checked: it answers, serves this
        model and is not draining), or (None, why not). `member_ids`: the members' instance ids,
        so that one service reached at a second address is not taken for a second service."""
        client = ExpertServiceClient(address, self.settings, server_name=server_name)
        try:
            client.shard = client.describe(self.settings.connect_timeout_s)
            _check_same_model(self._g, client)
        except grpc.RpcError as e:
            why = f"{e.code().name}: {e.details()}"
        except ExpertsUnavailable as e:
            why = str(e)
        else:
            if client.draining:
                why = "it is draining"
            elif client.instance_id in member_ids:
                why = "another address of a member"
            else:
                return client, ""
        client.close()
        return None, why

    def replace_members(self, clients: list[ExpertServiceClient], placement: Placement) -> None:
        """`switch_to` with a new set of services (membership.py), between layer calls: the
        placement's service indices are positions in `clients`."""
        self._clients = clients
        self.meter.resize(len(clients))
        self.switch_to(placement)

    def release_old(self, targets: Sequence[ServiceShard], clients: Sequence[ExpertServiceClient] | None = None) -> None:
        """Last step, once no call planned on the old placement is in flight: drop the old pairs."""
        for client, target in zip(self._clients if clients is None else clients, targets):
            if target.covers(client.shard):
                continue
            # Relied on first, so that the shard check never sees the service host "too little".
            client.shard = dataclasses.replace(target, hostname=client.shard.hostname)
            client.shard = client.load(target)

    def uncovered_layers(self) -> list[int]:
        """Layers some expert of which no healthy service hosts now: requests routed there fail."""
        healthy = self._healthy()
        return [layer for layer in self.placement.layers if not self._owners(layer, healthy).complete]

    def close(self) -> None:
        self._stop.set()
        for client in self._clients:
            client.close()

    # ---- internals ------------------------------------------------------------------------------

    @property
    def _lagging(self) -> bool:
        return any(c.lagging for c in self._clients)

    def _healthy(self) -> tuple[bool, ...]:
        return tuple(c.healthy for c in self._clients)

    def _available(self) -> tuple[bool, ...]:
        return tuple(c.healthy and not c.lagging for c in self._clients)

    def can_hedge(self, layer: int, service: int) -> bool:
        """Whether every expert of `layer` that `service` hosts has another available replica (a
        lagging service runs only what nobody else can: never hedged): whether its hop may be given
        up as late (ExpertServiceClient.wait's `hedge`)."""
        if self._clients[service].lagging:
            return False
        available = self._available()
        key = (layer, service, available)
        hedgeable = self._hedgeable.get(key)
        if hedgeable is None:  # once per layer, service and health state
            experts = list(self.placement.shards[service].experts_in(layer))
            others = tuple(ok and i != service for i, ok in enumerate(available))
            slots = self._owners(layer, others).slots  # [E + 1], or [R, E + 1] dealt by token row
            hedgeable = self._hedgeable[key] = bool(experts) and bool((slots[..., experts] != NO_OWNER).all())
        return hedgeable

    def _owners(self, layer: int, healthy: tuple[bool, ...]) -> OwnerTable:
        table = self._owner_tables.get((layer, healthy))
        if table is None:  # once per layer and health state: a handful per run
            placement = self.placement
            table = self._owner_tables[(layer, healthy)] = OwnerTable.of(
                placement.owners(layer, healthy), len(self._clients), placement.whole_expert_owners(layer, healthy),
                self.settings.split_tokens_min_rows)
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


class ImbalanceMeter:
    """Measured imbalance of the traffic: per layer call, the busiest service's routed slots and
    the mean per service, each summed over calls (their ratio is what load_plan.imbalance
    predicts). Sampled: a call in `every` at random (a fixed stride would see the same layers
    every step), so that the data path pays a few microseconds per step at most. Written by the
    data path, read by any thread (a torn read is one call off)."""

    def __init__(self, num_services: int, every: int = 4):
        self.num_services, self.every = num_services, every
        self._random = random.Random(0)
        self._max = self._mean = 0.0
        self._num_calls = 0

    def add(self, parts: Sequence[ServicePart]) -> None:
        if not parts or self._random.random() * self.every >= 1.0:
            return
        slots = [int((p.expert_ids >= 0).sum()) for p in parts]
        total = sum(slots)
        if total:
            self._max += max(slots)
            self._mean += total / self.num_services
            self._num_calls += 1

    def read(self) -> tuple[float, float, int]:
        """(busiest services' slots, mean slots, layer calls measured), summed since the reset."""
        return self._max, self._mean, self._num_calls

    def reset(self) -> None:
        self._max = self._mean = 0.0
        self._num_calls = 0

    def resize(self, num_services: int) -> None:
        """A membership change: the mean is over the new number of services, from now on."""
        self.num_services = num_services
        self.reset()


def imbalance_between(earlier: tuple[float, float, int], later: tuple[float, float, int]) -> tuple[float, int]:
    """(measured imbalance, layer calls measured) between two ImbalanceMeter readings."""
    busiest, mean, num_calls = (b - a for a, b in zip(earlier, later))
    return (busiest / mean if mean > 0 else 1.0), int(num_calls)


# ---- startup --------------------------------------------------------------------------------

def resolve_addresses(addresses: Sequence[str], hosts: Mapping[str, list[str]] | None = None) -> list[tuple[str, str]]:
    """(address to dial, host name as given) per service. A name stands for every IP it resolves
    to, each one service: that is how `docker compose --scale expert=N` presents N replicas behind
    the one name `expert` (a Kubernetes headless Service, its pods), and how a rescheduled pod is
    found at its new IP (membership.py resolves again while serving). TLS certificates name
    `expert`, not an IP: the name is kept for that. A name that does not resolve (yet) is dialed
    as is. `hosts`: names to IPs that override DNS (`read_hosts_file`)."""
    resolved: dict[str, str] = {}
    for address in addresses:
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        ips = [host] if is_ip(host) else (hosts or {}).get(host) or _resolve(host, port)
        for each in ([address] if not ips else [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips]):
            resolved.setdefault(each, host)
    return list(resolved.items())


def read_hosts_file(path: str) -> dict[str, list[str]]:
    """An /etc/hosts-style file ('IP name [name ...]' per line, '#' comments): name -> its IPs in
    file order. Read at every resolution, so that editing it adds or removes services where no DNS
    can be changed (and in tests). Empty path, or no such file: {}."""
    if not path:
        return {}
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return {}
    hosts: dict[str, list[str]] = {}
    for line in text.splitlines():
        fields = line.split("#", 1)[0].split()
        for name in fields[1:]:
            hosts.setdefault(name, []).append(fields[0])
    return hosts


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


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
