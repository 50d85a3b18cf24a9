"""Splitting one layer's routed tokens by expert service, and summing the parts back: tensors only.

The unit of work is a routing table `work_ids` [T, K]: slot (t, k) asks for expert
`work_ids[t, k]`, and -1 means "not wanted here" (already computed, or computed elsewhere).
Every slot goes to exactly one service, so the parts add up to the whole sum even when
replicas overlap; a service's shard skips the -1 slots and any id it does not host.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from splitmoe.attention_service.experts.placement import NO_OWNER

_NOT_WANTED = -1
_NOT_WANTED_SLOT = NO_OWNER - 1  # owner of the slots nobody should compute


@dataclass(frozen=True, slots=True)
class ServicePart:
    service: int
    rows: torch.Tensor | None  # [n] token rows the service needs; None: every row
    expert_ids: torch.Tensor   # [n, K] int32, -1 in the slots other services compute


@dataclass(frozen=True, slots=True)
class OwnerTable:
    """One layer's owners under the current health, ready for indexing by routing tables."""

    slots: torch.Tensor  # [E + 1]: service per expert, then _NOT_WANTED_SLOT (what id -1 indexes);
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
    return torch.cat([owners, owners.new_full((*owners.shape[:-1], 1), _NOT_WANTED_SLOT)], dim=-1)


def split_by_service(work_ids: torch.Tensor, table: OwnerTable) -> tuple[list[ServicePart], torch.Tensor]:
    """(one part per owning service, the wanted expert ids that no service owns now)."""
    if table.single is not None:  # the common decode case: send the routing as is
        return [ServicePart(table.single, None, work_ids.to(torch.int32))], work_ids.new_empty(0)
    slot_owner = table.owner_of_slots(work_ids)
    if not table.complete:
        orphans = slot_owner == NO_OWNER
        if orphans.any():
            return [], torch.unique(work_ids[orphans])
    # Owners are >= _NOT_WANTED_SLOT (-2): shift to count slots per service in one pass.
    shift = -_NOT_WANTED_SLOT
    slots_per_owner = torch.bincount(slot_owner.reshape(-1) + shift, minlength=table.num_services + shift)
    services = slots_per_owner[shift:].nonzero().squeeze(1).tolist()  # a few services, not tokens
    return [_part(s, slot_owner, work_ids) for s in services], work_ids.new_empty(0)


def _part(service: int, slot_owner: torch.Tensor, work_ids: torch.Tensor) -> ServicePart:
    mine = slot_owner == service
    ids = torch.where(mine, work_ids, _NOT_WANTED).to(torch.int32)
    rows = mine.any(dim=1).nonzero().squeeze(1)
    if rows.numel() == work_ids.shape[0]:
        return ServicePart(service, None, ids)
    return ServicePart(service, rows, ids[rows])


def unfinished_work(shape: torch.Size, parts: list[ServicePart]) -> torch.Tensor:
    """The routing table of just these (failed) parts' slots, to hand to other replicas."""
    work = torch.full(shape, _NOT_WANTED, dtype=torch.int64)
    for part in parts:
        ids = part.expert_ids.long()
        if part.rows is None:
            work = torch.maximum(work, ids)
        else:
            work[part.rows] = torch.maximum(work[part.rows], ids)
    return work


def add_part(out: torch.Tensor, rows: torch.Tensor | None, part_out: torch.Tensor) -> None:
    """out[rows] += part_out, accumulating in out's dtype (float32)."""
    if rows is None:
        out.add_(part_out)
    else:
        out.index_add_(0, rows, part_out.to(out.dtype))
