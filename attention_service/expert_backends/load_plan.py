"""Placements computed from measured load: pure functions of the heat, no I/O.

- `choose_hot`: the hottest (layer, expert) pairs that fit a budget (a count, or bytes), for the
  attention process to compute itself (`--local-experts-by-heat`).
- `plan_by_load`: DeepSeek EPLB's greedy packing, per layer. Each service has the same number of
  slots per layer; the spare slots (beyond one per expert) go to replicas of the experts with the
  most load per replica, then the replicas, heaviest first, each to the least loaded service that
  has a free slot and no copy of that expert yet. A replicated expert's tokens are dealt evenly
  between its replicas (placement.Placement.split_tokens), so each replica carries load / copies.
- `imbalance`: max over mean tokens per service, summed over layers, as the placement would see
  the given load (each layer's hop waits for its busiest service).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from splitmoe.modelfile.expert_tensors import ExpertKey

UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


@dataclass(frozen=True, slots=True)
class HeatBudget:
    """How much of the hottest experts to keep in this process: a count of (layer, expert)
    pairs, or their weight bytes (whichever is set; neither: none)."""

    num_experts: int = 0
    num_bytes: int = 0

    @classmethod
    def parse(cls, text: str, flag: str = "--local-experts-by-heat") -> "HeatBudget":
        """'24': 24 experts; '512M', '2G', '1.5GiB', '300000000B': bytes of expert weights.
        `flag`: the option the text came from, for the error."""
        t = text.strip().lower().removesuffix("ib").removesuffix("b")
        if text.strip().isdigit():
            return cls(num_experts=int(text))
        unit = UNITS.get(t[-1:], 1) if t else 1
        number = t[:-1] if t[-1:] in UNITS else t
        try:
            num_bytes = int(float(number) * unit)
        except ValueError:
            raise ValueError(f"{flag} {text!r}: want a count (24) or a size (512M, 2G)") from None
        if num_bytes < 0:
            raise ValueError(f"{flag} {text!r}: must not be negative")
        return cls(num_bytes=num_bytes)

    def __bool__(self) -> bool:
        return self.num_experts > 0 or self.num_bytes > 0


def choose_hot(tokens_per_s: torch.Tensor, layers: Sequence[int], budget: HeatBudget,
               bytes_of: Callable[[int], int]) -> list[ExpertKey]:
    """The hottest pairs of `layers` within `budget`, hottest first; experts never routed to are
    never chosen. bytes_of(layer): the weight bytes of one expert of that layer."""
    if not budget or not layers:
        return []
    rows = tokens_per_s[list(layers)]
    order = torch.argsort(rows.reshape(-1), descending=True, stable=True).tolist()
    chosen, used_bytes = [], 0
    num_experts = rows.shape[1]
    for flat in order:
        i, expert = divmod(flat, num_experts)
        if rows[i, expert] <= 0 or (budget.num_experts and len(chosen) >= budget.num_experts):
            break
        size = bytes_of(layers[i])
        if budget.num_bytes and used_bytes + size > budget.num_bytes:
            continue  # a smaller expert of another layer may still fit
        chosen.append(ExpertKey(layers[i], expert))
        used_bytes += size
    return chosen


def plan_layer(load: Sequence[float], num_services: int, slots_per_service: int) -> list[list[int]]:
    """One layer: the experts each service hosts (EPLB's greedy packing; see the module docstring)."""
    num_experts = len(load)
    if num_services * slots_per_service < num_experts:
        raise ValueError(f"{num_services} services x {slots_per_service} slots cannot host {num_experts} experts")
    copies = [1] * num_experts
    for _ in range(num_services * slots_per_service - num_experts):
        best = max((e for e in range(num_experts) if copies[e] < num_services),
                   key=lambda e: (load[e] / copies[e], -e), default=None)
        if best is None or load[best] <= 0:
            break  # nothing left to gain: the spare slots stay free
        copies[best] += 1
    replicas = sorted(((load[e] / copies[e], e) for e in range(num_experts) for _ in range(copies[e])),
                      key=lambda item: (-item[0], item[1]))
    hosted: list[list[int]] = [[] for _ in range(num_services)]
    service_load = [0.0] * num_services
    for share, expert in replicas:
        free = [s for s in range(num_services) if len(hosted[s]) < slots_per_service and expert not in hosted[s]]
        target = min(free, key=lambda s: (service_load[s], len(hosted[s]), s))
        hosted[target].append(expert)
        service_load[target] += share
    return [sorted(h) for h in hosted]


def plan_by_load(tokens_per_s: torch.Tensor, layers: Sequence[int], num_services: int,
                 spare_slots: int = 1) -> list[list[ExpertKey]]:
    """Per service, the (layer, expert) pairs it should host: every layer of `layers` packed by
    `plan_layer`, each service with ceil(experts / services) + `spare_slots` slots per layer."""
    num_experts = tokens_per_s.shape[1]
    slots = min(math.ceil(num_experts / num_services) + spare_slots, num_experts)
    shards: list[list[ExpertKey]] = [[] for _ in range(num_services)]
    for layer in layers:
        for service, experts in enumerate(plan_layer(tokens_per_s[layer].tolist(), num_services, slots)):
            shards[service].extend(ExpertKey(layer, e) for e in experts)
    return shards


def imbalance(tokens_per_s: torch.Tensor, owners_of: Callable[[int], torch.Tensor], layers: Sequence[int],
              num_services: int) -> float:
    """Sum over layers of the busiest service's load, over the sum of the mean: 1.0 is even.

    owners_of(layer): the placement's owner table ([E], or [R, E] dealt by token row)."""
    total_max = total_mean = 0.0
    for layer in layers:
        owners = owners_of(layer)
        table = owners if owners.dim() == 2 else owners.unsqueeze(0)
        per_service = torch.zeros(num_services, dtype=torch.float64)
        load = tokens_per_s[layer].to(torch.float64) / table.shape[0]
        for row in table:
            per_service.index_add_(0, row.clamp(min=0), load * (row >= 0))
        total_max += float(per_service.max())
        total_mean += float(per_service.sum()) / num_services
    return total_max / total_mean if total_mean > 0 else 1.0
