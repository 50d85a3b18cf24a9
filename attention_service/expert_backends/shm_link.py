"""How one hop's tensors travel to an expert service: a `Link` per connection, whatever the transport;
here the link protocol, its `Reply`, and the shared-memory link.

Every link takes several hops in flight (one per micro-batch), answered in order, and reports per
hop the expert's compute time and the transport's overhead (the rest of the round trip). Two
transports implement it:

- `ShmLink` (below): the co-located fast path (proto/doorbell.py): the tensors are written
  straight into a preallocated shared-memory slot and a 32-byte header goes over a Unix socket;
  the service writes its output into the same slot. No per-hop allocation beyond the header's few
  objects.
- `grpc_link.GrpcLink`: tensors as bytes inside the messages of one long-lived Forward stream;
  works across hosts. Each hop costs a protobuf encode and decode and two hand-offs between threads.
"""
from __future__ import annotations

import collections
import math
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
from opentelemetry import trace

from splitmoe.modelfile.lora_adapter import AdapterRef
from splitmoe.proto import doorbell
from splitmoe.proto.shm import ShmRegion

Ticket = Any  # what a link's submit returned, for its wait: each link has its own
HopLora = list[tuple[AdapterRef, torch.Tensor]]
"""The LoRA adapters some rows of one hop use, and those rows (int64, numbered as the hop's own rows)."""


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
               expert_weights: torch.Tensor, lora: HopLora | None = None) -> tuple[Ticket, int]:
        """Send hidden[rows] (every row when None) with their routing, and the adapters some of
        those rows use (`lora`); (the hop's ticket, tensor bytes sent)."""
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


# ---- the shared-memory link -----------------------------------------------------------------------


def _lora_into(region: ShmRegion, lora: HopLora, num_tokens: int, top_k: int, hidden_size: int,
               dtype: torch.dtype) -> bytes:
    """Each row's adapter written into the slot; the adapters as the request's tail carries them."""
    index = doorbell.lora_rows_view(region, num_tokens, top_k, hidden_size, dtype)
    index.fill_(-1)
    for i, (_, rows) in enumerate(lora):
        index[rows] = i
    return doorbell.adapters_message([(ref.name, ref.path, ref.identity) for ref, _ in lora])


class _Slot:
    """One hop's shared-memory region, created here, grown to the largest hop."""

    def __init__(self, initial_bytes: int):
        self.mapped = doorbell.Slot(ShmRegion.create(max(initial_bytes, 4096)))
        self.unannounced = True   # the service has not been told this region's name yet

    def views(self, num_tokens: int, top_k: int, hidden_size: int, dtype: torch.dtype,
              lora: bool = False) -> doorbell.SlotViews:
        """`lora`: room for each row's adapter too (doorbell.lora_rows_view)."""
        if lora and doorbell.lora_slot_bytes(num_tokens, top_k, hidden_size, dtype) > self.mapped.region.num_bytes:
            self._grow(doorbell.lora_slot_bytes(num_tokens, top_k, hidden_size, dtype))
        try:
            return self.mapped.views(num_tokens, top_k, hidden_size, dtype)
        except doorbell.SlotTooSmall:
            self._grow(doorbell.slot_layout(num_tokens, top_k, hidden_size, dtype).num_bytes)
            return self.mapped.views(num_tokens, top_k, hidden_size, dtype)

    def _grow(self, num_bytes: int) -> None:
        grown = ShmRegion.create(max(num_bytes, 2 * self.mapped.region.num_bytes))
        self.mapped.close()
        self.mapped, self.unannounced = doorbell.Slot(grown), True

    def close(self) -> None:
        self.mapped.close()


@dataclass(slots=True)
class ShmTicket:
    seq: int
    slot: int
    output: torch.Tensor
    start_ns: int        # CLOCK_MONOTONIC, the same clock as the service's (one host): submit began,
    sent_ns: int         # the header went out,
    submitted_ns: int = 0  # and submit returned
    reply: Reply | None = None


class ShmLink:
    """Shared-memory slots plus a Unix-socket doorbell to one co-located expert service."""

    name = "shm"

    def __init__(self, address: str, token: str, initial_bytes: int, connect_timeout_s: float, timeout_s: float,
                 on_end: Callable[["ShmLink", str], None]):
        self._on_end = on_end
        self._closed = False
        self._sock = doorbell.new_socket()
        self._slots: list[_Slot] = []
        try:
            self._sock.settimeout(connect_timeout_s)
            self._sock.connect(doorbell.socket_address(address))
            self._handshake(token)
            # From here on a blocking socket whose receive times out in the kernel (SO_RCVTIMEO):
            # one system call per receive, where a Python-side timeout costs a poll() too.
            self._sock.settimeout(None)
            limit = struct.pack("ll", int(timeout_s), int(timeout_s % 1 * 1e6))
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
            self._slots = [_Slot(initial_bytes) for _ in range(doorbell.NUM_SLOTS)]
        except BaseException:
            self.close()
            raise
        self._free = list(range(doorbell.NUM_SLOTS - 1, -1, -1))  # slot 0 first
        self._pending: collections.deque[ShmTicket] = collections.deque()
        self._seq = 0
        self._previous_end_ns = 0
        self._send = bytearray(doorbell.MAX_MESSAGE_BYTES)
        self._send_view = memoryview(self._send)
        self._received = bytearray(doorbell.MAX_MESSAGE_BYTES)
        self._readable = select.poll()
        self._readable.register(self._sock.fileno(), select.POLLIN)
        threading.Thread(target=self._watch, name="expert-doorbell-watch", daemon=True).start()

    def submit(self, layer: int, hidden: torch.Tensor, rows: torch.Tensor | None, expert_ids: torch.Tensor,
               expert_weights: torch.Tensor, lora: HopLora | None = None) -> tuple[ShmTicket, int]:
        """(the hop's ticket, tensor bytes written); the tensors go straight into a free slot, and
        with `lora` each row's adapter too (a KIND_FORWARD_LORA request: see proto/doorbell.py)."""
        start_ns = time.monotonic_ns()
        if not self._free:
            raise RuntimeError(f"more than {doorbell.NUM_SLOTS} hops in flight on one connection")
        index = self._free.pop()
        try:
            slot = self._slots[index]
            num_tokens, top_k = expert_ids.shape
            hidden_size = hidden.shape[1]
            views = slot.views(num_tokens, top_k, hidden_size, hidden.dtype, lora=bool(lora))
            if rows is None:
                views.hidden.copy_(hidden)
                views.expert_weights.copy_(expert_weights)
            else:
                torch.index_select(hidden, 0, rows, out=views.hidden)
                torch.index_select(expert_weights, 0, rows, out=views.expert_weights)
            views.expert_ids.copy_(expert_ids)
            region = slot.mapped.region
            adapters = _lora_into(region, lora, num_tokens, top_k, hidden_size, hidden.dtype) if lora else b""
            announced = doorbell.announcement(region.name, region.num_bytes) if slot.unannounced else b""
            trace_context = traceparent()
            length = doorbell.REQUEST.size
            if announced or trace_context or adapters:
                tail = announced + trace_context + adapters
                if length + len(tail) > len(self._send):
                    raise ValueError(f"a hop's LoRA adapters take {len(adapters)} bytes: too many, or their "
                                     f"paths too long, for the {doorbell.MAX_MESSAGE_BYTES}-byte doorbell message")
                self._send[length:length + len(tail)] = tail
                length += len(tail)
            self._seq += 1
            kind = doorbell.KIND_FORWARD_LORA if lora else doorbell.KIND_FORWARD
            doorbell.REQUEST.pack_into(self._send, 0, kind, views.wire_dtype, index, layer,
                                       num_tokens, top_k, hidden_size, self._seq, len(announced), len(trace_context))
            sent_ns = time.monotonic_ns()
            self._sock.send(self._send_view[:length])
        except BaseException:
            self._free.append(index)
            raise
        slot.unannounced = False
        ticket = ShmTicket(self._seq, index, views.output, start_ns, sent_ns)
        self._pending.append(ticket)
        ticket.submitted_ns = time.monotonic_ns()
        return ticket, views.input_bytes

    def wait(self, ticket: ShmTicket, deadline_s: float, timeout_s: float) -> Reply:
        """deadline_s: perf_counter seconds. The reply's output is the slot's output area."""
        while ticket.reply is None:  # HopFailed: the client closes this link, slots and all
            self._receive(deadline_s, timeout_s)
        self._free.append(ticket.slot)
        return ticket.reply

    def poll(self, ticket: ShmTicket, until_s: float) -> Reply | None:
        """A poll() first (a system call more than `wait`): a receive would block for the kernel's
        whole expert_timeout_s."""
        while ticket.reply is None:
            wait_ms = max(until_s - time.perf_counter(), 0.0) * 1e3
            if not self._readable.poll(math.ceil(wait_ms)):
                return None
            self._receive(float("-inf"), 0.0)  # readable: an answer, or the end (HopFailed)
        self._free.append(ticket.slot)
        return ticket.reply

    def direct_slot(self, num_tokens: int, top_k: int, hidden_size: int,
                    dtype: torch.dtype) -> tuple[int, ShmRegion, doorbell.SlotLayout] | None:
        """(slot index, its region, the hop's layout) that native code may use for one hop now,
        written and answered without this object (expert_backends/direct_hop.py); None unless
        nothing is in flight, the slot is known to the service and large enough, and spans go
        nowhere (a traced hop carries its context)."""
        if self._pending or not self._free or spans_exported():
            return None
        index = self._free[-1]
        slot = self._slots[index]
        layout = doorbell.slot_layout(num_tokens, top_k, hidden_size, dtype)
        if slot.unannounced or layout.num_bytes > slot.mapped.region.num_bytes:
            return None
        return index, slot.mapped.region, layout

    @property
    def next_seq(self) -> int:
        return self._seq + 1

    @property
    def fileno(self) -> int:
        return self._sock.fileno()

    def answered_directly(self, seq: int, start_ns: int, sent_ns: int, submitted_ns: int, wait_ns: int,
                          observed_ns: int, end_ns: int, compute_ns: int) -> Reply:
        """Book a hop native code sent as request `seq` and read the answer of: the sequence moves
        on, and the hop is timed as `_receive` times one (its Reply has no output)."""
        self._seq = seq
        return self._timed(Reply(None, "", 0.0, 0.0), start_ns, sent_ns, submitted_ns, wait_ns, observed_ns, end_ns,
                           compute_ns)

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes a receive in another thread, and the watcher
        except OSError:
            pass
        self._sock.close()
        for slot in self._slots:
            slot.close()

    # ---- internals ------------------------------------------------------------------------------

    def _handshake(self, token: str) -> None:
        """The version, then the answer to the service's challenge: proof of the cluster secret."""
        self._sock.send(doorbell.HELLO.pack(doorbell.KIND_HELLO, doorbell.VERSION, doorbell.MAGIC))
        challenge = self._handshake_reply(doorbell.KIND_HELLO)
        if len(challenge) != doorbell.NONCE_BYTES:
            raise HopFailed("the doorbell sent no challenge")
        self._sock.send(doorbell.PROOF.pack(doorbell.KIND_PROOF, doorbell.proof(token, challenge)))
        self._handshake_reply(doorbell.KIND_PROOF)

    def _handshake_reply(self, kind: int) -> bytes:
        """What follows the header of the service's answer to a `kind` message; HopFailed if refused."""
        answer = self._sock.recv(doorbell.MAX_MESSAGE_BYTES)
        if len(answer) < doorbell.REPLY.size:
            raise HopFailed("the doorbell closed during the handshake")
        answered, status, *_ = doorbell.REPLY.unpack_from(answer)
        if answered != kind or status != doorbell.STATUS_OK:
            raise HopFailed(f"doorbell handshake refused: {answer[doorbell.REPLY.size:].decode(errors='replace')}")
        return answer[doorbell.REPLY.size:]

    def _receive(self, deadline_s: float, timeout_s: float) -> None:
        """Read one reply and attach it to its ticket (replies come in request order).

        The kernel's receive timeout is expert_timeout_s from the receive's start: a hop waited
        for late (the second micro-batch's) may get up to that delay more than its deadline.
        """
        # Past the deadline (another service's hop used it up) an answer already here still counts.
        flags = socket.MSG_DONTWAIT if time.perf_counter() >= deadline_s else 0
        wait_ns = time.monotonic_ns()
        try:
            length = self._sock.recv_into(self._received, 0, flags)
        except (BlockingIOError, socket.timeout):
            raise HopFailed(f"no answer within expert_timeout_s={timeout_s:g}") from None
        except OSError as e:
            raise HopFailed(f"doorbell: {e.strerror or e}") from None
        observed_ns = time.monotonic_ns()
        if length < doorbell.REPLY.size:
            raise HopFailed("the service closed the connection" if length == 0 else "a truncated doorbell reply")
        kind, status, seq, start_ns, end_ns, compute_ns = doorbell.REPLY.unpack_from(self._received)
        if not self._pending or seq != self._pending[0].seq or kind != doorbell.KIND_FORWARD:
            raise HopFailed(f"the service answered request {seq}, not the oldest one sent")
        ticket = self._pending.popleft()
        error = "" if status == doorbell.STATUS_OK else \
            bytes(self._received[doorbell.REPLY.size:length]).decode(errors="replace") or "unknown error"
        ticket.reply = self._timed(Reply(None if error else ticket.output, error, 0.0, 0.0), ticket.start_ns,
                                   ticket.sent_ns, ticket.submitted_ns, wait_ns, observed_ns, end_ns, compute_ns)

    def _timed(self, reply: Reply, start_ns: int, sent_ns: int, submitted_ns: int, wait_ns: int, observed_ns: int,
               end_ns: int, compute_ns: int) -> Reply:
        """`reply` with the hop's times, from the client's clock (submit began, header sent, submit
        returned, receive began, answer read) and the service's (answered, computed for).

        One measurement for the hop and its overhead, so that they agree under any load. The hop
        ends when its answer was read, less the time the answer waited for a client busy
        elsewhere (attention of the other micro-batch): a receive already waiting counts in
        full, the scheduler's delay in waking it included. The overhead is that hop less the
        expert compute and the time the request queued behind the previous hop (the other
        micro-batch's)."""
        unread_ns = max(wait_ns - max(end_ns, submitted_ns), 0)
        arrived_ns = max(observed_ns - unread_ns, start_ns)
        queued_ns = max(self._previous_end_ns - sent_ns, 0)
        overhead_ns = max(arrived_ns - start_ns - compute_ns - queued_ns, 0)
        self._previous_end_ns = end_ns
        reply.compute_s, reply.overhead_s, reply.hop_s = compute_ns * 1e-9, overhead_ns * 1e-9, (arrived_ns - start_ns) * 1e-9
        return reply

    def _watch(self) -> None:
        """Report the service's end at once, even while no hop is in flight (no data is read here)."""
        poller = select.poll()
        try:
            poller.register(self._sock.fileno(), select.POLLRDHUP)
            poller.poll()  # only a hang-up or an error wakes it: replies are POLLIN
        except (OSError, ValueError):
            return  # already closed
        if not self._closed:
            self._on_end(self, "the service closed the shared-memory doorbell")
