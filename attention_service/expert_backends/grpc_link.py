"""The gRPC link (shm_link.py has the Link protocol): tensors as bytes inside the messages of one long-lived Forward stream."""
from __future__ import annotations

import collections
import itertools
import queue
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Callable

import grpc
import torch

from splitmoe.attention_service.expert_backends.shm_link import HopFailed, HopLora, Reply, spans_exported
from splitmoe.proto import codec, expert_pb2, expert_pb2_grpc
from splitmoe.runtime.telemetry import inject_grpc_metadata

_END_OF_REQUESTS = object()


class ForwardStream:
    """An open Forward call: requests go out in order, responses come back in order."""

    def __init__(self, stub: expert_pb2_grpc.ExpertServiceStub, on_end: Callable[[str], None]):
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: collections.deque[futures.Future] = collections.deque()
        self._end_error: str | None = None
        self._on_end = on_end
        self._call = stub.Forward(iter(self._requests.get, _END_OF_REQUESTS), metadata=inject_grpc_metadata())
        threading.Thread(target=self._read_responses, name="expert-stream-reader", daemon=True).start()

    def submit(self, request: expert_pb2.ExpertRequest) -> futures.Future:
        """A future of (response, its arrival, the previous response's arrival), perf_counter seconds."""
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
        previous_s = 0.0
        try:
            for response in self._call:
                arrived_s = time.perf_counter()
                self._pending.popleft().set_result((response, arrived_s, previous_s))
                previous_s = arrived_s
            error = "the service ended the stream"
        except grpc.RpcError as e:
            error = f"{e.code().name}: {e.details()}"
        except IndexError:
            error = "the service answered a request that was never sent"
        self._end_error = error  # set before draining: see submit
        while self._pending:
            _fail(self._pending.popleft(), error)
        self._on_end(error)


def _fail(future: futures.Future, error: str) -> None:
    if not future.done():
        try:
            future.set_exception(HopFailed(error))
        except futures.InvalidStateError:
            pass  # the other side of the race failed it first


@dataclass(slots=True)
class GrpcTicket:
    future: futures.Future
    step_id: int
    start_s: float   # perf_counter when submit began


class GrpcLink:
    """Tensors as bytes inside the messages of one Forward stream."""

    name = "grpc"

    def __init__(self, stub: expert_pb2_grpc.ExpertServiceStub, on_end: Callable[["GrpcLink", str], None]):
        self._step_ids = itertools.count(1)
        self._stream = ForwardStream(stub, lambda error: on_end(self, error))

    def submit(self, layer: int, hidden: torch.Tensor, rows: torch.Tensor | None, expert_ids: torch.Tensor,
               expert_weights: torch.Tensor, lora: HopLora | None = None) -> tuple[GrpcTicket, int]:
        """(the hop's ticket, tensor bytes sent)."""
        start_s = time.perf_counter()
        step_id = next(self._step_ids)
        request = expert_pb2.ExpertRequest(step_id=step_id, layer=layer)
        if spans_exported():
            request.trace_context.update(inject_grpc_metadata())
        codec.encode(hidden if rows is None else hidden.index_select(0, rows), request.hidden)
        codec.encode(expert_ids.to(torch.int32), request.expert_ids)
        codec.encode(expert_weights if rows is None else expert_weights.index_select(0, rows), request.expert_weights)
        for ref, lora_rows in lora or ():
            request.lora.add(name=ref.name, path=ref.path, identity=ref.identity, rows=lora_rows.tolist())
        sent_bytes = len(request.hidden.data) + len(request.expert_ids.data) + len(request.expert_weights.data)
        return GrpcTicket(self._stream.submit(request), step_id, start_s), sent_bytes

    def wait(self, ticket: GrpcTicket, deadline_s: float, timeout_s: float) -> Reply:
        """deadline_s: perf_counter seconds; timeout_s: for the message only."""
        reply = self.poll(ticket, deadline_s)
        if reply is None:
            raise HopFailed(f"no answer within expert_timeout_s={timeout_s:g}")
        return reply

    def poll(self, ticket: GrpcTicket, until_s: float) -> Reply | None:
        try:
            response, arrived_s, previous_s = ticket.future.result(timeout=max(until_s - time.perf_counter(), 0.0))
        except futures.TimeoutError:
            return None
        if response.step_id != ticket.step_id:
            raise HopFailed(f"answer to request {response.step_id} while waiting for {ticket.step_id}")
        # A request sent while the service still worked on the previous one waited for it: only
        # the time after the previous answer is this hop's (an estimate: one-way latency is lost).
        overhead_s = max(arrived_s - max(ticket.start_s, previous_s) - response.compute_s, 0.0)
        hop_s = arrived_s - ticket.start_s
        if response.error:
            return Reply(None, response.error, response.compute_s, overhead_s, hop_s)
        return Reply(codec.decode(response.output), "", response.compute_s, overhead_s, hop_s)

    def close(self) -> None:
        self._stream.close()
