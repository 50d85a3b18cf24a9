"""One expert service seen from the attention side: channel, link (transport), health, hop counters.

The gRPC channel carries the control RPCs (DescribeShard, LoadShard, GetStats). Hops go over a
link (the Link protocol: attention_service/expert_backends/shm_link.py): the Forward stream, or on one host the
shared-memory doorbell. Either way several hops may be in flight, answered in order, and waited
for with a deadline. A dead link marks the service unhealthy at once, even when idle; `revive`
opens a fresh channel (never one stuck in reconnect backoff) and link.

A silent peer (a partitioned host, a hung process) is found two ways: gRPC keepalive pings on
the channel end its Forward stream about a second after the peer stops answering, and a hop
unanswered past its learned budget (hop_budget.py) is *abandoned*: the caller re-sends it to a
replica, the service is left out of the placement while it is `lagging`, and its answer, should it
still come, is read and dropped (the link's order and shared-memory slots stay consistent).
"""
from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from array import array
from dataclasses import dataclass, field
from statistics import median
from typing import Callable

import grpc
import torch

from splitmoe.attention_service.expert_backends.backend import HopStats
from splitmoe.attention_service.expert_backends.grpc_link import GrpcLink
from splitmoe.attention_service.expert_backends.hop_budget import HopBudget
from splitmoe.attention_service.expert_backends.placement import ServiceShard
from splitmoe.attention_service.expert_backends.shm_link import HopFailed, HopLora, Link, Reply, ShmLink, Ticket
from splitmoe.modelfile.expert_tensors import ExpertKey
from splitmoe.modelfile.lora_adapter import AdapterRef
from splitmoe.proto import expert_pb2, expert_pb2_grpc
from splitmoe.runtime.cluster_auth import ClusterSecurity

log = logging.getLogger(__name__)
__all__ = ["HopFailed", "HopLate", "ExpertRequestError", "ExpertServiceClient", "ConnectionSettings", "HopCounters", "TRANSPORTS"]
OVERHEAD_WINDOW = 1024  # hops the median overhead is taken over


class HopLate(HopFailed):
    """A hop unanswered past its budget: abandoned (see the module docstring), not failed; the
    service stays healthy."""


class ExpertRequestError(RuntimeError):
    """A service answered a request with an error: the request was bad, the service is fine."""

    def __init__(self, address: str, layer: int, reason: str):
        super().__init__(f"expert service {address} rejected layer {layer}: {reason}")
        self.reason = reason  # the service's own words


@dataclass(slots=True)
class HopCounters:
    """Per-service totals for metrics: hop latency, expert compute, transport overhead, bytes."""

    num_hops: int = 0
    hop_s: float = 0.0
    compute_s: float = 0.0     # as reported by the service
    overhead_s: float = 0.0    # see shm_link.Reply.overhead_s
    sent_bytes: int = 0        # tensor payload written to the wire or to shared memory
    received_bytes: int = 0
    recent_overhead_s: array = field(default_factory=lambda: array("d"))  # a ring of the last hops'

    def add(self, hop_s: float, compute_s: float, overhead_s: float, sent_bytes: int, received_bytes: int) -> None:
        if len(self.recent_overhead_s) < OVERHEAD_WINDOW:
            self.recent_overhead_s.append(overhead_s)
        else:
            self.recent_overhead_s[self.num_hops % OVERHEAD_WINDOW] = overhead_s
        self.num_hops += 1
        self.hop_s += hop_s
        self.compute_s += compute_s
        self.overhead_s += overhead_s
        self.sent_bytes += sent_bytes
        self.received_bytes += received_bytes

    def overhead_us_median(self) -> float:
        recent = self.recent_overhead_s.tolist()
        return median(recent) * 1e6 if recent else 0.0

    def overhead_us_mean(self) -> float:
        return self.overhead_s / self.num_hops * 1e6 if self.num_hops else 0.0

    def snapshot(self, transport: str) -> HopStats:
        return HopStats(self.num_hops, self.hop_s, self.compute_s, self.sent_bytes, self.received_bytes,
                        self.overhead_us_median(), self.overhead_us_mean(), transport)


TRANSPORTS = ("auto", "grpc", "shm")


@dataclass(frozen=True, slots=True)
class ConnectionSettings:
    """How the attention side talks to one expert service."""

    expert_timeout_s: float = 10.0             # deadline of every hop and every control RPC
    connect_timeout_s: float = 1.0             # one reconnect attempt to a service marked unhealthy
    transport: str = "auto"                    # auto: shared memory with services on this host, else gRPC
    max_message_bytes: int = 1 << 30           # 1 GiB: a long prefill's hidden states in one message
    shm_initial_bytes: int = 4 << 20           # per connection; grows to the largest request
    keepalive_s: float = 0.5                   # gRPC ping interval, and how long its answer may take
    hedge_floor_s: float = 0.25                # a hop is never abandoned for a replica sooner than this
    hedge_margin: float = 4.0                  # ... nor before this many times its learned quantile
    stats_timeout_s: float = 0.3               # GetStats to one service: what /metrics waits at most
    load_timeout_s: float = 600.0              # LoadShard: a service reads (and repacks) its share of a large file
    security: ClusterSecurity = ClusterSecurity()  # the secret every call and doorbell carries; TLS

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport {self.transport!r}: want one of {', '.join(TRANSPORTS)}")
        if min(self.expert_timeout_s, self.connect_timeout_s, self.keepalive_s, self.hedge_floor_s,
               self.hedge_margin, self.stats_timeout_s, self.load_timeout_s) <= 0:
            raise ValueError("expert timeouts, the keepalive and the hedge budget must be positive")


def shard_from_info(address: str, info: expert_pb2.ShardInfo) -> ServiceShard:
    if info.by_layer:  # exactly what it hosts (services of older versions send only the rectangle)
        keys = (ExpertKey(entry.layer, e) for entry in info.by_layer for e in entry.experts)
        return ServiceShard.of_keys(address, keys, info.hostname, info.num_bytes)
    return ServiceShard(address, tuple(info.layers), tuple(info.experts), info.hostname, info.num_bytes)


def load_shard_request(shard: ServiceShard) -> expert_pb2.LoadShardRequest:
    if not shard.by_layer:
        return expert_pb2.LoadShardRequest(layers=shard.layers, experts=shard.experts)
    return expert_pb2.LoadShardRequest(
        by_layer=[expert_pb2.LayerExperts(layer=layer, experts=es) for layer, es in shard.by_layer])


# ---- one service -------------------------------------------------------------------------------

@dataclass(slots=True)
class Hop:
    link: Link | None
    ticket: Ticket | None
    layer: int
    sent_s: float        # perf_counter when submitted: the deadline counts from here
    sent_bytes: int
    num_rows: int = 0
    error: str = ""


@dataclass
class _Connection:
    """What one successful (re)connect produced; replaced whole, never patched."""

    channel: grpc.Channel
    stub: expert_pb2_grpc.ExpertServiceStub
    link: Link | None = None


class ExpertServiceClient:
    """The attention side's connection to one expert service address.

    Not thread-safe on the data path: one thread at a time submits and waits (RemoteExperts'
    lock); the reconnect thread and the links' watchers only ever replace or close a link.
    """

    def __init__(self, address: str, settings: ConnectionSettings, server_name: str = ""):
        self.address = address
        self.settings = settings
        self.server_name = server_name  # what its TLS certificate names, when not the host of `address`
        self.shard = ServiceShard(address)  # the shard we rely on it hosting (set by the placement)
        self.info: expert_pb2.ShardInfo | None = None  # its last DescribeShard/LoadShard answer
        self.healthy = False
        self.last_error = "not connected"
        self.counters = HopCounters()
        self.budget = HopBudget(settings.hedge_floor_s, settings.hedge_margin, settings.expert_timeout_s)
        self._abandoned: collections.deque[Hop] = collections.deque()  # oldest first, on the current link
        self._token_counts: dict[ExpertKey, int] = {}  # its last GetStats answer
        self.last_attempt_s = float("-inf")  # last reconnect attempt, or the failure that made it unhealthy
        self._closed = False  # left the membership: never revived again
        self._lock = threading.Lock()
        self._conn = self._new_connection()

    @property
    def transport(self) -> str:
        link = self._conn.link
        return link.name if link is not None and self.healthy else ""

    @property
    def draining(self) -> bool:
        """It said it is leaving (SIGTERM): its experts should move before it goes (membership.py)."""
        return self.info is not None and self.info.draining

    @property
    def instance_id(self) -> str:
        """The process behind the address, from its last DescribeShard ('' before the first)."""
        return self.info.instance_id if self.info is not None else ""

    @property
    def lagging(self) -> bool:
        """A hop of it was abandoned and has not been answered yet: the placement avoids it."""
        return bool(self._abandoned)

    def lag_reason(self) -> str:
        """Why it is lagging, for health ('' when it is not)."""
        try:
            oldest = self._abandoned[0]
        except IndexError:  # none, or the link ended meanwhile
            return ""
        return f"lagging: a hop unanswered for {time.perf_counter() - oldest.sent_s:.1f} s went to a replica"

    # ---- control RPCs ---------------------------------------------------------------------------

    def describe(self, timeout_s: float, wait_for_ready: bool = False) -> ServiceShard:
        info = self._conn.stub.DescribeShard(expert_pb2.DescribeShardRequest(), timeout=timeout_s,
                                             wait_for_ready=wait_for_ready)
        self.info = info
        return shard_from_info(self.address, info)

    def load_shard(self, layers: tuple[int, ...], experts: tuple[int, ...]) -> ServiceShard:
        return self.load(ServiceShard(self.address, layers, experts))

    def load(self, shard: ServiceShard) -> ServiceShard:
        """LoadShard: make the service host exactly `shard`'s pairs; what it reports hosting."""
        info = self._conn.stub.LoadShard(load_shard_request(shard), timeout=self.settings.load_timeout_s)
        self.info = info
        return shard_from_info(self.address, info)

    def prepare_lora(self, ref: AdapterRef) -> None:
        """PrepareLora: the service loads and checks the adapter's expert tensors now (grpc.RpcError if it cannot)."""
        self._conn.stub.PrepareLora(expert_pb2.PrepareLoraRequest(name=ref.name, path=ref.path, identity=ref.identity),
                                    timeout=self.settings.load_timeout_s)

    def ask_token_counts(self) -> grpc.Future | None:
        """GetStats, sent (None for a service unhealthy or lagging: no answer expected soon)."""
        if not self.healthy or self.lagging:
            return None
        return self._conn.stub.GetStats.future(expert_pb2.StatsRequest(), timeout=self.settings.stats_timeout_s)

    def token_counts(self, asked: grpc.Future | None) -> dict[ExpertKey, int]:
        """The answer to `asked`, or the last one when it failed or there was none: /metrics must
        not wait on a silent service, nor drop its experts' counts while it is away."""
        try:
            stats = asked.result() if asked is not None else None
        except grpc.RpcError as e:
            log.info("expert service %s: GetStats failed: %s", self.address, e.code().name)
            stats = None
        if stats is not None:
            self._token_counts = {ExpertKey(layer, expert): n
                                  for layer, expert, n in zip(stats.layers, stats.experts, stats.tokens)}
        return self._token_counts

    # ---- lifecycle ------------------------------------------------------------------------------

    def open_stream(self, shard: ServiceShard) -> None:
        """Rely on `shard`: open a link over the chosen transport and handshake."""
        self.shard = shard
        with self._lock:
            self._open_link_locked()

    def revive(self) -> bool:
        """Reconnect a service marked unhealthy (a fresh channel; LoadShard again if it came back empty).

        Returns at once, False, while another thread is already trying.
        """
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if self.healthy or self._closed:
                return self.healthy
            self.last_attempt_s = time.monotonic()
            self._replace_connection()
            try:
                self._restore_shard()
                self._open_link_locked()
            except (grpc.RpcError, HopFailed, OSError, ValueError) as e:
                self.last_error = _one_line(e)
                return False
        finally:
            self._lock.release()
        log.info("expert service %s is back (%s)", self.address, self.transport)
        return True

    def check_shard(self) -> None:
        """Mark a healthy service unhealthy once it no longer hosts what the placement relies on
        it for (someone loaded another shard into it, or emptied it): its hops would compute
        nothing for those experts. A revive then loads the shard again into an empty service."""
        link, planned = self._conn.link, self.shard
        if not self.healthy or planned.is_empty:
            return
        try:
            reported = self.describe(self.settings.connect_timeout_s)
        except grpc.RpcError:
            return  # a service that does not answer is the link's to detect (EOF, hop deadline)
        # A rebalance may have loaded a new shard while the answer was on its way: the answer is
        # then judged against the shard it was asked about, and a changed plan is checked next time.
        if not reported.covers(planned) and self.shard is planned:
            self.mark_unhealthy(link, f"it hosts {reported.label()}, the placement needs {planned.label()}")

    def mark_unhealthy(self, link: Link | None, error: str) -> None:
        """The link failed: drop it (only if it is still the current one) and report why."""
        if link is not None and link is not self._conn.link:
            return  # checked before locking too: a revive in progress must not stall the data path
        with self._lock:
            if link is not None and link is not self._conn.link:
                return  # a stale link's news; the service was revived since
            if self.healthy:
                log.warning("expert service %s unhealthy: %s", self.address, error)
                self.last_attempt_s = time.monotonic()  # the data path retries it after reconnect_interval_s
            self.healthy, self.last_error = False, error
            self._close_link_locked()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self.healthy, self.last_error = False, "closed"
            self._close_link_locked()
            self._conn.channel.close()

    # ---- the data path --------------------------------------------------------------------------

    def submit(self, layer: int, hidden: torch.Tensor, rows: torch.Tensor | None,
               expert_ids: torch.Tensor, expert_weights: torch.Tensor, lora: HopLora | None = None) -> Hop:
        """Send one layer's part without waiting: hops to several services, and several hops to
        one service (up to proto.doorbell.NUM_SLOTS), overlap. `lora`: the adapters some of the
        part's rows use, those rows numbered within the part."""
        if self._abandoned:  # only when no replica was left: its slots and order first
            self.read_abandoned(block=True)
        link = self._conn.link
        sent_s = time.perf_counter()
        if link is None:
            return Hop(None, None, layer, sent_s, 0, error=self.last_error)
        num_rows = hidden.shape[0] if rows is None else rows.numel()
        try:
            if lora:
                ticket, sent_bytes = link.submit(layer, hidden, rows, expert_ids, expert_weights, lora)
            else:
                ticket, sent_bytes = link.submit(layer, hidden, rows, expert_ids, expert_weights)
        except (OSError, ValueError) as e:  # e.g. /dev/shm full, a dead socket: fails over like any other
            return Hop(link, None, layer, sent_s, 0, num_rows, error=_one_line(e))
        return Hop(link, ticket, layer, sent_s, sent_bytes, num_rows)

    def wait(self, hop: Hop, hedge: bool = False) -> torch.Tensor:
        """The hop's output [rows, D]; a view valid until this service's next submit.

        HopFailed (no answer: the service is marked unhealthy), HopLate (`hedge`: no answer within
        the learned budget; the hop is abandoned, the service stays healthy and becomes `lagging`)
        or ExpertRequestError (it answered with an error: it stays healthy, the link stays open).
        """
        try:
            reply = self._reply(hop, self.budget.after_s(hop.num_rows) if hedge else None)
        except HopLate:
            self._abandoned.append(hop)
            log.info("expert service %s: layer %d hop unanswered after %.3f s, sent to a replica",
                     self.address, hop.layer, time.perf_counter() - hop.sent_s)
            raise
        except HopFailed as e:
            self.mark_unhealthy(hop.link, str(e))
            raise
        out = reply.output
        self._count(hop, reply)
        return out

    def read_abandoned(self, block: bool = False) -> None:
        """Read the answers of abandoned hops that came (all of them, `block`: each by its
        deadline); a hop past its deadline, or a dead link, marks the service unhealthy."""
        while self._abandoned:
            try:
                hop = self._abandoned[0]
            except IndexError:  # the link ended meanwhile (another thread): nothing more to read
                return
            deadline_s = hop.sent_s + self.settings.expert_timeout_s
            try:
                reply = hop.link.poll(hop.ticket, deadline_s if block else float("-inf"))
            except HopFailed as e:
                self.mark_unhealthy(hop.link, str(e))
                return
            if reply is None:
                if time.perf_counter() >= deadline_s:
                    self.mark_unhealthy(hop.link, f"no answer within expert_timeout_s={self.settings.expert_timeout_s:g}")
                return
            if self._abandoned and self._abandoned[0] is hop:
                self._abandoned.popleft()
            self._count(hop, reply)
            log.info("expert service %s answered an abandoned hop after %.3f s", self.address, reply.hop_s)

    def direct_link(self) -> ShmLink | None:
        """Its shared-memory link when native code may send a hop on it without this client's
        submit and wait (expert_backends/direct_hop.py): healthy, nothing abandoned; else None."""
        link = self._conn.link
        return link if self.healthy and not self._abandoned and isinstance(link, ShmLink) else None

    def hold_link(self, link: ShmLink) -> bool:
        """Keep `link` open (no other thread closes it) until `release_link`, if it is still this
        client's and healthy and nobody else holds the client now; else False, at once."""
        if not self._lock.acquire(blocking=False):
            return False
        if self.healthy and self._conn.link is link:
            return True
        self._lock.release()
        return False

    def release_link(self) -> None:
        self._lock.release()

    def count(self, reply: Reply, sent_bytes: int, received_bytes: int, num_rows: int) -> None:
        """An answered hop in the statistics and the hedging budget (native code's hops too: direct_hop.py)."""
        self.counters.add(reply.hop_s, reply.compute_s, reply.overhead_s, sent_bytes, received_bytes)
        self.budget.add(reply.hop_s, num_rows)

    def _count(self, hop: Hop, reply: Reply) -> None:
        self.count(reply, hop.sent_bytes, reply.output.nbytes if reply.output is not None else 0, hop.num_rows)

    def _reply(self, hop: Hop, late_after_s: float | None = None) -> Reply:
        """The hop's answer within the deadline (counted from its sending), else HopFailed (HopLate
        past `late_after_s`); ExpertRequestError when the service answered with an error."""
        if hop.ticket is None:
            raise HopFailed(hop.error)
        timeout_s = self.settings.expert_timeout_s
        if late_after_s is not None and late_after_s < timeout_s:
            reply = hop.link.poll(hop.ticket, hop.sent_s + late_after_s)
            if reply is None:
                raise HopLate(f"no answer within {late_after_s:.3f} s")
        else:
            reply = hop.link.wait(hop.ticket, hop.sent_s + timeout_s, timeout_s)
        if reply.error:
            raise ExpertRequestError(self.address, hop.layer, reply.error)
        return reply

    # ---- internals (called with self._lock held) ------------------------------------------------

    def _new_connection(self) -> _Connection:
        options = [("grpc.max_send_message_length", self.settings.max_message_bytes),
                   ("grpc.max_receive_message_length", self.settings.max_message_bytes),
                   # gRPC's default backoff grows to 120 s: a restarted expert service must be
                   # found again within a second or two, not minutes later.
                   ("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
                   ("grpc.max_reconnect_backoff_ms", 1000),
                   # A peer that stops answering (a partition, a hung host) sends no RST: without
                   # pings its stream would wait for the hop deadline, or forever while idle.
                   ("grpc.keepalive_time_ms", int(self.settings.keepalive_s * 1000)),
                   ("grpc.keepalive_timeout_ms", int(self.settings.keepalive_s * 1000)),
                   ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]
        channel = self.settings.security.channel(self.address, options, self.server_name)
        return _Connection(channel, expert_pb2_grpc.ExpertServiceStub(channel))

    def _replace_connection(self) -> None:
        self._close_link_locked()
        self._conn.channel.close()
        self._conn = self._new_connection()

    def _restore_shard(self) -> None:
        reported = self.describe(self.settings.connect_timeout_s)
        # A placement by load (by_layer) is this attention service's own: a restarted service
        # comes back with its command line's shard, and is given the placement's again.
        if not self.shard.is_empty and (reported.is_empty or self.shard.by_layer) and not reported.covers(self.shard):
            reported = self.load(self.shard)
        if not reported.covers(self.shard):
            raise ValueError(f"came back hosting {reported.label()}, expected {self.shard.label()}")

    def _open_link_locked(self) -> None:
        self._close_link_locked()
        error = ""
        for name, open_link in self._link_choices():
            error = self._try_link(open_link)
            if not error:
                self.healthy, self.last_error = True, ""
                return
            log.info("expert service %s: %s transport failed (%s)", self.address, name, error)
        raise HopFailed(error)

    def _link_choices(self) -> list[tuple[str, Callable[[], Link]]]:
        wanted = self.settings.transport
        same_host = self.shard.hostname == socket.gethostname()
        doorbell = self.info.doorbell if self.info is not None else ""
        grpc_link = ("grpc", lambda: GrpcLink(self._conn.stub, self._link_ended))
        if wanted == "shm" or (wanted == "auto" and same_host and doorbell):
            # auto falls back to gRPC when the doorbell or our regions are out of the peer's reach
            # (another container: another network namespace or /dev/shm)
            shm_link = ("shm", lambda: self._shm_link(doorbell))
            return [shm_link] + ([grpc_link] if wanted == "auto" else [])
        return [grpc_link]

    def _shm_link(self, doorbell: str) -> ShmLink:
        if not doorbell:
            raise HopFailed("the service offers no shared-memory doorbell")
        return ShmLink(doorbell, self.settings.security.token, self.settings.shm_initial_bytes,
                       self.settings.connect_timeout_s, self.settings.expert_timeout_s, self._link_ended)

    def _try_link(self, open_link: Callable[[], Link]) -> str:
        """'' when a link opened and a handshake (a zero-token hop) went through it, else why not."""
        try:
            self._conn.link = open_link()
        except (HopFailed, OSError) as e:
            return _one_line(e)
        empty = torch.empty(0, max(self.info.hidden_size, 1))
        routing = torch.empty(0, 1, dtype=torch.int32)
        hop = self.submit(self.shard.layers[0] if self.shard.layers else 0, empty, None, routing, routing.float())
        try:
            self._reply(hop)
            return ""
        except (HopFailed, ExpertRequestError) as e:
            self._close_link_locked()
            return e.reason if isinstance(e, ExpertRequestError) else str(e)

    def _link_ended(self, link: Link, error: str) -> None:
        self.mark_unhealthy(link, error)

    def _close_link_locked(self) -> None:
        conn = self._conn
        if conn.link is not None:
            conn.link.close()
        conn.link = None
        self._abandoned.clear()  # their link is closed: nothing more to read


def _one_line(e: Exception) -> str:
    if isinstance(e, grpc.RpcError):
        return f"{e.code().name}: {e.details()}"
    return str(e).splitlines()[0] if str(e) else type(e).__name__
