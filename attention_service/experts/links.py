"""How one hop's tensors travel to an expert service: a `Link` per connection, whatever the transport.

Every link takes several hops in flight (one per micro-batch), answered in order, and reports per
hop the expert's compute time and the transport's overhead (the rest of the round trip). Two
transports implement it:

- `grpc_link.GrpcLink`: tensors as bytes inside the messages of one long-lived Forward stream;
  works across hosts. Each hop costs a protobuf encode and decode and two hand-offs between threads.
- `shm_link.ShmLink`: the co-located fast path (proto/doorbell.py): the tensors are written
  straight into a preallocated shared-memory slot and a 32-byte header goes over a Unix socket;
  the service writes its output into the same slot. No per-hop allocation beyond the header's few
  objects.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from opentelemetry import trace

Ticket = Any  # what a link's submit returned, for its wait: each link has its own


class HopFailed(Exception):
    """One request to one service got no answer (the service is then marked unhealthy)."""


@dataclass(slots=True)
class Reply:
    """One answered hop. `output` is valid until the link's next hop is submitted."""

    output: torch.Tensor | None   # [rows, D]; None when `error`
    error: str                    # non-empty: the service rejected the request (it stays usable)
    compute_s: float              # inside the expert kernels, as the service reports it
    overhead_s: float             # the rest of the hop: what the transport cost (never more than hop_s)
    hop_s: float = 0.0            # sent -> answer in hand, less any time it waited for a client busy elsewhere


class Link(Protocol):
    name: str  # the transport, as health and stats report it

    def submit(self, layer: int, hidden: torch.Tensor, rows: torch.Tensor | None, expert_ids: torch.Tensor,
               expert_weights: torch.Tensor) -> tuple[Ticket, int]:
        """Send hidden[rows] (every row when None) with their routing; (the hop's ticket, tensor bytes sent)."""
        ...

    def wait(self, ticket: Ticket, deadline_s: float, timeout_s: float) -> Reply:
        """The hop's reply by deadline_s (perf_counter seconds), else HopFailed; timeout_s: for the message only."""
        ...

    def poll(self, ticket: Ticket, until_s: float) -> Reply | None:
        """The hop's reply if it arrives by until_s (perf_counter seconds; in the past: only if
        already there), else None: late is not failed. HopFailed only when the link died."""
        ...

    def close(self) -> None:
        ...


_spans_exported = [float("-inf"), False]  # checked at most once a second: the check costs microseconds


def spans_exported() -> bool:
    """Whether this process's spans go anywhere. If not, hops carry no trace context: the expert
    service's span per hop costs more than the rest of a shared-memory hop (~40-100 us), for a
    trace that nobody collects."""
    now_s = time.monotonic()
    if now_s - _spans_exported[0] > 1.0:
        processor = getattr(trace.get_tracer_provider(), "_active_span_processor", None)  # the SDK's
        _spans_exported[:] = now_s, bool(getattr(processor, "_span_processors", ()))  # no SDK: no-op spans
    return _spans_exported[1]


def traceparent() -> bytes:
    """The current span as a W3C traceparent; b"" outside any trace or when spans go nowhere."""
    if not spans_exported():
        return b""
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return b""
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}".encode()
