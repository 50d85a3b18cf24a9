"""The expert service's gRPC surface: ExpertService plus the standard grpc.health.v1 service.

Forward is one long-lived bidirectional stream per attention connection: one request per MoE
layer per step, answered in order. A bad request is answered in-band (`error`), so one
malformed message never tears down the stream the next layer needs. Attention services on the
same host use the shared-memory doorbell instead (expert_service/doorbell.py), advertised in
ShardInfo: the same hops without a gRPC message each.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent import futures
from typing import Iterator

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry import trace

from splitmoe.expert_service.doorbell import DoorbellServer
from splitmoe.expert_service.settings import ExpertServiceSettings
from splitmoe.expert_service.shard import HostedShard, ShardDescription
from splitmoe.kernels import native
from splitmoe.modelfile.experts import format_ranges
from splitmoe.proto import codec, expert_pb2, expert_pb2_grpc
from splitmoe.runtime.telemetry import extract_grpc_context, tracer

log = logging.getLogger(__name__)
_tracer = tracer(__name__)
SERVICE_NAME = "splitmoe.v1.ExpertService"


class ExpertServicer(expert_pb2_grpc.ExpertServiceServicer):
    def __init__(self, hosted: HostedShard, doorbell: str = ""):
        self.hosted = hosted
        self.doorbell = doorbell  # the doorbell's address, advertised in ShardInfo
        self._hostname = socket.gethostname()
        self._file_id = hosted.g.file_id
        self._num_busy = 0  # requests being computed, for the shutdown drain
        self._idle = threading.Condition()

    def busy(self, delta: int) -> None:
        """+1 when a request starts computing, -1 when it is done."""
        with self._idle:
            self._num_busy += delta
            if not self._num_busy:
                self._idle.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Until no request is being computed (streams may stay open), or the timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._num_busy == 0, timeout_s)

    def DescribeShard(self, request: expert_pb2.DescribeShardRequest, context) -> expert_pb2.ShardInfo:
        return self._shard_info(self.hosted.describe())

    def LoadShard(self, request: expert_pb2.LoadShardRequest, context) -> expert_pb2.ShardInfo:
        try:
            described = self.hosted.load(request.layers, request.experts)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        log.info("loaded shard: %s", describe_shard(described))
        return self._shard_info(described)

    def GetStats(self, request: expert_pb2.StatsRequest, context) -> expert_pb2.ExpertStats:
        counts = self.hosted.token_counts()
        totals = self.hosted.totals()
        return expert_pb2.ExpertStats(
            layers=[k.layer for k in counts], experts=[k.expert for k in counts], tokens=list(counts.values()),
            num_requests=totals.num_requests, compute_s_total=totals.compute_s)

    def Forward(self, request_iterator: Iterator[expert_pb2.ExpertRequest], context) -> Iterator[expert_pb2.ExpertResponse]:
        stream_context = extract_grpc_context(context.invocation_metadata())
        for request in request_iterator:
            answer = self._answer(request, stream_context)
            native.park()  # the attention side computes until the next hop: leave it the cores
            yield answer

    def _answer(self, request: expert_pb2.ExpertRequest, stream_context) -> expert_pb2.ExpertResponse:
        self.busy(1)
        try:
            return self._answer_traced(request, stream_context)
        finally:
            self.busy(-1)

    def _answer_traced(self, request: expert_pb2.ExpertRequest, stream_context) -> expert_pb2.ExpertResponse:
        parent = extract_grpc_context(request.trace_context.items()) if request.trace_context else stream_context
        if not trace.get_current_span(parent).get_span_context().is_valid:
            # No caller trace to join: a root span per layer call would be noise, and costs ~50 us.
            return self._answer_in_band(request)
        with _tracer.start_as_current_span("expert.forward", context=parent,
                                           attributes={"splitmoe.layer": request.layer}):
            return self._answer_in_band(request)

    def _answer_in_band(self, request: expert_pb2.ExpertRequest) -> expert_pb2.ExpertResponse:
        try:
            return self._compute(request)
        # Whatever one request does wrong, the stream must survive for the next layer.
        except Exception as e:  # noqa: BLE001
            trace.get_current_span().record_exception(e)
            log.warning("forward layer %d: %s", request.layer, e)
            return expert_pb2.ExpertResponse(step_id=request.step_id, layer=request.layer,
                                             error=f"{type(e).__name__}: {e}")

    def _compute(self, request: expert_pb2.ExpertRequest) -> expert_pb2.ExpertResponse:
        hidden = codec.decode(request.hidden)
        expert_ids = codec.decode(request.expert_ids)
        expert_weights = codec.decode(request.expert_weights)
        out, compute_s = self.hosted.forward(request.layer, hidden, expert_ids, expert_weights)
        response = expert_pb2.ExpertResponse(step_id=request.step_id, layer=request.layer, compute_s=compute_s)
        codec.encode(out, response.output)
        return response

    def _shard_info(self, described: ShardDescription) -> expert_pb2.ShardInfo:
        g = self.hosted.g
        return expert_pb2.ShardInfo(
            model_name=str(g.get("general.name", g.path.stem)), arch=g.arch, file_id=self._file_id,
            layers=described.layers, experts=described.experts, hidden_size=self.hosted.hidden_size,
            num_bytes=described.num_bytes, hostname=self._hostname, num_threads=torch.get_num_threads(),
            doorbell=self.doorbell)


def describe_shard(described: ShardDescription) -> str:
    if not described.layers:
        return "no experts (waiting for LoadShard)"
    return (f"{format_ranges('layers', described.layers)}, {format_ranges('experts', described.experts)}, "
            f"{described.num_bytes} bytes")


class ExpertServer:
    """The running gRPC server: ExpertService and health, on one port, until stopped."""

    def __init__(self, settings: ExpertServiceSettings, hosted: HostedShard):
        self.settings = settings
        self.servicer = ExpertServicer(hosted)
        self.doorbell = DoorbellServer(hosted, settings.security.token) if settings.doorbell else None
        if self.doorbell is not None:
            self.servicer.doorbell = self.doorbell.address
        self.health = health.HealthServicer()
        options = [("grpc.max_send_message_length", settings.max_message_bytes),
                   ("grpc.max_receive_message_length", settings.max_message_bytes),
                   ("grpc.so_reuseport", 0)]  # a second server on our port must fail, not share it
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

    def stop(self) -> None:
        """Report NOT_SERVING, let requests being computed finish (within the grace period), then
        close the idle streams at once, so their clients fail over instead of waiting out the grace."""
        self.health.enter_graceful_shutdown()
        self._server.stop(self.settings.shutdown_grace_s)  # refuses new calls from now on
        if self.doorbell is not None:
            self.doorbell.stop_accepting()
        deadline_s = time.monotonic() + self.settings.shutdown_grace_s
        self.servicer.wait_idle(self.settings.shutdown_grace_s)
        if self.doorbell is not None:
            self.doorbell.wait_idle(max(deadline_s - time.monotonic(), 0.0))
            self.doorbell.close_connections()
        self._server.stop(0).wait()
