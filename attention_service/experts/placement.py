"""Which expert service computes which (layer, expert): the placement map and its failover order.

Pure bookkeeping, no I/O: the shards services report, the LoadShard assignments for services
that came up empty, the coverage check, and per-layer owner tables for the current health.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import torch

from splitmoe.modelfile.experts import ExpertKey, format_ranges

NO_OWNER = -1


class ExpertsUnavailable(RuntimeError):
    """Some routed experts have no healthy expert service: at startup, or mid-request."""


@dataclass(frozen=True, slots=True)
class ServiceShard:
    """One expert service and the shard it reports hosting."""

    address: str
    layers: tuple[int, ...] = ()
    experts: tuple[int, ...] = ()
    hostname: str = ""
    num_bytes: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.layers or not self.experts

    def covers(self, other: "ServiceShard") -> bool:
        """Whether this shard hosts every (layer, expert) of `other`."""
        return set(other.layers) <= set(self.layers) and set(other.experts) <= set(self.experts)

    def keys(self) -> Iterator[ExpertKey]:
        return (ExpertKey(layer, expert) for layer in self.layers for expert in self.experts)

    def label(self) -> str:
        if self.is_empty:
            return f"{self.address} [no experts]"
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
    """(layer, expert) -> the services hosting it, for the layers computed remotely."""

    shards: tuple[ServiceShard, ...]
    layers: tuple[int, ...]
    num_experts: int
    replicas: Mapping[ExpertKey, tuple[int, ...]]

    @classmethod
    def build(cls, shards: Sequence[ServiceShard], layers: Sequence[int], num_experts: int) -> "Placement":
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
        return cls(tuple(shards), tuple(layers), num_experts, {k: tuple(v) for k, v in replicas.items()})

    def owners(self, layer: int, healthy: Sequence[bool]) -> torch.Tensor:
        """[num_experts] service index computing each expert of `layer` now (NO_OWNER: none healthy).

        Replicas are tried in an order rotated by layer, so identical replicas share the layers.
        """
        shift = self.layers.index(layer)
        table = torch.full((self.num_experts,), NO_OWNER, dtype=torch.int64)
        for expert in range(self.num_experts):
            replicas = self.replicas[ExpertKey(layer, expert)]
            start = shift % len(replicas)
            rotated = replicas[start:] + replicas[:start]
            table[expert] = next((i for i in rotated if healthy[i]), NO_OWNER)
        return table

    def services_of(self, keys: Sequence[ExpertKey]) -> list[int]:
        return sorted({i for k in keys for i in self.replicas.get(k, ())})


def format_keys(keys: Sequence[ExpertKey], shown: int = 4) -> str:
    """'L0.E4, L0.E5 (+3 more)': a few experts, for one-line errors."""
    text = ", ".join(k.label() for k in keys[:shown])
    return text + (f" (+{len(keys) - shown} more)" if len(keys) > shown else "")
