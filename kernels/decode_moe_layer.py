"""A whole MoE decode layer as one native call, for experts hosted in this process
(kernels/csrc/decode_moe_layer.cpp): the attention front, the router's choice, the routed experts
and the FFN's residual add, where the per-op path made some twenty torch calls between the front
and the experts (~85 µs a layer on a decode step, a tenth of it).

`Router` is the router's rule (csrc/route.cpp); `route` runs it alone (the tests hold it to
attention_service/model/routing.py). `LocalMoELayer` is one layer's fused call, built once per
layer where the layer qualifies (no shared expert, no grouped selection, a native expert layer).
"""
from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass, field

import torch

from splitmoe.kernels import native
from splitmoe.kernels.decode_layer import AttentionFront, DecodeStep

_P = ctypes.c_void_p


class Gating(enum.IntEnum):
    """How router logits become weights: csrc/route.cpp's `gating` field."""
    SOFTMAX = 0         # softmax over all experts, then the top k
    SIGMOID = 1         # an independent sigmoid per expert (DeepSeek-V3, Llama 4)
    SOFTMAX_WEIGHT = 2  # the top k raw logits, then a softmax over those k (gpt-oss)


class _Routing(ctypes.Structure):
    _fields_ = [("E", ctypes.c_int32), ("K", ctypes.c_int32), ("gating", ctypes.c_int32),
                ("renormalize", ctypes.c_int32), ("scale", ctypes.c_float), ("selection_bias", _P)]


class _LocalExperts(ctypes.Structure):
    _fields_ = [("experts", _P), ("index", _P), ("num_experts", ctypes.c_int32), ("D", ctypes.c_int32),
                ("F", ctypes.c_int32), ("counts", _P), ("round_bf16", ctypes.c_int32)]


@dataclass
class Router:
    """The rule that picks each token's `top_k` of `num_experts` experts and weighs them."""

    num_experts: int
    top_k: int
    gating: Gating
    renormalize: bool
    scale: float = 1.0
    selection_bias: torch.Tensor | None = None  # [E]: added to choose, not to weigh
    _struct: _Routing = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts or not isinstance(self.gating, Gating):
            raise ValueError(f"router: top {self.top_k} of {self.num_experts} experts, gating {self.gating!r}")
        bias = self.selection_bias
        if bias is not None:
            bias = bias.detach().to(device="cpu", dtype=torch.float32).contiguous()
            if bias.shape != (self.num_experts,):
                raise ValueError(f"router: selection bias of shape {tuple(bias.shape)}, want ({self.num_experts},)")
            self.selection_bias = bias
        self._struct = _Routing(self.num_experts, self.top_k, int(self.gating), int(self.renormalize), self.scale,
                                None if bias is None else bias.data_ptr())


def route(router: Router, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int32 [T, K] best first, float32 weights [T, K]) of float32 logits [T, E]."""
    if not native.AVAILABLE:
        raise RuntimeError(f"native kernels unavailable: {native.UNAVAILABLE_REASON}")
    logits = logits.detach().to(device="cpu", dtype=torch.float32).contiguous()
    if logits.dim() != 2 or logits.shape[1] != router.num_experts:
        raise ValueError(f"route: logits of shape {tuple(logits.shape)}, want [T, {router.num_experts}]")
    T = logits.shape[0]
    ids = torch.empty(T, router.top_k, dtype=torch.int32)
    weights = torch.empty(T, router.top_k, dtype=torch.float32)
    rc = native._lib.smk_route(ctypes.byref(router._struct), logits.data_ptr(), T, ids.data_ptr(), weights.data_ptr())
    if rc != 0:
        raise ValueError(f"route: native kernel refused the call (code {rc})")
    return ids, weights


class LocalMoELayer:
    """One decode layer fused: `front`, then `router`, then the experts of `experts` (a native
    MoELayer hosting every expert), then x += their sum. `counts` ([E] int64, or None) is added
    the tokens routed to each expert; `bfloat16`: round as the per-op path does in that dtype
    (module doc of csrc/decode_moe_layer.cpp); `max_tokens`: the experts' native limit, which the
    caller keeps to."""

    def __init__(self, front: AttentionFront, router: Router, experts: native.MoELayer,
                 counts: torch.Tensor | None, bfloat16: bool, max_tokens: int):
        if experts.hidden_size != front.hidden_size or experts.num_experts != router.num_experts \
                or front.num_experts != router.num_experts:
            raise ValueError(f"fused MoE layer: front [{front.hidden_size}, {front.num_experts} experts], experts "
                             f"[{experts.hidden_size}, {experts.num_experts}], router of {router.num_experts}")
        if counts is not None and (counts.dtype != torch.int64 or counts.shape != (router.num_experts,)
                                   or not counts.is_contiguous()):
            raise ValueError(f"fused MoE layer: counts must be a contiguous int64 [{router.num_experts}] tensor")
        self.front, self.router, self.experts, self.counts = front, router, experts, counts
        self.max_tokens = max_tokens  # the most rows a step may have here (the native experts' limit)
        table, index = experts.pointers()
        self._struct = _LocalExperts(table, index, experts.num_experts, experts.hidden_size, experts.ffn_size,
                                     None if counts is None else counts.data_ptr(), int(bfloat16))
        self._ids = torch.empty(0, router.top_k, dtype=torch.int32)

    def __call__(self, step: DecodeStep, x: torch.Tensor) -> bool:
        """x float32 [T, D], updated in place (+ attention, + routed experts); True (the layer is done:
        the fused layers' common answer)."""
        T = step.context.num_rows
        self.front.check(step, x)
        if self._ids.shape[0] != T:
            self._ids = torch.empty(T, self.router.top_k, dtype=torch.int32)
        rc = native._lib.smk_decode_moe_layer(ctypes.byref(self.front._struct), ctypes.byref(step._struct), T,
                                              ctypes.byref(self.router._struct), ctypes.byref(self._struct),
                                              x.data_ptr(), self._ids.data_ptr())
        if rc != 0:
            raise ValueError(f"fused MoE layer: native kernel refused the call (code {rc})")
        return True
