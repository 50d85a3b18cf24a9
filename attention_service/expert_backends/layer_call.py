"""Layer calls on the expert services: each one's parts in flight, their retries, and their sum.

A layer call plans its parts by service (ExpertServices.plan), then talks to each service's client
itself: one submit and one wait per part, no level in between. The data path is one thread at a
time (every connection's hops are answered in order): a call is sent and collected under
`InFlightCalls`' lock. Up to `max_calls` calls may be in flight (the transformer's two
micro-batches: attention of one runs while the experts of the other compute); a further one
first collects the oldest. The tensors are host tensors: from a GPU the backend copies
them to the host first (gpu/hop_copies.py), and the send-ahead thread of its micro-batches
(gpu/send_ahead.py) sends under the same lock.
"""
from __future__ import annotations

import collections
import contextlib
import threading
from typing import Callable, Iterator

import torch

from splitmoe.attention_service.expert_backends.direct_hop import DirectHop
from splitmoe.attention_service.expert_backends.placement import ExpertsUnavailable
from splitmoe.attention_service.expert_backends.service_client import ExpertRequestError, Hop, HopFailed
from splitmoe.attention_service.expert_backends.services import NOT_WANTED, ExpertServices, ServicePart
from splitmoe.attention_service.expert_backends.shm_link import HopLora
from splitmoe.kernels import native


def _new_output(shape: torch.Size) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float32)


class InFlightCalls:
    """The layer calls sent to the expert services and not yet collected, oldest first."""

    def __init__(self, services: ExpertServices, max_calls: int):
        self._services = services
        self._max_calls = max_calls
        self._lock = threading.Lock()
        self._calls: collections.deque[LayerCall] = collections.deque()

    def submit(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
               new_output: Callable[[torch.Size], torch.Tensor] | None = None,
               lora: HopLora | None = None) -> "LayerCall":
        """`new_output(shape)`: where the call's float32 sum goes (a page-locked buffer when the
        answer continues to a GPU); default: a new tensor. `lora`: the adapters some rows use."""
        with self._lock:
            while len(self._calls) >= self._max_calls:
                self._calls.popleft().collect_locked()  # a call past the limit: the oldest must finish first
            call = LayerCall(self._services, self.collect, layer, hidden, expert_ids, expert_weights,
                             new_output or _new_output, lora)
            self._calls.append(call)
            call.send_locked(expert_ids)
        return call

    def direct(self, layer: int, num_rows: int, top_k: int, hidden_size: int, counts: torch.Tensor) -> DirectHop | None:
        """The layer's hop target for native code (direct_hop.py), with the data path's lock and the
        service's link held until its `finish`; None (nothing held) where the usual path must send it."""
        self._lock.acquire()
        try:
            service = None if self._calls else self._services.single_owner(layer)
            client = None if service is None else self._services.clients[service]
            link = None if client is None else client.direct_link()
            slot = None if link is None else link.direct_slot(num_rows, top_k, hidden_size, torch.bfloat16)
        except BaseException:
            self._lock.release()
            raise
        if slot is None or not client.hold_link(link):  # held: the link stays open until the hop is done
            self._lock.release()
            return None
        index, region, layout = slot
        return DirectHop(self._services, service, client, link, self._lock, layer, index, region, layout, counts,
                         num_rows, num_rows * hidden_size * 2)

    @contextlib.contextmanager
    def drained(self) -> Iterator[None]:
        """Hold the data path with no call in flight (each collected now; its waiter gets the
        result): between two layer calls, where the placement may change."""
        with self._lock:
            while self._calls:
                self._calls.popleft().collect_locked()
            yield

    def collect(self, call: "LayerCall") -> None:
        with self._lock:
            if call in self._calls:  # else collected already, to make room for a later call
                self._calls.remove(call)
                call.collect_locked()


class LayerCall:
    """One submitted layer call: its parts in flight, then its result (or error).

    `collect` (InFlightCalls') runs `collect_locked` under the data path's lock, unless done already.
    Its hops go straight to each part's `ExpertServiceClient` (the services only plan and hedge).
    """

    def __init__(self, services: ExpertServices, collect: Callable[["LayerCall"], None], layer: int,
                 hidden: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor,
                 new_output: Callable[[torch.Size], torch.Tensor] = None, lora: HopLora | None = None):
        self._services, self._collect = services, collect
        self._new_output = new_output or _new_output
        self._layer = layer
        self._lora = lora
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
        self._done = False  # collected: the result (or error) is in; set last

    def wait(self) -> torch.Tensor:
        if not self._done:  # else, or while another thread collects it, under the data path's lock
            self._collect(self)
        if self._error is not None:
            raise self._error
        return self._out

    def send_locked(self, work: torch.Tensor) -> None:
        """Plan `work` (a routing table, -1: not wanted) by service and submit every part; an
        error is kept for `collect_locked`, which first waits for whatever was sent."""
        self._rounds += 1
        self._parts, self._hops = [], []
        try:
            clients = self._services.clients
            for part in self._services.plan(self._layer, work):
                lora = self._lora and lora_of_part(self._lora, part.rows, self._hidden.shape[0])
                self._hops.append(clients[part.service].submit(self._layer, self._hidden, part.rows, part.expert_ids,
                                                               self._weights, lora))
                self._parts.append(part)
        except Exception as e:  # noqa: BLE001 - handed to the waiter
            self._error = e

    def collect_locked(self) -> None:
        """Wait for every part (retrying failed ones on replicas) and sum them; keeps the error.

        Every hop is waited for before an error is kept: a service still working on an abandoned
        request would otherwise share its shared-memory slot with the next one.
        """
        native.park()  # the expert services compute now: this process's idle workers must not spin
        try:
            self._out = self._sum_parts()
        except Exception as e:  # noqa: BLE001 - handed to the waiter
            self._error = e
        finally:
            self._done = True

    def _sum_parts(self) -> torch.Tensor:
        out = None  # float32 [T, D], made by the first part that arrives
        services, clients = self._services, self._services.clients
        while True:
            failed, rejected = [], []
            for part, hop in zip(self._parts, self._hops):
                # Only a hop whose experts another service could compute now is given up as late.
                hedge = services.can_hedge(self._layer, part.service)
                try:
                    out = self._accumulate(out, part.rows, clients[part.service].wait(hop, hedge))
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
                return out if out is not None else self._new_output(self._hidden.shape).zero_()  # None: nothing routed
            if self._rounds > services.num_services:  # each failed round marks a service unhealthy
                raise ExpertsUnavailable(f"layer {self._layer}: expert services kept failing: "
                                         f"{services.describe_failures()}")
            self.send_locked(unfinished_work(self._shape, failed))

    def _accumulate(self, out: torch.Tensor | None, rows: torch.Tensor | None, part_out: torch.Tensor) -> torch.Tensor:
        """out[rows] += part_out; the first part of every row is copied out of the hop's buffer."""
        if out is None:
            out = self._new_output(self._hidden.shape)
            if rows is None:
                return out.copy_(part_out)
            out.zero_()
        add_part(out, rows, part_out)
        return out


def lora_of_part(lora: HopLora, part_rows: torch.Tensor | None, num_rows: int) -> HopLora | None:
    """The adapters of a part's rows, those rows numbered as the part sends them (0.. in `part_rows`' order)."""
    if part_rows is None:
        return lora
    position = torch.full((num_rows,), -1, dtype=torch.int64)
    position[part_rows] = torch.arange(part_rows.numel())
    found = []
    for ref, rows in lora:
        mine = position[rows]
        mine = mine[mine >= 0]
        if mine.numel():
            found.append((ref, mine))
    return found or None


def unfinished_work(shape: torch.Size, parts: list[ServicePart]) -> torch.Tensor:
    """The routing table of just these (failed) parts' slots, to hand to other replicas."""
    work = torch.full(shape, NOT_WANTED, dtype=torch.int64)
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
