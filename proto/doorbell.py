"""The co-located fast path: fixed hop headers on a Unix socket, the tensors in shared-memory slots.

A gRPC message per hop costs ~0.2-0.5 ms in Python (protobuf objects, the stream's threads and
queues, HTTP/2 framing); a Unix SOCK_SEQPACKET round trip costs one send and one receive on each
side. So when the attention and expert services share a host, the expert service listens on a
Unix socket (advertised as `ShardInfo.doorbell`) and each attention connection:

- first proves it holds the cluster secret: `HELLO` -> the service's challenge (a random nonce)
  -> `PROOF` (HMAC-SHA256 of the nonce under the secret) -> `REPLY`; the service maps nothing
  for a connection that has not, and only regions its peer created (proto/shm.py: the peer's
  pid in the name, owned by the peer's uid as SO_PEERCRED reports it, no symlink);
- owns `NUM_SLOTS` shared-memory regions ("slots", one per hop in flight), created and unlinked
  by the attention side and mapped by the expert side on first use;
- writes a hop's hidden states, expert ids and weights straight into a slot, at offsets both
  sides compute from the header (`slot_layout`), and sends a `REQUEST` header (32 bytes, plus
  the slot's region size and name when the slot is new or has grown, plus an optional W3C
  traceparent);
- gets back a `REPLY` header (40 bytes, plus an error message when status is not OK) once the
  service wrote its output into the slot's output area.

A hop some of whose rows use LoRA adapters is a `KIND_FORWARD_LORA` request: the same header and
tail, then the adapters (`adapters_message`: each one's name, path and identity; a few hundred
bytes), and in the slot, after the output area, each row's adapter (`lora_rows_view`: int32 [T],
an index into that list, -1 for the base). The C++ loop serves `KIND_FORWARD` only: it hands these
to Python, which loads the adapters (expert_service/adapters.py) and applies them.

Replies come in request order. The socket is also the failure detector: a dead service is an
EOF or ECONNRESET at once, a hung one a receive timeout. gRPC keeps setup, control (LoadShard,
GetStats, health) and the cross-host path.
"""
from __future__ import annotations

import functools
import hashlib
import hmac
import socket
import struct
from dataclasses import dataclass

import torch

from splitmoe.proto import codec, expert_pb2
from splitmoe.proto.shm import Peer, ShmRegion, align_up, tensor_nbytes

VERSION = 2
MAGIC = b"SMDB"
NUM_SLOTS = 2              # hops in flight per connection: two micro-batches
MAX_MESSAGE_BYTES = 4096   # a header plus a region announcement and a traceparent, or an error message
NONCE_BYTES = 32

KIND_HELLO = 1
KIND_FORWARD = 2
KIND_PROOF = 3
KIND_FORWARD_LORA = 4  # a hop with LoRA rows (see the module docstring); answered as a KIND_FORWARD
STATUS_OK = 0
STATUS_ERROR = 1

# kind, 0, version, magic (client -> service, first message); answered with a REPLY (seq = version)
# followed by the challenge: NONCE_BYTES random bytes
HELLO = struct.Struct("<BxH4s")
# kind, 0, 0, 0, HMAC-SHA256(cluster secret, PROOF_LABEL + challenge) (client -> service, second
# message); answered with a REPLY (kind PROOF), or an error REPLY and a hang-up
PROOF = struct.Struct("<B3x32s")
PROOF_LABEL = b"splitmoe-doorbell-v2:"
# kind, hidden dtype (splitmoe.v1.DType), slot, layer, tokens, top_k, hidden size, seq,
# region announcement length, traceparent length; the announcement (`REGION_SIZE`, then the
# region's name) and the traceparent follow, in that order
REQUEST = struct.Struct("<BBHiIIIQHH")
REGION_SIZE = struct.Struct("<Q")
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


def lora_slot_bytes(num_tokens: int, top_k: int, hidden_size: int, dtype: torch.dtype) -> int:
    """A slot's size for a hop with LoRA rows: `slot_layout`'s, then each row's adapter (int32 [T])."""
    return slot_layout(num_tokens, top_k, hidden_size, dtype).num_bytes + align_up(num_tokens * 4)


def lora_rows_view(region: ShmRegion, num_tokens: int, top_k: int, hidden_size: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """Each row's adapter in a KIND_FORWARD_LORA hop's slot: int32 [T], an index into the request's
    adapters, -1 for the base (after the output area: the C++ loop's offsets stay as they are)."""
    offset = slot_layout(num_tokens, top_k, hidden_size, dtype).num_bytes
    return region.view(offset, (num_tokens,), torch.int32)


def adapters_message(adapters: list[tuple[str, str, str]]) -> bytes:
    """The adapters of a KIND_FORWARD_LORA request, (name, path, identity) each: an ExpertRequest
    holding only `lora`, whose rows are in the slot instead."""
    request = expert_pb2.ExpertRequest(lora=[expert_pb2.LoraRows(name=n, path=p, identity=i) for n, p, i in adapters])
    return request.SerializeToString()


def parse_adapters(data: bytes) -> list[tuple[str, str, str]]:
    request = expert_pb2.ExpertRequest.FromString(bytes(data))
    return [(entry.name, entry.path, entry.identity) for entry in request.lora]


class SlotTooSmall(ValueError):
    """A hop's tensors do not fit its slot's region (the attention side then grows the region)."""


class SlotViews:
    """One hop shape's tensors over a slot's region, at `slot_layout`'s offsets (no copy)."""

    __slots__ = ("hidden", "expert_ids", "expert_weights", "output", "wire_dtype", "input_bytes")

    def __init__(self, region: ShmRegion, num_tokens: int, top_k: int, hidden_size: int, dtype: torch.dtype):
        layout = slot_layout(num_tokens, top_k, hidden_size, dtype)
        if layout.num_bytes > region.num_bytes:
            raise SlotTooSmall(f"shared memory {region.name}: bytes 0..{layout.num_bytes} outside the region "
                               f"({region.num_bytes} bytes)")
        self.hidden = region.view(layout.hidden, (num_tokens, hidden_size), dtype)
        self.expert_ids = region.view(layout.expert_ids, (num_tokens, top_k), torch.int32)
        self.expert_weights = region.view(layout.expert_weights, (num_tokens, top_k), torch.float32)
        self.output = region.view(layout.output, (num_tokens, hidden_size), dtype)
        self.wire_dtype = codec.proto_dtype(dtype)
        self.input_bytes = num_tokens * (hidden_size * dtype.itemsize + top_k * 8)  # ids and weights: 4 bytes each


class Slot:
    """One slot's region, mapped on either side, with its tensor views made once per hop shape."""

    MAX_SHAPES = 64  # a few shapes recur (decode sizes); prefill lengths vary

    def __init__(self, region: ShmRegion):
        self.region = region
        self._views: dict[tuple, SlotViews] = {}

    def views(self, num_tokens: int, top_k: int, hidden_size: int, dtype: torch.dtype) -> SlotViews:
        """SlotTooSmall when the hop does not fit the region."""
        key = (num_tokens, top_k, hidden_size, dtype)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= self.MAX_SHAPES:
                self._views.clear()
            views = self._views[key] = SlotViews(self.region, num_tokens, top_k, hidden_size, dtype)
        return views

    def close(self) -> None:
        self._views.clear()  # before the region: a view left alive keeps its mapping
        self.region.close()


def proof(token: str, challenge: bytes) -> bytes:
    """What a client sends to show it holds the cluster secret, without sending the secret."""
    return hmac.new(token.encode(), PROOF_LABEL + challenge, hashlib.sha256).digest()


def announcement(region_name: str, num_bytes: int) -> bytes:
    """A slot's new region, as a REQUEST carries it: its size, then its name."""
    return REGION_SIZE.pack(num_bytes) + region_name.encode()


def parse_announcement(data: bytes) -> tuple[str, int]:
    """(region name, size in bytes) of an announcement."""
    if len(data) <= REGION_SIZE.size:
        raise ValueError("a region announcement without a name")
    return bytes(data[REGION_SIZE.size:]).decode(errors="replace"), REGION_SIZE.unpack_from(data)[0]


def peer_of(sock: socket.socket) -> Peer:
    """Who is at the other end of a Unix socket, as the kernel saw it connect (SO_PEERCRED)."""
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return Peer(pid, uid)


def socket_address(doorbell: str) -> str:
    """'@name' (Linux abstract namespace: gone with the process, no file left behind) or a path."""
    return "\0" + doorbell[1:] if doorbell.startswith("@") else doorbell


def new_socket() -> socket.socket:
    return socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
