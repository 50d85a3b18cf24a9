"""The expert service's gRPC surface and wiring: ExpertService, the standard grpc.health.v1 service,
and the hops' two front-ends over one handler (expert_service/hops.py).

Control (DescribeShard, LoadShard, GetStats, PrepareLora) is answered here. Hops arrive on the Forward stream
(expert_service/forward_stream.py) or, from attention services on the same host, on the
shared-memory doorbell (expert_service/doorbell.py), advertised in ShardInfo: the same hops
without a gRPC message each.
"""
from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from concurrent import futures
from typing import Iterator

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from splitmoe.expert_service.adapters import AdapterError, ExpertAdapters
from splitmoe.expert_service.doorbell import DoorbellServer
from splitmoe.expert_service.forward_stream import ForwardFrontEnd
from splitmoe.expert_service.hops import HopHandler
from splitmoe.expert_service.settings import ExpertServiceSettings
from splitmoe.expert_service.shard import HostedShard, ShardDescription
from splitmoe.kernels.expert_kernels import format_ranges
from splitmoe.modelfile.gguf_parts import model_stem
from splitmoe.modelfile.lora_adapter import AdapterRef
from splitmoe.proto import expert_pb2, expert_pb2_grpc
from splitmoe.runtime.memory import resident

log = logging.getLogger(__name__)
SERVICE_NAME = "splitmoe.v1.ExpertService"
_DRAIN_POLL_S = 0.05


class ExpertServicer(expert_pb2_grpc.ExpertServiceServicer):
    def __init__(self, hosted: HostedShard, forward: ForwardFrontEnd, adapters: ExpertAdapters, doorbell: str = ""):
        self.hosted = hosted
        self.adapters = adapters
        self.doorbell = doorbell  # the doorbell's address, advertised in ShardInfo
        self._forward = forward
        self._hostname = socket.gethostname()
        self._file_id = hosted.g.file_id
        self.instance_id = secrets.token_hex(8)  # this process: see ShardInfo.instance_id
        self.draining = False  # told to stop: see ExpertServer.drain

    def DescribeShard(self, request: expert_pb2.DescribeShardRequest, context) -> expert_pb2.ShardInfo:
        return self._shard_info(self.hosted.describe())

    def LoadShard(self, request: expert_pb2.LoadShardRequest, context) -> expert_pb2.ShardInfo:
        try:
            by_layer = {entry.layer: tuple(entry.experts) for entry in request.by_layer}
            described = self.hosted.load(request.layers, request.experts, by_layer or None)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        log.info("loaded shard: %s; memory: %s", describe_shard(described), memory_line())
        return self._shard_info(described)

    def GetStats(self, request: expert_pb2.StatsRequest, context) -> expert_pb2.ExpertStats:
        counts = self.hosted.token_counts()
        totals = self.hosted.totals()
        return expert_pb2.ExpertStats(
            layers=[k.layer for k in counts], experts=[k.expert for k in counts], tokens=list(counts.values()),
            num_requests=totals.num_requests, compute_s_total=totals.compute_s)

    def PrepareLora(self, request: expert_pb2.PrepareLoraRequest, context) -> expert_pb2.PrepareLoraResponse:
        try:
            layers = self.adapters.layers(AdapterRef(request.name, request.path, request.identity))
        except AdapterError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        log.info("LoRA adapter %s ready: %s, %d expert layers", request.name, request.path, len(layers))
        return expert_pb2.PrepareLoraResponse(layers=sorted(layers))

    def Forward(self, request_iterator: Iterator[expert_pb2.ExpertRequest], context) -> Iterator[expert_pb2.ExpertResponse]:
        return self._forward.serve(request_iterator, context)

    def _shard_info(self, described: ShardDescription) -> expert_pb2.ShardInfo:
        g = self.hosted.g
        return expert_pb2.ShardInfo(
            model_name=str(g.get("general.name", model_stem(g.path))), arch=g.arch, file_id=self._file_id,
            layers=described.layers, experts=described.experts, hidden_size=self.hosted.hidden_size,
            num_bytes=described.num_bytes, hostname=self._hostname, num_threads=torch.get_num_threads(),
            doorbell=self.doorbell, instance_id=self.instance_id, draining=self.draining,
            by_layer=[expert_pb2.LayerExperts(layer=layer, experts=es) for layer, es in described.by_layer])


def memory_line() -> str:
    """The process's memory: the shard's blocks are mapped file pages, touched as they are used."""
    now = resident()
    return now.describe() if now else "not reported on this system"


def describe_shard(described: ShardDescription) -> str:
    if not described.layers:
        return "no experts (waiting for LoadShard)"
    num_pairs = sum(len(es) for _, es in described.by_layer)
    if num_pairs != len(described.layers) * len(described.experts):  # a placement by load
        return f"{num_pairs} (layer, expert) pairs over {format_ranges('layers', described.layers)}, {described.num_bytes} bytes"
    return (f"{format_ranges('layers', described.layers)}, {format_ranges('experts', described.experts)}, "
            f"{described.num_bytes} bytes")


class ExpertServer:
    """The running gRPC server: ExpertService and health, on one port, until stopped."""

    def __init__(self, settings: ExpertServiceSettings, hosted: HostedShard):
        self.settings = settings
        self.hops = HopHandler(hosted)
        self.doorbell = DoorbellServer(self.hops, settings.security.token) if settings.doorbell else None
        self.servicer = ExpertServicer(hosted, ForwardFrontEnd(self.hops), self.hops.adapters,
                                       self.doorbell.address if self.doorbell is not None else "")
        self.health = health.HealthServicer()
        options = [("grpc.max_send_message_length", settings.max_message_bytes),
                   ("grpc.max_receive_message_length", settings.max_message_bytes),
                   ("grpc.so_reuseport", 0),  # a second server on our port must fail, not share it
                   # The attention side pings every half second to find a silent host fast
                   # (ConnectionSettings.keepalive_s); gRPC's defaults would answer that with GOAWAY.
                   ("grpc.http2.min_ping_interval_without_data_ms", 100), ("grpc.http2.max_ping_strikes", 0)]
        self._server = grpc.server(futures.ThreadPoolExecutor(settings.max_workers, thread_name_prefix="expert-rpc"),
                                   options=options, interceptors=settings.security.server_interceptors())
        expert_pb2_grpc.add_ExpertServiceServicer_to_server(self.servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)

    def start(self) -> int:
        """Bind and serve; returns the bound port."""
        port = self.settings.security.add_port(self._server, self.settings.address)
        if port == 0:
            raise OSError(f"expert service: cannot listen on {self.settings.address}")
        security = self.settings.security
        log.log(logging.INFO if security.token else logging.WARNING, "expert service on %s: %s",
                self.settings.address, security.describe_server())
        self._server.start()
        if self.doorbell is not None:
            self.doorbell.start()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return port

    def drain(self, timeout_s: float, give_up: threading.Event | None = None) -> bool:
        """Before `stop`: say we are leaving (ShardInfo.draining, health NOT_SERVING, so that
        Kubernetes takes the pod out of its Service) and keep answering hops until every attention
        service has moved our experts elsewhere and closed its links to us, or until `timeout_s`.
        True when they all left in time; `give_up` set (a second signal) ends the wait early."""
        self.servicer.draining = True
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        deadline_s = time.monotonic() + timeout_s
        while self.hops.num_lanes():
            if time.monotonic() >= deadline_s:
                log.warning("drain: %d attention link(s) still open after %g s; stopping anyway",
                            self.hops.num_lanes(), timeout_s)
                return False
            if give_up is not None and give_up.wait(_DRAIN_POLL_S):
                return False
            if give_up is None:
                time.sleep(_DRAIN_POLL_S)
        return True

    def stop(self) -> None:
        """Report NOT_SERVING, let requests being computed finish (within the grace period), then
        close the idle streams at once, so their clients fail over instead of waiting out the grace."""
        self.health.enter_graceful_shutdown()
        self._server.stop(self.settings.shutdown_grace_s)  # refuses new calls from now on
        if self.doorbell is not None:
            self.doorbell.stop_accepting()
        self.hops.wait_idle(self.settings.shutdown_grace_s)  # both front-ends' hops
        if self.doorbell is not None:
            self.doorbell.close_connections()
        self._server.stop(0).wait()
