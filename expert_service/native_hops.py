"""The shared-memory hop loop in C++ (expert_service/csrc/hop_server.cpp): what it needs from Python.

`NativeHops` is the process's: the hosted layers the loop may run itself (each one whose hosted
experts all have native kernels), replaced whole when the shard changes, and the counters it adds
to (tokens per expert, hops, compute time). `NativeConnection` is one doorbell connection's: its
slots' regions (mapped and checked by Python) and the loop, which hands every message it does not
serve itself to a Python callback (proto/doorbell.py, expert_service/doorbell.py).
"""
from __future__ import annotations

import ctypes
from typing import Callable, Mapping

import torch

from splitmoe.kernels import native

_P = ctypes.c_void_p


class _HopLayer(ctypes.Structure):
    _fields_ = [("experts", _P), ("index", _P), ("num_experts", ctypes.c_int32), ("D", ctypes.c_int32),
                ("F", ctypes.c_int32), ("max_tokens", ctypes.c_int32)]


class NativeHops:
    """What the C++ loop may serve, and what it counted (added to HostedShard's own counts)."""

    def __init__(self, num_blocks: int, num_experts: int):
        self.tokens = torch.zeros(num_blocks, num_experts, dtype=torch.int64)  # [layer, expert]
        self.totals = torch.zeros(2, dtype=torch.int64)  # hops served, compute ns
        self._server = native._lib.smk_hop_server_new(self.tokens.data_ptr(), num_blocks, num_experts,
                                                      self.totals.data_ptr())
        self._layers: dict = {}  # the FastMoELayers the table points into, kept alive

    def set_layers(self, fast_layers: Mapping[int, object]) -> None:
        """The hosted layers (layer -> kernels.expert_kernels.FastMoELayer); the loop serves those
        whose every hosted expert is native, up to their native token limit, and no others."""
        size = max(fast_layers, default=-1) + 1
        table = (_HopLayer * max(1, size))()
        for layer, fast in fast_layers.items():
            moe = fast.native_layer()
            if moe is None or moe.hidden_size is None:
                continue
            experts, index = moe.pointers()
            table[layer] = _HopLayer(experts, index, moe.num_experts, moe.hidden_size, moe.ffn_size,
                                     fast.native_max_tokens)
        native._lib.smk_hop_server_set_layers(self._server, table, size)  # waits out hops on the old ones
        self._layers = dict(fast_layers)

    def connect(self, fd: int) -> "NativeConnection":
        return NativeConnection(native._lib.smk_hop_conn_new(self._server, fd))

    def close(self) -> None:
        if self._server:
            native._lib.smk_hop_server_free(self._server)
            self._server = None


class NativeConnection:
    def __init__(self, handle: int):
        self._handle = handle

    def set_region(self, slot: int, address: int, num_bytes: int) -> None:
        native._lib.smk_hop_conn_set_region(self._handle, slot, address, num_bytes)

    @property
    def computing(self) -> bool:
        return bool(native._lib.smk_hop_conn_computing(self._handle))

    def serve(self, fallback: Callable[[bytes], int]) -> int:
        """Run the loop until the peer hangs up (0), the socket fails (-errno) or `fallback` (given
        each message the loop does not serve; it answers on the socket itself) returns nonzero."""
        callback = native.HOP_FALLBACK(lambda _ctx, message, length: fallback(ctypes.string_at(message, length)))
        return native._lib.smk_hop_serve(self._handle, callback, None)

    def close(self) -> None:
        if self._handle:
            native._lib.smk_hop_conn_free(self._handle)
            self._handle = None
