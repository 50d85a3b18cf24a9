"""The Forward stream's end of the hop: one long-lived bidirectional stream per attention connection.

One request per MoE layer per step, answered in order, the tensors as bytes inside the messages
(proto/codec.py). A bad request is answered in-band (`error`), so one malformed message never
tears down the stream the next layer needs.
"""
from __future__ import annotations

from typing import Iterator

import torch

from splitmoe.expert_service.adapters import HopLora
from splitmoe.expert_service.hops import HopHandler
from splitmoe.kernels import native
from splitmoe.modelfile.lora_adapter import AdapterRef
from splitmoe.proto import codec, expert_pb2
from splitmoe.runtime.telemetry import extract_grpc_context


class ForwardFrontEnd:
    """Serves every Forward stream: each message a hop, through the one handler."""

    def __init__(self, handler: HopHandler):
        self._handler = handler

    def serve(self, requests: Iterator[expert_pb2.ExpertRequest], context) -> Iterator[expert_pb2.ExpertResponse]:
        stream_parent = extract_grpc_context(context.invocation_metadata())
        with self._handler.lane() as lane:
            for request in requests:
                parent = extract_grpc_context(request.trace_context.items()) if request.trace_context else stream_parent
                hop = _MessageHop(request)
                compute_s, error = self._handler.answer(lane, request.layer, parent, hop)
                response = hop.response if not error else expert_pb2.ExpertResponse(
                    step_id=request.step_id, layer=request.layer, error=error)
                response.compute_s = compute_s
                native.park()  # the attention side computes until the next hop: leave it the cores
                yield response


class _MessageHop:
    """One request message's tensors in, the response message with the output out."""

    __slots__ = ("_request", "response")

    def __init__(self, request: expert_pb2.ExpertRequest):
        self._request = request
        self.response: expert_pb2.ExpertResponse | None = None

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r = self._request
        return codec.decode(r.hidden), codec.decode(r.expert_ids), codec.decode(r.expert_weights)

    def lora(self) -> HopLora:
        return [(AdapterRef(entry.name, entry.path, entry.identity), torch.tensor(entry.rows, dtype=torch.int64))
                for entry in self._request.lora]

    def deliver(self, output: torch.Tensor) -> None:
        self.response = expert_pb2.ExpertResponse(step_id=self._request.step_id, layer=self._request.layer)
        codec.encode(output, self.response.output)
