"""The expert service's end of the co-located fast path (proto/doorbell.py).

A listener on a Unix SOCK_SEQPACKET socket in the abstract namespace (nothing on disk; gone with
the process) and one thread per attention connection. Any local process can connect to an
abstract socket, so a connection first proves it holds the cluster secret (a challenge answered
with an HMAC), and the kernel tells who it is (SO_PEERCRED): it may then name up to `NUM_SLOTS`
shared-memory regions, each of which must be its own (proto/shm.py `ShmRegion.attach`). A
request's tensors are views of its slot (no copy, no allocation beyond a few cached tensor
views), `HostedShard.forward` computes, and the output is copied into the slot's output area
before the reply header goes back.
"""
from __future__ import annotations

import hmac
import logging
import os
import secrets
import socket
import threading
import time
import torch
from opentelemetry import propagate, trace

from splitmoe.expert_service.native_hops import NativeConnection
from splitmoe.expert_service.shard import HostedShard
from splitmoe.kernels import native
from splitmoe.proto import codec, doorbell
from splitmoe.proto.shm import Peer, ShmRegion
from splitmoe.runtime.telemetry import tracer

log = logging.getLogger(__name__)
_tracer = tracer(__name__)
_MAX_CACHED_VIEWS = 64
_HANDSHAKE_TIMEOUT_S = 10.0


class DoorbellServer:
    """Accepts doorbell connections and answers their hops, until closed."""

    def __init__(self, hosted: HostedShard, token: str):
        self._hosted = hosted
        self._token = token  # empty: no cluster secret, every local process may connect
        self.address = f"@splitmoe-experts-{os.getpid()}-{secrets.token_hex(6)}"
        self._listener = doorbell.new_socket()
        self._listener.bind(doorbell.socket_address(self.address))
        self._listener.listen(64)
        self._connections: dict[socket.socket, _Connection] = {}
        self._lock = threading.Lock()
        self._closed = False

    def start(self) -> None:
        threading.Thread(target=self._accept_loop, name="expert-doorbell", daemon=True).start()

    def stop_accepting(self) -> None:
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept (EINVAL)
        except OSError:
            pass
        self._listener.close()

    def wait_idle(self, timeout_s: float) -> bool:
        """Until no hop is being computed (connections may stay open), or the timeout."""
        deadline_s = time.monotonic() + timeout_s
        while True:
            with self._lock:
                busy = any(c.computing for c in self._connections.values())
            if not busy:
                return True
            if time.monotonic() >= deadline_s:
                return False
            time.sleep(0.005)  # shutdown only: a flag per hop is cheaper than a condition

    def close_connections(self) -> None:
        """Hang up on every client: each fails its hops over at once instead of timing out."""
        self.stop_accepting()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            connection = _Connection(conn, self._hosted, self._token)
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._connections[conn] = connection
            threading.Thread(target=self._serve, args=(connection,), name="expert-doorbell-conn", daemon=True).start()

    def _serve(self, connection: "_Connection") -> None:
        try:
            connection.run()
        except OSError as e:  # the client went away mid-reply
            log.debug("doorbell connection ended: %s", e)
        except _ProtocolError as e:
            log.warning("doorbell connection dropped: %s", e)
        finally:
            connection.close()
            with self._lock:
                self._connections.pop(connection.socket, None)


class _ProtocolError(Exception):
    pass


class _Connection:
    def __init__(self, conn: socket.socket, hosted: HostedShard, token: str):
        self.socket = self._conn = conn
        self._hosted = hosted
        self._token = token
        self._peer: Peer = doorbell.peer_of(conn)
        self._computing = False  # for the shutdown drain (the native loop keeps its own flag)
        self._native: NativeConnection | None = None
        self._stopped: BaseException | None = None  # what ended the native loop from a Python answer
        self._regions: list[ShmRegion | None] = [None] * doorbell.NUM_SLOTS
        self._views: dict[tuple, tuple[torch.Tensor, ...]] = {}
        self._received = bytearray(doorbell.MAX_MESSAGE_BYTES)
        self._reply = bytearray(doorbell.MAX_MESSAGE_BYTES)

    @property
    def computing(self) -> bool:
        return self._computing or (self._native is not None and self._native.computing)

    def run(self) -> None:
        conn, received = self._conn, self._received
        conn.settimeout(_HANDSHAKE_TIMEOUT_S)  # a peer that never proves itself must not keep a thread
        self._handshake()
        conn.settimeout(None)
        if self._hosted.native_hops is not None:
            self._run_native()
            return
        while True:
            length = conn.recv_into(received)
            if length == 0:
                return  # the client hung up
            self._answer(length)
            native.park()  # the attention side computes until the next hop: leave it the cores

    def _run_native(self) -> None:
        """The C++ loop answers decode hops itself and hands this connection every other message."""
        self._native = self._hosted.native_hops.connect(self._conn.fileno())
        rc = self._native.serve(self._answer_native)
        if self._stopped is not None:
            raise self._stopped
        if rc < 0:
            raise OSError(-rc, os.strerror(-rc))

    def _answer_native(self, message: bytes) -> int:
        try:
            self._received[:len(message)] = message
            self._answer(len(message))
            return 0
        except BaseException as e:  # noqa: BLE001 - raised again by _run_native, outside the C++ frames
            self._stopped = e
            return 1

    def _answer(self, length: int) -> None:
        """Answer one hop request of `length` bytes in self._received, on the socket."""
        conn, received = self._conn, self._received
        start_ns = time.monotonic_ns()
        if length < doorbell.REQUEST.size or received[0] != doorbell.KIND_FORWARD:
            raise _ProtocolError(f"a {length}-byte message that is not a hop request")
        (_, dtype, slot, layer, num_tokens, top_k, hidden_size, seq,
         announced_length, trace_length) = doorbell.REQUEST.unpack_from(received)
        status, compute_ns, error = doorbell.STATUS_OK, 0, b""
        try:
            if announced_length:
                self._map(slot, received[doorbell.REQUEST.size:doorbell.REQUEST.size + announced_length])
            start = doorbell.REQUEST.size + announced_length
            traceparent = received[start:start + trace_length] if trace_length else None
            compute_ns = self._forward_traced(traceparent, slot, layer, num_tokens, top_k, hidden_size, dtype)
        # Whatever one request does wrong, the connection must survive for the next layer.
        except Exception as e:  # noqa: BLE001
            log.warning("forward layer %d: %s", layer, e)
            status = doorbell.STATUS_ERROR
            error = f"{type(e).__name__}: {e}".encode()[:len(self._reply) - doorbell.REPLY.size]
        doorbell.REPLY.pack_into(self._reply, 0, doorbell.KIND_FORWARD, status, seq, start_ns,
                                 time.monotonic_ns(), compute_ns)
        size = doorbell.REPLY.size
        if error:
            self._reply[size:size + len(error)] = error
            size += len(error)
        conn.send(memoryview(self._reply)[:size])

    def close(self) -> None:
        self._views.clear()
        for region in self._regions:
            if region is not None:
                region.close()
        self._conn.close()
        if self._native is not None:
            self._native.close()

    def _handshake(self) -> None:
        """The version, then the proof of the cluster secret: nothing is mapped before both."""
        length = self._conn.recv_into(self._received)
        if length < doorbell.HELLO.size:
            raise _ProtocolError("no handshake")
        kind, version, magic = doorbell.HELLO.unpack_from(self._received)
        if kind != doorbell.KIND_HELLO or magic != doorbell.MAGIC:
            raise _ProtocolError("not a SplitMoE doorbell handshake")
        if version != doorbell.VERSION:
            self._refuse(doorbell.KIND_HELLO, f"doorbell version {version}: this service speaks {doorbell.VERSION}")
        challenge = secrets.token_bytes(doorbell.NONCE_BYTES)
        self._conn.send(self._reply_header(doorbell.KIND_HELLO, doorbell.STATUS_OK) + challenge)
        length = self._conn.recv_into(self._received)
        if length < doorbell.PROOF.size or self._received[0] != doorbell.KIND_PROOF:
            raise _ProtocolError(f"{self._peer_label()}: no proof of the cluster secret")
        _, presented = doorbell.PROOF.unpack_from(self._received)
        if self._token and not hmac.compare_digest(presented, doorbell.proof(self._token, challenge)):
            self._refuse(doorbell.KIND_PROOF, f"{self._peer_label()}: wrong cluster secret")
        self._conn.send(self._reply_header(doorbell.KIND_PROOF, doorbell.STATUS_OK))

    def _refuse(self, kind: int, why: str) -> None:
        self._conn.send(self._reply_header(kind, doorbell.STATUS_ERROR) + why.encode())
        raise _ProtocolError(why)

    @staticmethod
    def _reply_header(kind: int, status: int) -> bytes:
        return doorbell.REPLY.pack(kind, status, doorbell.VERSION, 0, 0, 0)

    def _peer_label(self) -> str:
        return f"peer pid {self._peer.pid} uid {self._peer.uid}"

    def _map(self, slot: int, announced: bytearray) -> None:
        self._check_slot(slot)
        name, num_bytes = doorbell.parse_announcement(announced)
        region = ShmRegion.attach(name, num_bytes, self._peer)
        old, self._regions[slot] = self._regions[slot], region
        self._views = {k: v for k, v in self._views.items() if k[0] != slot}
        if self._native is not None:  # before the old region goes: the loop must never read it again
            self._native.set_region(slot, region.address, region.num_bytes)
        if old is not None:
            old.close()

    def _forward_traced(self, traceparent: bytearray | None, *hop) -> int:
        if traceparent is None:
            return self._forward(*hop)
        parent = propagate.extract({"traceparent": traceparent.decode(errors="replace")})
        if not trace.get_current_span(parent).get_span_context().is_valid:
            return self._forward(*hop)
        with _tracer.start_as_current_span("expert.forward", context=parent, attributes={"splitmoe.layer": hop[1]}):
            return self._forward(*hop)

    def _forward(self, slot: int, layer: int, num_tokens: int, top_k: int, hidden_size: int, wire_dtype: int) -> int:
        """Compute one hop in place; returns the expert compute time in ns."""
        key = (slot, num_tokens, top_k, hidden_size, wire_dtype)
        views = self._views.get(key)
        if views is None:
            views = self._new_views(*key)
        hidden, expert_ids, expert_weights, output = views
        self._computing = True
        try:
            out, compute_s = self._hosted.forward(layer, hidden, expert_ids, expert_weights)
            if out.shape != output.shape:
                raise ValueError(f"the shard returned {list(out.shape)} for {list(output.shape)}")
            output.copy_(out)
        finally:
            self._computing = False
        return int(compute_s * 1e9)

    def _new_views(self, slot: int, num_tokens: int, top_k: int, hidden_size: int,
                   wire_dtype: int) -> tuple[torch.Tensor, ...]:
        self._check_slot(slot)
        region = self._regions[slot]
        if region is None:
            raise ValueError(f"slot {slot} has no shared-memory region yet")
        dtype = codec.torch_dtype(wire_dtype)
        layout = doorbell.slot_layout(num_tokens, top_k, hidden_size, dtype)
        views = (region.view(layout.hidden, (num_tokens, hidden_size), dtype),
                 region.view(layout.expert_ids, (num_tokens, top_k), torch.int32),
                 region.view(layout.expert_weights, (num_tokens, top_k), torch.float32),
                 region.view(layout.output, (num_tokens, hidden_size), dtype))
        if len(self._views) >= _MAX_CACHED_VIEWS:
            self._views.clear()
        self._views[(slot, num_tokens, top_k, hidden_size, wire_dtype)] = views
        return views

    @staticmethod
    def _check_slot(slot: int) -> None:
        if slot >= doorbell.NUM_SLOTS:
            raise ValueError(f"slot {slot}: a connection has {doorbell.NUM_SLOTS}")
