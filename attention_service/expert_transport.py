"""How one hop's tensors travel to an expert service: bytes in the message, or shared memory.

A payload fills an `ExpertRequest` (splitmoe.v1) with a layer part's tensors and reads the
output back from the `ExpertResponse`; the stream and the deadlines are the client's business.
"""
from __future__ import annotations

from typing import Union

import torch

from proto import codec
from proto.shm import ShmArena, align_up, tensor_nbytes


class GrpcPayload:
    """Tensors as bytes inside the gRPC messages."""

    name = "grpc"

    def fill(self, request, hidden: torch.Tensor, rows: torch.Tensor | None,
             expert_ids: torch.Tensor, expert_weights: torch.Tensor) -> int:
        codec.encode(hidden if rows is None else hidden.index_select(0, rows), request.hidden)
        codec.encode(expert_ids, request.expert_ids)
        codec.encode(expert_weights if rows is None else expert_weights.index_select(0, rows), request.expert_weights)
        return len(request.hidden.data) + len(request.expert_ids.data) + len(request.expert_weights.data)

    def output(self, response) -> torch.Tensor:
        return codec.decode(response.output)

    def close(self) -> None:
        pass


class ShmPayload:
    """Tensors in a shared-memory region both processes map; the messages carry offsets only.

    Rows are gathered straight into the region, and the service writes its output into a slot
    of the same region, so a hop copies each tensor once. The output view is valid until the
    next hop on this connection.
    """

    name = "shm"

    def __init__(self, initial_bytes: int):
        self._arena = ShmArena(initial_bytes)
        self._output: torch.Tensor | None = None

    def fill(self, request, hidden: torch.Tensor, rows: torch.Tensor | None,
             expert_ids: torch.Tensor, expert_weights: torch.Tensor) -> int:
        num_tokens, hidden_size = expert_ids.shape[0], hidden.shape[1]
        hidden_shape, routing_shape = (num_tokens, hidden_size), tuple(expert_ids.shape)
        self._arena.reset(2 * align_up(tensor_nbytes(hidden_shape, hidden.dtype))
                          + align_up(tensor_nbytes(routing_shape, torch.int32))
                          + align_up(tensor_nbytes(routing_shape, torch.float32)))
        self._put(request.hidden, hidden, rows, hidden_shape)
        self._put(request.expert_ids, expert_ids, None, routing_shape, torch.int32)
        self._put(request.expert_weights, expert_weights, rows, routing_shape, torch.float32)
        self._output = self._slot(request.output_shm, hidden_shape, hidden.dtype)
        return sum(t.shm.num_bytes for t in (request.hidden, request.expert_ids, request.expert_weights))

    def output(self, response) -> torch.Tensor:
        return self._output

    def close(self) -> None:
        self._output = None
        self._arena.close()

    def _put(self, msg, source: torch.Tensor, rows: torch.Tensor | None, shape: tuple[int, ...],
             dtype: torch.dtype | None = None) -> None:
        view = self._slot(msg, shape, dtype or source.dtype)
        if rows is None:
            view.copy_(source)
        else:
            torch.index_select(source.to(view.dtype), 0, rows, out=view)

    def _slot(self, msg, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        view, offset_bytes = self._arena.alloc(shape, dtype)
        codec.encode_shm(shape, dtype, self._arena.name, offset_bytes, out=msg)
        return view


Payload = Union[GrpcPayload, ShmPayload]
