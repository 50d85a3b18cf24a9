"""A decode layer and its hop in one native call (csrc/direct_hop.cpp), where one co-located expert
service computes every expert of the layer: the attention front, the router, the hop over the
shared-memory doorbell and the residual add, without the layer call's Python (layer_call.py:
planning, the link's tickets, the parts' sum), ~110 µs a layer around a ~400 µs hop.

`RemoteExperts.direct_hop` hands out a `DirectHop` only when that is exactly what the usual path
would do: the layer's experts all on one healthy, unlagging service (no local layer, no hot
experts), its shared-memory link idle with a slot the service already knows, no span to carry. It
holds the data path's lock and the service client's until `finish`: no placement change falls
between, and no other thread closes the link (its socket, its regions) under the native call. What the hop
finds wrong is reported, not handled, by the native call: the front has run, so `RemoteMoELayer`
marks the service unhealthy and sends the layer's experts again by the usual path, which fails
over to a replica or raises, as any failed hop does.
"""
from __future__ import annotations

import ctypes
import errno
import os
import threading

import torch

from splitmoe.attention_service.expert_backends.service_client import ExpertRequestError, ExpertServiceClient
from splitmoe.attention_service.expert_backends.services import ExpertServices, ServicePart
from splitmoe.attention_service.expert_backends.shm_link import ShmLink
from splitmoe.kernels import native
from splitmoe.kernels.decode_layer import AttentionFront, DecodeStep
from splitmoe.kernels.decode_moe_layer import Router
from splitmoe.proto import codec, doorbell

_P = ctypes.c_void_p
_I64, _U64, _I32 = ctypes.c_int64, ctypes.c_uint64, ctypes.c_int32
_WIRE_BF16 = codec.proto_dtype(torch.bfloat16)
_ERROR_BYTES = doorbell.MAX_MESSAGE_BYTES


class _HopTarget(ctypes.Structure):  # csrc/direct_hop.cpp SmkHopTarget
    _fields_ = [("fd", _I32), ("slot", _I32), ("region", _P), ("region_bytes", _I64), ("hidden_at", _I64),
                ("ids_at", _I64), ("weights_at", _I64), ("output_at", _I64), ("layer", _I32), ("wire_dtype", _I32),
                ("seq", _U64), ("counts", _P)]


class _HopResult(ctypes.Structure):  # csrc/direct_hop.cpp SmkHopResult
    _fields_ = [("start_ns", _U64), ("sent_ns", _U64), ("submitted_ns", _U64), ("wait_ns", _U64),
                ("observed_ns", _U64), ("service_start_ns", _U64), ("service_end_ns", _U64), ("compute_ns", _U64),
                ("error_bytes", _I32), ("failed_errno", _I32)]


class DirectHop:
    """One layer's hop target, with the data path's lock and the service's link held (module doc)
    until `finish`."""

    __slots__ = ("services", "service", "client", "link", "lock", "target", "num_rows", "hidden_bytes")

    def __init__(self, services: ExpertServices, service: int, client: ExpertServiceClient, link: ShmLink,
                 lock: threading.Lock, layer: int, slot: int, region, layout: doorbell.SlotLayout,
                 counts: torch.Tensor, num_rows: int, hidden_bytes: int):
        self.services, self.service, self.client, self.link, self.lock = services, service, client, link, lock
        self.num_rows, self.hidden_bytes = num_rows, hidden_bytes
        self.target = _HopTarget(link.fileno, slot, region.address, region.num_bytes, layout.hidden,
                                 layout.expert_ids, layout.expert_weights, layout.output, layer, _WIRE_BF16,
                                 link.next_seq, counts.data_ptr())

    def finish(self, rc: int, result: _HopResult, ids: torch.Tensor) -> None:
        """Book the native call's outcome (`rc`: csrc/direct_hop.cpp's) as the usual path books a
        hop, and let go of the link and the data path."""
        try:
            if rc in (0, 2):
                self._answered(result, ids)
        finally:
            self.client.release_link()
        try:
            if rc == 1:
                self._failed(result)
        finally:
            self.lock.release()

    def _answered(self, result: _HopResult, ids: torch.Tensor) -> None:
        reply = self.link.answered_directly(self.target.seq, result.start_ns, result.sent_ns, result.submitted_ns,
                                            result.wait_ns, result.observed_ns, result.service_end_ns,
                                            result.compute_ns)
        routing_bytes = ids.numel() * 8  # int32 ids and float32 weights
        self.client.count(reply, self.hidden_bytes + routing_bytes, self.hidden_bytes, self.num_rows)
        self.services.meter.add([ServicePart(self.service, None, ids)])

    def _failed(self, result: _HopResult) -> None:
        """No answer: the service is unhealthy, as a failed hop on the usual path makes it."""
        if result.failed_errno in (errno.EAGAIN, errno.EWOULDBLOCK):
            why = f"no answer within expert_timeout_s={self.client.settings.expert_timeout_s:g}"
        elif result.failed_errno:
            why = f"doorbell: {os.strerror(result.failed_errno)}"
        else:
            why = "the service closed the connection, or answered another request"
        self.client.mark_unhealthy(self.link, why)


class RemoteMoELayer:
    """One decode layer fused with its hop (module doc): `__call__` returns False where the hop
    cannot be direct now (nothing computed: the caller runs the usual path)."""

    def __init__(self, layer: int, front: AttentionFront, router: Router, experts, max_tokens: int):
        """`experts`: the RemoteExperts backend."""
        self.layer, self.front, self.router, self.experts = layer, front, router, experts
        self.max_tokens = max_tokens
        self._rows = -1
        self._error = ctypes.create_string_buffer(_ERROR_BYTES)

    def _buffers(self, T: int) -> None:
        if self._rows != T:
            K = self.router.top_k
            self._h = torch.empty(T, self.front.hidden_size, dtype=torch.float32)
            self._ids = torch.empty(T, K, dtype=torch.int32)
            self._weights = torch.empty(T, K, dtype=torch.float32)
            self._rows = T

    def __call__(self, step: DecodeStep, x: torch.Tensor) -> bool:
        T, D = step.context.num_rows, self.front.hidden_size
        self.front.check(step, x)
        hop = self.experts.direct_hop(self.layer, T, self.router.top_k, D)
        if hop is None:
            return False
        self._buffers(T)
        result, rc = _HopResult(), -100
        try:
            rc = native._lib.smk_decode_remote_layer(
                ctypes.byref(self.front._struct), ctypes.byref(step._struct), T, D, ctypes.byref(self.router._struct),
                ctypes.byref(hop.target), x.data_ptr(), self._h.data_ptr(), self._ids.data_ptr(),
                self._weights.data_ptr(), ctypes.byref(result), self._error, _ERROR_BYTES)
        finally:
            hop.finish(rc, result, self._ids)
        if rc == 0:
            return True
        if rc == 2:
            raise ExpertRequestError(hop.client.address, self.layer,
                                     self._error.raw[:result.error_bytes].decode(errors="replace") or "unknown error")
        if rc == 1:  # the front ran: the layer's experts by the usual path (a replica, or ExpertsUnavailable)
            x += self.experts.forward(self.layer, self._h.to(torch.bfloat16), self._ids.long(), self._weights)
            return True
        raise ValueError(f"fused remote layer {self.layer}: native kernel refused the call (code {rc})")
