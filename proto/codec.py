"""torch tensors <-> `splitmoe.v1.Tensor` messages: dtype and shape as fields, then the bytes.

Bytes are row-major little-endian. Encoding makes the one copy protobuf needs (tensor -> bytes);
decoding wraps the message's bytes without copying, so the tensor is read-only by contract.
"""
from __future__ import annotations

import sys
import warnings

import torch

from splitmoe.proto import tensor_pb2
from splitmoe.proto.shm import tensor_nbytes

if sys.byteorder != "little":
    raise ImportError("proto.codec: the wire format is little-endian; big-endian hosts are not supported")

_TO_PROTO = {
    torch.float32: tensor_pb2.DTYPE_FLOAT32,
    torch.bfloat16: tensor_pb2.DTYPE_BFLOAT16,
    torch.float16: tensor_pb2.DTYPE_FLOAT16,
    torch.int32: tensor_pb2.DTYPE_INT32,
    torch.int64: tensor_pb2.DTYPE_INT64,
}
_FROM_PROTO = {v: k for k, v in _TO_PROTO.items()}
# Decoded tensors alias the immutable message bytes and are never written; torch warns about
# that once per process, which says nothing to an operator.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


def proto_dtype(dtype: torch.dtype) -> int:
    try:
        return _TO_PROTO[dtype]
    except KeyError:
        raise ValueError(f"tensor dtype {dtype} has no wire encoding") from None


def torch_dtype(wire_dtype: int) -> torch.dtype:
    try:
        return _FROM_PROTO[wire_dtype]
    except KeyError:
        raise ValueError(f"tensor message has unknown dtype {wire_dtype}") from None


def encode(t: torch.Tensor, out: tensor_pb2.Tensor | None = None) -> tensor_pb2.Tensor:
    """The tensor's bytes inside the message (filled into `out` when given, e.g. a sub-message)."""
    msg = tensor_pb2.Tensor() if out is None else out
    msg.dtype = proto_dtype(t.dtype)
    msg.shape[:] = t.shape
    flat = t.detach().cpu().contiguous().reshape(-1)
    msg.data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return msg


def decode(msg: tensor_pb2.Tensor) -> torch.Tensor:
    dtype = torch_dtype(msg.dtype)
    shape = tuple(msg.shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"tensor message has a negative dimension in shape {list(shape)}")
    num_bytes = tensor_nbytes(shape, dtype)
    data = msg.data
    if len(data) != num_bytes:
        raise ValueError(f"tensor message: {len(data)} bytes for shape {list(shape)} {dtype} ({num_bytes} expected)")
    if num_bytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).view(shape)
