"""One expert service seen from the attention side: channel, Forward stream, transport, health.

The Forward stream stays open; a reader thread hands each response to the hop waiting for it,
so the caller can wait with a deadline (a blocking gRPC iterator cannot) and can have hops to
several services in flight at once. A dead stream marks the service unhealthy at once, even
when idle; `revive` opens a fresh channel (never one stuck in reconnect backoff) and stream.
"""
from __future__ import annotations

import collections
import itertools
import logging
import queue
import socket
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Callable

import grpc
import torch

from attention_service.expert_placement import ServiceShard
from attention_service.expert_transport import GrpcPayload, Payload, ShmPayload
from modelfile.experts import ExpertKey
from proto import expert_pb2, expert_pb2_grpc
from splitmoe.telemetry import inject_grpc_metadata

log = logging.getLogger(__name__)
_END_OF_REQUESTS = object()


class HopFailed(Exception):
    """One request to one service got no answer (the service is then marked unhealthy)."""


class ExpertRequestError(RuntimeError):
    """A service answered a request with an error: the request was bad, the service is fine."""


@dataclass(slots=True)
class HopCounters:
    """Per-service totals for metrics: hop latency, expert compute time and bytes moved."""

    num_hops: int = 0
    hop_s: float = 0.0
    compute_s: float = 0.0     # as reported by the service
    sent_bytes: int = 0        # tensor payload written to the wire or to shared memory
    received_bytes: int = 0


@dataclass(frozen=True, slots=True)
class ConnectionSettings:
    expert_timeout_s: float
    connect_timeout_s: float
    transport: str                 # "auto" | "grpc" | "shm"
    max_message_bytes: int
    shm_initial_bytes: int


def shard_from_info(address: str, info: expert_pb2.ShardInfo) -> ServiceShard:
    return ServiceShard(address, tuple(info.layers), tuple(info.experts), info.hostname, info.num_bytes)


# ---- the stream --------------------------------------------------------------------------------

class ForwardStream:
    """An open Forward call: requests go out in order, responses come back in order."""

    def __init__(self, stub: expert_pb2_grpc.ExpertServiceStub, on_end: Callable[["ForwardStream", str], None]):
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: collections.deque[futures.Future] = collections.deque()
        self._end_error: str | None = None
        self._on_end = on_end
        self._call = stub.Forward(iter(self._requests.get, _END_OF_REQUESTS), metadata=inject_grpc_metadata())
        threading.Thread(target=self._read_responses, name="expert-stream-reader", daemon=True).start()

    def submit(self, request: expert_pb2.ExpertRequest) -> futures.Future:
        """A future of (response, arrival time in perf_counter seconds)."""
        future: futures.Future = futures.Future()
        self._pending.append(future)
        if self._end_error is not None:  # the reader may have drained before our append
            _fail(future, self._end_error)
        else:
            self._requests.put(request)
        return future

    def close(self) -> None:
        self._requests.put(_END_OF_REQUESTS)
        self._call.cancel()

    def _read_responses(self) -> None:
        try:
            for response in self._call:
                self._pending.popleft().set_result((response, time.perf_counter()))
            error = "the service ended the stream"
        except grpc.RpcError as e:
            error = f"{e.code().name}: {e.details()}"
        except IndexError:
            error = "the service answered a request that was never sent"
        self._end_error = error  # set before draining: see submit
        while self._pending:
            _fail(self._pending.popleft(), error)
        self._on_end(self, error)


def _fail(future: futures.Future, error: str) -> None:
    if not future.done():
        try:
            future.set_exception(HopFailed(error))
        except futures.InvalidStateError:
            pass  # the other side of the race failed it first


# ---- one service -------------------------------------------------------------------------------

@dataclass(slots=True)
class Hop:
    stream: ForwardStream | None
    future: futures.Future | None
    payload: Payload | None
    step_id: int
    sent_s: float
    sent_bytes: int
    error: str = ""


@dataclass
class _Connection:
    """What one successful (re)connect produced; replaced whole, never patched."""

    channel: grpc.Channel
    stub: expert_pb2_grpc.ExpertServiceStub
    stream: ForwardStream | None = None
    payload: Payload | None = None


class ExpertServiceClient:
    """The attention side's connection to one expert service address."""

    def __init__(self, address: str, settings: ConnectionSettings):
        self.address = address
        self.settings = settings
        self.shard = ServiceShard(address)  # the shard we rely on it hosting (set by the placement)
        self.info: expert_pb2.ShardInfo | None = None  # its last DescribeShard/LoadShard answer
        self.healthy = False
        self.last_error = "not connected"
        self.counters = HopCounters()
        self.last_attempt_s = float("-inf")  # last reconnect attempt, or the failure that made it unhealthy
        self._lock = threading.Lock()
        self._step_ids = itertools.count(1)
        self._conn = self._new_connection()

    @property
    def transport(self) -> str:
        payload = self._conn.payload
        return payload.name if payload is not None and self.healthy else ""

    # ---- control RPCs ---------------------------------------------------------------------------

    def describe(self, timeout_s: float, wait_for_ready: bool = False) -> ServiceShard:
        info = self._conn.stub.DescribeShard(expert_pb2.DescribeShardRequest(), timeout=timeout_s,
                                             wait_for_ready=wait_for_ready)
        self.info = info
        return shard_from_info(self.address, info)

    def load_shard(self, layers: tuple[int, ...], experts: tuple[int, ...]) -> ServiceShard:
        info = self._conn.stub.LoadShard(expert_pb2.LoadShardRequest(layers=layers, experts=experts),
                                         timeout=self.settings.expert_timeout_s)
        self.info = info
        return shard_from_info(self.address, info)

    def token_counts(self) -> dict[ExpertKey, int]:
        stats = self._conn.stub.GetStats(expert_pb2.StatsRequest(), timeout=self.settings.expert_timeout_s)
        return {ExpertKey(layer, expert): n for layer, expert, n in zip(stats.layers, stats.experts, stats.tokens)}

    # ---- lifecycle ------------------------------------------------------------------------------

    def open_stream(self, shard: ServiceShard) -> None:
        """Rely on `shard`: open the Forward stream over the chosen transport and handshake."""
        self.shard = shard
        with self._lock:
            self._open_stream_locked()

    def revive(self) -> bool:
        """Reconnect a service marked unhealthy (a fresh channel; LoadShard again if it came back empty).

        Returns at once, False, while another thread is already trying.
        """
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if self.healthy:
                return True
            self.last_attempt_s = time.monotonic()
            self._replace_connection()
            try:
                self._restore_shard()
                self._open_stream_locked()
            except (grpc.RpcError, HopFailed, OSError, ValueError) as e:
                self.last_error = _one_line(e)
                return False
        finally:
            self._lock.release()
        log.info("expert service %s is back (%s)", self.address, self.transport)
        return True

    def mark_unhealthy(self, stream: ForwardStream | None, error: str) -> None:
        """The stream failed: drop it (only if it is still the current one) and report why."""
        if stream is not None and stream is not self._conn.stream:
            return  # checked before locking too: a revive in progress must not stall the data path
        with self._lock:
            if stream is not None and stream is not self._conn.stream:
                return  # a stale stream's news; the service was revived since
            if self.healthy:
                log.warning("expert service %s unhealthy: %s", self.address, error)
                self.last_attempt_s = time.monotonic()  # the data path retries it after reconnect_interval_s
            self.healthy, self.last_error = False, error
            self._close_stream_locked()

    def close(self) -> None:
        with self._lock:
            self.healthy, self.last_error = False, "closed"
            self._close_stream_locked()
            self._conn.channel.close()

    # ---- the data path --------------------------------------------------------------------------

    def submit(self, layer: int, hidden: torch.Tensor, rows: torch.Tensor | None,
               expert_ids: torch.Tensor, expert_weights: torch.Tensor) -> Hop:
        """Send one layer's part without waiting: hops to several services overlap."""
        conn = self._conn
        step_id = next(self._step_ids)
        if conn.stream is None:
            return Hop(None, None, None, step_id, time.perf_counter(), 0, error=self.last_error)
        request = expert_pb2.ExpertRequest(step_id=step_id, layer=layer)
        request.trace_context.update(inject_grpc_metadata())
        try:
            sent_bytes = conn.payload.fill(request, hidden, rows, expert_ids, expert_weights)
        except (OSError, ValueError) as e:  # e.g. /dev/shm full: this hop fails over like any other
            return Hop(conn.stream, None, None, step_id, time.perf_counter(), 0, error=_one_line(e))
        sent_s = time.perf_counter()
        return Hop(conn.stream, conn.stream.submit(request), conn.payload, step_id, sent_s, sent_bytes)

    def wait(self, hop: Hop) -> torch.Tensor:
        """The hop's output [rows, D].

        HopFailed (no answer: the service is marked unhealthy) or ExpertRequestError (it answered
        with an error: it stays healthy, the stream stays open).
        """
        try:
            response, arrived_s = self._response(hop)
        except HopFailed as e:
            self.mark_unhealthy(hop.stream, str(e))
            raise
        if response.error:
            raise ExpertRequestError(f"expert service {self.address} rejected layer {response.layer}: {response.error}")
        out = hop.payload.output(response)
        self._count(hop, arrived_s, response.compute_s, out.numel() * out.element_size())
        return out

    def _response(self, hop: Hop) -> tuple[expert_pb2.ExpertResponse, float]:
        if hop.future is None:
            raise HopFailed(hop.error)
        remaining_s = hop.sent_s + self.settings.expert_timeout_s - time.perf_counter()
        try:
            response, arrived_s = hop.future.result(timeout=max(remaining_s, 0.0))
        except futures.TimeoutError:
            raise HopFailed(f"no answer within expert_timeout_s={self.settings.expert_timeout_s}") from None
        if response.step_id != hop.step_id:
            raise HopFailed(f"answer to request {response.step_id} while waiting for {hop.step_id}")
        return response, arrived_s

    def _count(self, hop: Hop, arrived_s: float, compute_s: float, received_bytes: int) -> None:
        c = self.counters
        c.num_hops += 1
        c.hop_s += arrived_s - hop.sent_s
        c.compute_s += compute_s
        c.sent_bytes += hop.sent_bytes
        c.received_bytes += received_bytes

    # ---- internals (called with self._lock held) ------------------------------------------------

    def _new_connection(self) -> _Connection:
        options = [("grpc.max_send_message_length", self.settings.max_message_bytes),
                   ("grpc.max_receive_message_length", self.settings.max_message_bytes),
                   # gRPC's default backoff grows to 120 s: a restarted expert service must be
                   # found again within a second or two, not minutes later.
                   ("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
                   ("grpc.max_reconnect_backoff_ms", 1000)]
        channel = grpc.insecure_channel(self.address, options=options)
        return _Connection(channel, expert_pb2_grpc.ExpertServiceStub(channel))

    def _replace_connection(self) -> None:
        self._close_stream_locked()
        self._conn.channel.close()
        self._conn = self._new_connection()

    def _restore_shard(self) -> None:
        reported = self.describe(self.settings.connect_timeout_s)
        if reported.is_empty and not self.shard.is_empty:
            reported = self.load_shard(self.shard.layers, self.shard.experts)
        if (reported.layers, reported.experts) != (self.shard.layers, self.shard.experts):
            raise ValueError(f"came back hosting {reported.label()}, expected {self.shard.label()}")

    def _open_stream_locked(self) -> None:
        self._close_stream_locked()
        for payload in self._payload_choices():
            error = self._try_stream(payload)
            if not error:
                self.healthy, self.last_error = True, ""
                return
            log.info("expert service %s: %s transport failed (%s)", self.address, payload.name, error)
        raise HopFailed(error)

    def _payload_choices(self) -> list[Payload]:
        wanted = self.settings.transport
        same_host = self.shard.hostname == socket.gethostname()
        if wanted == "shm" or (wanted == "auto" and same_host):
            # auto falls back to bytes when the peer cannot map our region (another container)
            return [ShmPayload(self.settings.shm_initial_bytes)] + ([GrpcPayload()] if wanted == "auto" else [])
        return [GrpcPayload()]

    def _try_stream(self, payload: Payload) -> str:
        """'' when a handshake (a zero-token request) went through this transport, else why not."""
        conn = self._conn
        conn.stream, conn.payload = ForwardStream(conn.stub, self._stream_ended), payload
        empty = torch.empty(0, max(self.info.hidden_size, 1))
        routing = torch.empty(0, 1, dtype=torch.int32)
        hop = self.submit(self.shard.layers[0] if self.shard.layers else 0, empty, None, routing, routing.float())
        try:
            self._response_ok(hop)
            return ""
        except HopFailed as e:
            self._close_stream_locked()
            return str(e)

    def _response_ok(self, hop: Hop) -> None:
        response, _ = self._response(hop)
        if response.error:
            raise HopFailed(response.error)

    def _stream_ended(self, stream: ForwardStream, error: str) -> None:
        self.mark_unhealthy(stream, error)

    def _close_stream_locked(self) -> None:
        conn = self._conn
        if conn.stream is not None:
            conn.stream.close()
        if conn.payload is not None:
            conn.payload.close()
        conn.stream, conn.payload = None, None


def _one_line(e: Exception) -> str:
    if isinstance(e, grpc.RpcError):
        return f"{e.code().name}: {e.details()}"
    return str(e).splitlines()[0] if str(e) else type(e).__name__
