"""The co-located fast path: fixed hop headers on a Unix socket, the tensors in shared-memory slots.

A gRPC message per hop costs ~0.2-0.5 ms in Python (protobuf objects, the stream's threads and
queues, HTTP/2 framing); a Unix SOCK_SEQPACKET round trip costs one send and one receive on each
side. So when the attention and expert services share a host, the expert service listens on a
Unix socket (advertised as `ShardInfo.doorbell`) and each attention connection:

- owns `NUM_SLOTS` shared-memory regions ("slots", one per hop in flight), created and unlinked
  by the attention side and mapped by the expert side on first use;
- writes a hop's hidden states, expert ids and weights straight into a slot, at offsets both
  sides compute from the header (`slot_layout`), and sends a `REQUEST` header (32 bytes, plus
  the slot's region name when the slot is new or has grown, plus an optional W3C traceparent);
- gets back a `REPLY` header (40 bytes, plus an error message when status is not OK) once the
  service wrote its output into the slot's output area.

Replies come in request order. The socket is also the failure detector: a dead service is an
EOF or ECONNRESET at once, a hung one a receive timeout. gRPC keeps setup, control (LoadShard,
GetStats, health) and the cross-host path.
"""
from __future__ import annotations

import functools
import socket
import struct
from dataclasses import dataclass

import torch

from proto.shm import align_up, tensor_nbytes

VERSION = 1
MAGIC = b"SMDB"
NUM_SLOTS = 2              # hops in flight per connection: two micro-batches
MAX_MESSAGE_BYTES = 4096   # a header plus a region name and a traceparent, or an error message

KIND_HELLO = 1
KIND_FORWARD = 2
STATUS_OK = 0
STATUS_ERROR = 1

# kind, 0, version, magic (client -> service, first message); answered with a REPLY (seq = version)
HELLO = struct.Struct("<BxH4s")
# kind, hidden dtype (splitmoe.v1.DType), slot, layer, tokens, top_k, hidden size, seq,
# region name length, traceparent length; the name and the traceparent follow, in that order
REQUEST = struct.Struct("<BBHiIIIQHH")
# kind, status, seq, service clock (CLOCK_MONOTONIC ns) when it picked the request up and when it
# answered, expert compute ns; an error message (utf-8) follows when status is STATUS_ERROR
REPLY = struct.Struct("<BBxxxxxxQQQQ")


@dataclass(frozen=True, slots=True)
class SlotLayout:
    """Byte offsets of one hop's tensors inside a slot: hidden [T, D] (dtype), expert ids [T, K]
    int32, expert weights [T, K] float32, output [T, D] (dtype); each 64-byte aligned."""

    hidden: int
    expert_ids: int
    expert_weights: int
    output: int
    num_bytes: int


@functools.lru_cache(maxsize=256)
def slot_layout(num_tokens: int, top_k: int, hidden_size: int, dtype: torch.dtype) -> SlotLayout:
    hidden_bytes = align_up(tensor_nbytes((num_tokens, hidden_size), dtype))
    routing_bytes = align_up(tensor_nbytes((num_tokens, top_k), torch.int32))
    ids = hidden_bytes
    weights = ids + routing_bytes
    output = weights + routing_bytes
    return SlotLayout(0, ids, weights, output, output + hidden_bytes)


def socket_address(doorbell: str) -> str:
    """'@name' (Linux abstract namespace: gone with the process, no file left behind) or a path."""
    return "\0" + doorbell[1:] if doorbell.startswith("@") else doorbell


def new_socket() -> socket.socket:
    return socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
