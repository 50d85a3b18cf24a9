"""The expert service's end of the co-located fast path (proto/doorbell.py).

A listener on a Unix SOCK_SEQPACKET socket in the abstract namespace (nothing on disk; gone with
the process) and one thread per attention connection. Any local process can connect to an
abstract socket, so a connection first proves it holds the cluster secret (a challenge answered
with an HMAC), and the kernel tells who it is (SO_PEERCRED): it may then name up to `NUM_SLOTS`
shared-memory regions, each of which must be its own (proto/shm.py `ShmRegion.attach`). A
request's tensors are views of its slot (proto/doorbell.py `Slot`: no copy, no allocation beyond
a few cached tensor views), the hop handler (expert_service/hops.py) computes, and the output is
copied into the slot's output area before the reply header goes back. With the native kernels a
C++ loop (expert_service/native_hops.py) answers decode hops itself and hands the rest to Python,
hops with LoRA rows (KIND_FORWARD_LORA) among them.
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
from opentelemetry import context as otel_context
from opentelemetry import propagate

from splitmoe.expert_service.adapters import HopLora
from splitmoe.expert_service.hops import HopHandler, Lane
from splitmoe.expert_service.native_hops import NativeConnection
from splitmoe.kernels import native
from splitmoe.modelfile.lora_adapter import AdapterRef
from splitmoe.proto import codec, doorbell
from splitmoe.proto.shm import Peer, ShmRegion

log = logging.getLogger(__name__)
_HANDSHAKE_TIMEOUT_S = 10.0


class DoorbellServer:
    """Accepts doorbell connections and answers their hops, until closed."""

    def __init__(self, handler: HopHandler, token: str):
        self._handler = handler
        self._token = token  # empty: no cluster secret, every local process may connect
        self.address = f"@splitmoe-experts-{os.getpid()}-{secrets.token_hex(6)}"
        self._listener = doorbell.new_socket()
        self._listener.bind(doorbell.socket_address(self.address))
        self._listener.listen(64)
        self._connections: set[socket.socket] = set()
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
            connection = _Connection(conn, self._handler, self._token)
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._connections.add(conn)
            threading.Thread(target=self._serve, args=(connection,), name="expert-doorbell-conn", daemon=True).start()

    def _serve(self, connection: "_Connection") -> None:
        native.pin_caller()  # the hop loop calls the native pool: on its first CPU (--pin-threads)
        try:
            connection.run()
        except OSError as e:  # the client went away mid-reply
            log.debug("doorbell connection ended: %s", e)
        except _ProtocolError as e:
            log.warning("doorbell connection dropped: %s", e)
        finally:
            connection.close()
            with self._lock:
                self._connections.discard(connection.socket)


class _ProtocolError(Exception):
    pass


class _Connection:
    """One attention connection: its handshake, its slots, and its hops, answered in order."""

    def __init__(self, conn: socket.socket, handler: HopHandler, token: str):
        self.socket = self._conn = conn
        self._handler = handler
        self._token = token
        self._peer: Peer = doorbell.peer_of(conn)
        self._lane: Lane | None = None  # this connection's hops answered in Python
        self._native: NativeConnection | None = None  # and the C++ loop's, with the native kernels
        self._stopped: BaseException | None = None  # what ended the native loop from a Python answer
        self._slots: list[doorbell.Slot | None] = [None] * doorbell.NUM_SLOTS
        self._hop: tuple = ()  # the hop being answered: slot, announcement, tokens, top_k, hidden size, dtype
        self._hop_adapters: bytes = b""  # and its adapters (KIND_FORWARD_LORA), as the request carries them
        self._hop_views: doorbell.SlotViews | None = None
        self._received = bytearray(doorbell.MAX_MESSAGE_BYTES)
        self._reply = bytearray(doorbell.MAX_MESSAGE_BYTES)

    def run(self) -> None:
        conn, received = self._conn, self._received
        conn.settimeout(_HANDSHAKE_TIMEOUT_S)  # a peer that never proves itself must not keep a thread
        self._handshake()
        conn.settimeout(None)
        with self._handler.lane() as self._lane:
            if self._handler.hosted.native_hops is not None:
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
        self._native = self._handler.hosted.native_hops.connect(self._conn.fileno())
        with self._handler.native_loop(self._native):
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
        received = self._received
        start_ns = time.monotonic_ns()
        if length < doorbell.REQUEST.size or received[0] not in (doorbell.KIND_FORWARD, doorbell.KIND_FORWARD_LORA):
            raise _ProtocolError(f"a {length}-byte message that is not a hop request")
        (kind, wire_dtype, slot, layer, num_tokens, top_k, hidden_size, seq,
         announced_length, trace_length) = doorbell.REQUEST.unpack_from(received)
        start = doorbell.REQUEST.size + announced_length
        parent = _trace_parent(received[start:start + trace_length]) if trace_length else None
        self._hop = (slot, received[doorbell.REQUEST.size:start] if announced_length else None,
                     num_tokens, top_k, hidden_size, wire_dtype)
        self._hop_adapters = bytes(received[start + trace_length:length]) if kind == doorbell.KIND_FORWARD_LORA else b""
        compute_s, error = self._handler.answer(self._lane, layer, parent, self)
        doorbell.REPLY.pack_into(self._reply, 0, doorbell.KIND_FORWARD,
                                 doorbell.STATUS_ERROR if error else doorbell.STATUS_OK, seq, start_ns,
                                 time.monotonic_ns(), int(compute_s * 1e9))
        size = doorbell.REPLY.size
        if error:
            message = error.encode()[:len(self._reply) - size]
            self._reply[size:size + len(message)] = message
            size += len(message)
        self._conn.send(memoryview(self._reply)[:size])

    # ---- the hop being answered, as the handler reads and writes it (hops.Hop) -------------------

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        slot, announced, num_tokens, top_k, hidden_size, wire_dtype = self._hop
        if announced is not None:
            self._map(slot, announced)
        try:
            mapped = self._slots[slot]
        except IndexError:
            raise _bad_slot(slot) from None
        if mapped is None:
            raise ValueError(f"slot {slot} has no shared-memory region yet")
        views = self._hop_views = mapped.views(num_tokens, top_k, hidden_size, codec.torch_dtype(wire_dtype))
        return views.hidden, views.expert_ids, views.expert_weights

    def lora(self) -> HopLora:
        """Each adapter's rows, from each row's adapter index in the slot (after `inputs` mapped it)."""
        if not self._hop_adapters:
            return []
        slot, _, num_tokens, top_k, hidden_size, wire_dtype = self._hop
        adapters = doorbell.parse_adapters(self._hop_adapters)
        index = doorbell.lora_rows_view(self._slots[slot].region, num_tokens, top_k, hidden_size,
                                        codec.torch_dtype(wire_dtype)).long()
        return [(AdapterRef(*adapter), (index == i).nonzero().flatten()) for i, adapter in enumerate(adapters)]

    def deliver(self, output: torch.Tensor) -> None:
        into = self._hop_views.output
        if output.shape != into.shape:
            raise ValueError(f"the shard returned {list(output.shape)} for {list(into.shape)}")
        into.copy_(output)

    # ---- the connection --------------------------------------------------------------------------

    def close(self) -> None:
        self._hop_views = None
        for mapped in self._slots:
            if mapped is not None:
                mapped.close()
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
        if slot >= doorbell.NUM_SLOTS:
            raise _bad_slot(slot)
        name, num_bytes = doorbell.parse_announcement(announced)
        region = ShmRegion.attach(name, num_bytes, self._peer)
        old, self._slots[slot] = self._slots[slot], doorbell.Slot(region)
        self._hop_views = None  # may be the old region's
        if self._native is not None:  # before the old region goes: the loop must never read it again
            self._native.set_region(slot, region.address, region.num_bytes)
        if old is not None:
            old.close()


def _trace_parent(traceparent: bytearray) -> otel_context.Context:
    """The caller's trace context from the W3C traceparent a hop carries."""
    return propagate.extract({"traceparent": traceparent.decode(errors="replace")})


def _bad_slot(slot: int) -> ValueError:
    return ValueError(f"slot {slot}: a connection has {doorbell.NUM_SLOTS}")
