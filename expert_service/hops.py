"""One hop, whichever front-end received it: the Forward stream (forward_stream.py) or the doorbell.

The front-ends only move bytes: each hands `HopHandler.answer` the hop's layer, the caller's trace
context and a `Hop` that reads its inputs (and the LoRA adapters its rows use) and writes its output
in the transport's own format. The handler does the rest the same way for both: a span under the
caller's trace, the adapters (expert_service/adapters.py), the shard's compute, any error turned
into the text of an in-band error reply (the stream or connection must
survive for the next layer), and which hops are being computed, for the shutdown drain: per lane
(a stream or a connection, answering its hops one at a time) a flag, which costs a hop less than
a shared count under a lock.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Iterator, Protocol

import torch
from opentelemetry import context as otel_context
from opentelemetry import trace

from splitmoe.expert_service.adapters import ExpertAdapters, HopLora
from splitmoe.expert_service.native_hops import NativeConnection
from splitmoe.expert_service.shard import HostedShard
from splitmoe.runtime.telemetry import tracer

log = logging.getLogger(__name__)
_tracer = tracer(__name__)
_DRAIN_POLL_S = 0.005


class Hop(Protocol):
    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(hidden [T, D], expert ids [T, K], expert weights [T, K]), as the request carries them."""
        ...

    def lora(self) -> HopLora:
        """The adapters some rows use and their rows (after `inputs`); empty: every row uses the base."""
        ...

    def deliver(self, output: torch.Tensor) -> None:
        """Put the shard's output [T, D] where the reply carries it."""
        ...


class Lane:
    """One stream's or connection's hops, answered one at a time."""

    __slots__ = ("computing",)

    def __init__(self) -> None:
        self.computing = False


class HopHandler:
    """Answers the hops of every front-end on one shard, and knows when none is being computed."""

    def __init__(self, hosted: HostedShard):
        self.hosted = hosted
        self.adapters = ExpertAdapters(hosted.g)
        self._lock = threading.Lock()
        self._lanes: set[Lane | NativeConnection] = set()  # a C++ loop is a lane of its own hops

    @contextlib.contextmanager
    def lane(self) -> Iterator[Lane]:
        """A lane for the caller's hops, watched by the drain while the caller holds it."""
        lane = Lane()
        with self._watching(lane):
            yield lane

    def native_loop(self, loop: NativeConnection) -> contextlib.AbstractContextManager:
        """While a C++ loop serves a connection: the hops it computes itself count too."""
        return self._watching(loop)

    def answer(self, lane: Lane, layer: int, parent: otel_context.Context | None, hop: Hop) -> tuple[float, str]:
        """(seconds computing, '') once the output is delivered, or (0.0, the error's text)."""
        lane.computing = True
        try:
            if parent is None or not trace.get_current_span(parent).get_span_context().is_valid:
                # No caller trace to join: a root span per layer call would be noise, and costs ~50 us.
                return self._answer(layer, hop)
            with _tracer.start_as_current_span("expert.forward", context=parent, attributes={"splitmoe.layer": layer}):
                return self._answer(layer, hop)
        finally:
            lane.computing = False

    def num_lanes(self) -> int:
        """Streams and connections open now: each an attention service that still sends us hops
        (a connection whose C++ loop serves it is one, not two)."""
        with self._lock:
            return sum(1 for lane in self._lanes if isinstance(lane, Lane))

    def num_computing(self) -> int:
        """Hops in the kernels now, over every lane (a C++ loop's counted as busy while it serves)."""
        with self._lock:
            return sum(1 for lane in self._lanes if lane.computing)

    def wait_idle(self, timeout_s: float) -> bool:
        """Until no hop is being computed (streams and connections may stay open), or the timeout."""
        deadline_s = time.monotonic() + timeout_s
        while True:
            with self._lock:
                busy = any(lane.computing for lane in self._lanes)
            if not busy:
                return True
            if time.monotonic() >= deadline_s:
                return False
            time.sleep(_DRAIN_POLL_S)  # shutdown only: a flag per hop is cheaper than a condition

    @contextlib.contextmanager
    def _watching(self, lane: Lane | NativeConnection) -> Iterator[None]:
        with self._lock:
            self._lanes.add(lane)
        try:
            yield
        finally:
            with self._lock:
                self._lanes.discard(lane)

    def _answer(self, layer: int, hop: Hop) -> tuple[float, str]:
        try:
            hidden, expert_ids, expert_weights = hop.inputs()
            lora = hop.lora()
            layer_lora = self.adapters.for_layer(layer, lora) if lora else None
            out, compute_s = self.hosted.forward(layer, hidden, expert_ids, expert_weights, layer_lora)
            hop.deliver(out)
            return compute_s, ""
        except Exception as e:  # noqa: BLE001 - whatever one request does wrong, the next layer's must work
            trace.get_current_span().record_exception(e)
            log.warning("forward layer %d: %s", layer, e)
            return 0.0, f"{type(e).__name__}: {e}"
