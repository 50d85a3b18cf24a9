"""Which expert service computes which (layer, expert): the placement map and its failover order.

Pure bookkeeping, no I/O: the shards services report, the LoadShard assignments for services
that came up empty, the coverage check, and per-layer owner tables for the current health.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Mapping, Sequence

import torch

from splitmoe.kernels.expert_kernels import format_ranges
from splitmoe.modelfile.expert_tensors import ExpertKey

NO_OWNER = -1
MAX_DEAL_ROWS = 12  # rows of a split-tokens owner table (the lcm of 1..4 replicas)


class ExpertsUnavailable(RuntimeError):
    """Some routed experts have no healthy expert service: at startup, or mid-request."""


ByLayer = tuple[tuple[int, tuple[int, ...]], ...]  # ((layer, its experts), ...), layers ascending


@dataclass(frozen=True, slots=True)
class ServiceShard:
    """One expert service and the shard it reports hosting: every one of `experts` in every one
    of `layers`, or, when `by_layer` is set (a placement by load), exactly its pairs (`layers`
    and `experts` are then their union)."""

    address: str
    layers: tuple[int, ...] = ()
    experts: tuple[int, ...] = ()
    hostname: str = ""
    num_bytes: int = 0
    by_layer: ByLayer = ()

    @classmethod
    def of_keys(cls, address: str, keys: Iterable[ExpertKey], hostname: str = "", num_bytes: int = 0) -> "ServiceShard":
        """The shard of exactly `keys`, written as a rectangle when it is one."""
        grouped: dict[int, set[int]] = {}
        for key in keys:
            grouped.setdefault(key.layer, set()).add(key.expert)
        by_layer = tuple((layer, tuple(sorted(grouped[layer]))) for layer in sorted(grouped))
        layers = tuple(layer for layer, _ in by_layer)
        experts = tuple(sorted({e for _, es in by_layer for e in es}))
        rectangular = all(len(es) == len(experts) for _, es in by_layer)
        return cls(address, layers, experts, hostname, num_bytes, () if rectangular else by_layer)

    @property
    def is_empty(self) -> bool:
        return not self.layers or not self.experts

    def covers(self, other: "ServiceShard") -> bool:
        """Whether this shard hosts every (layer, expert) of `other`."""
        if not self.by_layer and not other.by_layer:
            return set(other.layers) <= set(self.layers) and set(other.experts) <= set(self.experts)
        return set(other.keys()) <= set(self.keys())

    def experts_in(self, layer: int) -> tuple[int, ...]:
        """The experts this shard hosts in `layer`."""
        if self.by_layer:
            return next((experts for at, experts in self.by_layer if at == layer), ())
        return self.experts if layer in self.layers else ()

    def keys(self) -> Iterator[ExpertKey]:
        if self.by_layer:
            return (ExpertKey(layer, expert) for layer, experts in self.by_layer for expert in experts)
        return (ExpertKey(layer, expert) for layer in self.layers for expert in self.experts)

    def label(self) -> str:
        if self.is_empty:
            return f"{self.address} [no experts]"
        if self.by_layer:
            num_pairs = sum(len(es) for _, es in self.by_layer)
            return f"{self.address} [{num_pairs} (layer, expert) pairs over {format_ranges('layers', self.layers)}]"
        return f"{self.address} [{format_ranges('layers', self.layers)}, {format_ranges('experts', self.experts)}]"


def split_evenly(items: Sequence[int], num_parts: int) -> list[tuple[int, ...]]:
    """Contiguous runs whose sizes differ by at most one."""
    base, extra = divmod(len(items), num_parts)
    runs, start = [], 0
    for i in range(num_parts):
        end = start + base + (i < extra)
        runs.append(tuple(items[start:end]))
        start = end
    return runs


def assign_empty_services(shards: Sequence[ServiceShard], layers: Sequence[int],
                          num_experts: int) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
    """(layers, experts) to LoadShard into each empty service, by index into `shards`.

    The uncovered experts (all of them when nothing is uncovered: the newcomers add capacity)
    are split evenly by expert ranges across all their layers; services beyond the number of
    ranges become replicas of them, round robin.
    """
    empty = [i for i, s in enumerate(shards) if s.is_empty]
    if not empty or not layers:
        return {}
    covered = {k for s in shards for k in s.keys()}
    todo = [ExpertKey(layer, e) for layer in layers for e in range(num_experts)]
    todo = [k for k in todo if k not in covered] or todo
    todo_layers = tuple(sorted({k.layer for k in todo}))
    todo_experts = sorted({k.expert for k in todo})
    runs = split_evenly(todo_experts, min(len(empty), len(todo_experts)))
    return {service: (todo_layers, runs[j % len(runs)]) for j, service in enumerate(empty)}


@dataclass(frozen=True)
class Placement:
    """(layer, expert) -> the services hosting it, for the layers computed remotely.

    `split_tokens` (a placement by load): in large layer calls an expert's tokens are dealt
    between its healthy replicas by token row; in small ones (decode) each expert goes whole to
    one replica, chosen to even the `load` the placement was planned for, since every replica
    that gets a few rows reads the expert's whole weights for them. Without `split_tokens` each
    layer's replicas take turns by layer (identical replicas share the layers)."""

    shards: tuple[ServiceShard, ...]
    layers: tuple[int, ...]
    num_experts: int
    replicas: Mapping[ExpertKey, tuple[int, ...]]
    split_tokens: bool = False
    load: torch.Tensor | None = field(default=None, compare=False)  # [layer, expert]: what it was planned for

    @classmethod
    def build(cls, shards: Sequence[ServiceShard], layers: Sequence[int], num_experts: int,
              split_tokens: bool = False, load: torch.Tensor | None = None) -> "Placement":
        """The placement, or one line naming what no service hosts."""
        replicas: dict[ExpertKey, list[int]] = {}
        wanted = set(layers)
        for i, shard in enumerate(shards):
            for key in shard.keys():
                if key.layer in wanted:
                    replicas.setdefault(key, []).append(i)
        missing = [ExpertKey(layer, e) for layer in layers for e in range(num_experts)
                   if ExpertKey(layer, e) not in replicas]
        if missing:
            raise ExpertsUnavailable(
                f"no expert service hosts {format_keys(missing)}; services: {', '.join(s.label() for s in shards)}")
        return cls(tuple(shards), tuple(layers), num_experts, {k: tuple(v) for k, v in replicas.items()}, split_tokens,
                   load)

    def owners(self, layer: int, healthy: Sequence[bool]) -> torch.Tensor:
        """[num_experts] service index computing each expert of `layer` now (NO_OWNER: none healthy);
        with `split_tokens`, [rows, num_experts]: token row t goes to row t % rows.

        Replicas are tried in an order rotated by layer, so identical replicas share the layers.
        """
        if self.split_tokens:
            return self._dealt_owners(layer, healthy)
        shift = self.layers.index(layer)
        table = torch.full((self.num_experts,), NO_OWNER, dtype=torch.int64)
        for expert in range(self.num_experts):
            replicas = self.replicas[ExpertKey(layer, expert)]
            start = shift % len(replicas)
            rotated = replicas[start:] + replicas[:start]
            table[expert] = next((i for i in rotated if healthy[i]), NO_OWNER)
        return table

    def _dealt_owners(self, layer: int, healthy: Sequence[bool]) -> torch.Tensor:
        """[rows, num_experts]: each expert's healthy replicas in turn down the rows, so that a hot
        expert's tokens are split evenly between them (rows: the replica counts' least common
        multiple, at most MAX_DEAL_ROWS; beyond it the split is only nearly even)."""
        alive = [[i for i in self.replicas[ExpertKey(layer, e)] if healthy[i]] for e in range(self.num_experts)]
        rows = math.lcm(*(len(a) for a in alive if a)) if any(alive) else 1
        rows = rows if rows <= MAX_DEAL_ROWS else MAX_DEAL_ROWS
        table = torch.full((rows, self.num_experts), NO_OWNER, dtype=torch.int64)
        for expert, services in enumerate(alive):
            if services:
                table[:, expert] = torch.tensor([services[r % len(services)] for r in range(rows)])
        return table

    def whole_expert_owners(self, layer: int, healthy: Sequence[bool]) -> torch.Tensor | None:
        """With `split_tokens`: [num_experts] one healthy replica per expert, heaviest experts first
        each to the replica with the least planned load so far; None without."""
        if not self.split_tokens:
            return None
        load = self.load[layer].tolist() if self.load is not None else [0.0] * self.num_experts
        taken = [0.0] * len(self.shards)
        table = torch.full((self.num_experts,), NO_OWNER, dtype=torch.int64)
        for expert in sorted(range(self.num_experts), key=lambda e: (-load[e], e)):
            alive = [i for i in self.replicas[ExpertKey(layer, expert)] if healthy[i]]
            if alive:
                table[expert] = owner = min(alive, key=lambda i: (taken[i], i))
                taken[owner] += load[expert]
        return table

    def services_of(self, keys: Sequence[ExpertKey]) -> list[int]:
        return sorted({i for k in keys for i in self.replicas.get(k, ())})


def format_keys(keys: Sequence[ExpertKey], shown: int = 4) -> str:
    """'L0.E4, L0.E5 (+3 more)': a few experts, for one-line errors."""
    text = ", ".join(k.label() for k in keys[:shown])
    return text + (f" (+{len(keys) - shown} more)" if len(keys) > shown else "")


def reshare(shards: Sequence[ServiceShard], movable: Sequence[bool], layers: Sequence[int],
            num_experts: int) -> list[list[ExpertKey]]:
    """A new set of services' pairs, moving as few as it takes: per service (by index into
    `shards`: the staying ones with what they host now, the newcomers with what they reported,
    often nothing) the (layer, expert) pairs it should host.

    Per layer: the experts nobody hosts any more (a leaving service's) go each to the movable
    service hosting fewest; then, while two movable services differ by more than one expert, the
    one hosting most gives its highest-numbered expert the other lacks. Services not `movable`
    (unhealthy now: nothing can be loaded into them) keep exactly their pairs. The same choices
    in every layer keep a rectangular placement rectangular.
    """
    hosts = [[set(s.experts_in(layer)) for layer in layers] for s in shards]
    mine = [i for i, ok in enumerate(movable) if ok]
    if not mine:
        raise ExpertsUnavailable("no healthy expert service to place the experts on")
    for j, _ in enumerate(layers):
        have = [hosts[i][j] for i in range(len(shards))]
        covered = set().union(*have)
        for expert in (e for e in range(num_experts) if e not in covered):
            have[min(mine, key=lambda i: (len(have[i]), i))].add(expert)
        while True:
            big = max(mine, key=lambda i: (len(have[i]), -i))
            small = min(mine, key=lambda i: (len(have[i]), i))
            movable_out = sorted(have[big] - have[small])
            if len(have[big]) - len(have[small]) <= 1 or not movable_out:
                break
            have[big].remove(movable_out[-1])
            have[small].add(movable_out[-1])
    return [[ExpertKey(layer, e) for j, layer in enumerate(layers) for e in sorted(hosts[i][j])]
            for i in range(len(shards))]
