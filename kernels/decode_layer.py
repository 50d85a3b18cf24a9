"""The attention half of a decode layer as one native call (kernels/csrc/decode_layer.cpp).

For the multi-head-attention families in the fast mode: input norm, q/k/v (one fused product,
biases), q/k norm, rope, the KV cache write, attention, the output projection and its residual
add, the FFN's norm and the router's logits, where torch made some twenty calls, each costing
more than its arithmetic on a decode step's few rows. `AttentionFront` is built once per layer
(weights and cache pools checked then); `DecodeStep` once per step, shared by every layer.

LoRA adapters on q/k/v and the output projection ride along (`FrontLora`): the native call hands the
normed input and the q/k/v products, then the attention output and its projection, to the caller, who
adds each adapted row's delta in place, so an adapter keeps the one-call front.
"""
from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass
from typing import Protocol

import torch

from splitmoe.kernels import native
from splitmoe.kernels.decode_attention import AttentionContext, KVPool
from splitmoe.kernels.linear import QuantLinear


class QkNorm(enum.IntEnum):
    """The RMSNorm of q and k after projection, if any. The values are csrc/decode_layer.cpp's
    `qk_norm` field: the architectures (modelfile/architectures) name these members, not copies."""
    NONE = 0
    PER_HEAD = 1  # one [Dk] weight shared by the heads (Qwen3, GLM-4.5)
    FULL = 2  # over the whole projection: [H*Dk] for q, [G*Dk] for k (OLMoE)


_P = ctypes.c_void_p
_LORA_HOOK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, _P, _P)  # csrc/decode_layer.cpp SmkLoraHook


class FrontLora(Protocol):
    """Adds adapted rows' deltas inside a front, in place (float32 views of the native call's buffers)."""

    def qkv(self, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """h: the normed input [T, D]; q, k, v: its products, before biases, norms and rope."""

    def output(self, a: torch.Tensor, o: torch.Tensor) -> None:
        """a: the attention output [T, H*Dv]; o: its output projection [T, D], before the residual add."""


def _floats(address: int, rows: int, cols: int) -> torch.Tensor:
    return torch.frombuffer((ctypes.c_float * (rows * cols)).from_address(address), dtype=torch.float32).view(rows, cols)


class _QuantLinear(ctypes.Structure):
    _fields_ = [("w", _P), ("row_bytes", ctypes.c_int64), ("type", ctypes.c_int32), ("rows", ctypes.c_int32),
                ("cols", ctypes.c_int32), ("bias", _P)]


class _AttnLayer(ctypes.Structure):
    _fields_ = [("D", ctypes.c_int32), ("H", ctypes.c_int32), ("G", ctypes.c_int32), ("Dk", ctypes.c_int32),
                ("Dv", ctypes.c_int32), ("eps", ctypes.c_float), ("attn_norm", _P), ("ffn_norm", _P),
                ("q", _QuantLinear), ("k", _QuantLinear), ("v", _QuantLinear), ("o", _QuantLinear),
                ("qk_norm", ctypes.c_int32), ("q_norm", _P), ("k_norm", _P),
                ("rope_dims", ctypes.c_int32), ("rope_interleaved", ctypes.c_int32), ("scale", ctypes.c_float),
                ("window", ctypes.c_int32), ("sinks", _P), ("k_pool", _P), ("v_pool", _P),
                ("k_row", ctypes.c_int64), ("k_head", ctypes.c_int64), ("v_row", ctypes.c_int64),
                ("v_head", ctypes.c_int64), ("kv_type", ctypes.c_int32), ("router", _P), ("router_bias", _P),
                ("E", ctypes.c_int32), ("k_scales", _P), ("v_scales", _P), ("k_scale_row", ctypes.c_int64),
                ("k_scale_head", ctypes.c_int64), ("v_scale_row", ctypes.c_int64), ("v_scale_head", ctypes.c_int64)]


class _DecodeStep(ctypes.Structure):
    _fields_ = [("T", ctypes.c_int32), ("new_slots", _P), ("cos", _P), ("sin", _P), ("slots", _P), ("seqs", _P),
                ("n_seqs", ctypes.c_int32), ("q_index", _P)]


def _f32(t: torch.Tensor | None, shape: tuple[int, ...], what: str) -> torch.Tensor | None:
    if t is None:
        return None
    t = t.detach().to(device="cpu", dtype=torch.float32).contiguous()
    if t.numel() != torch.Size(shape).numel():
        raise ValueError(f"attention front: {what} has {tuple(t.shape)}, want {shape}")
    return t.reshape(shape)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@dataclass
class DecodeStep:
    """What every layer's front reads of one decode step: new slots, rope tables, attention context."""

    new_slots: torch.Tensor  # int64 [T]
    cos: torch.Tensor        # float32 [T, rope_dims], pair layout (layers.Rope's tables)
    sin: torch.Tensor
    context: AttentionContext

    def __post_init__(self) -> None:
        T = self.context.num_rows
        self.new_slots = self.new_slots.to(device="cpu", dtype=torch.int64).contiguous()
        self.cos = self.cos.to(device="cpu", dtype=torch.float32).reshape(T, -1).contiguous()
        self.sin = self.sin.to(device="cpu", dtype=torch.float32).reshape(T, -1).contiguous()
        if self.new_slots.shape != (T,) or self.cos.shape != self.sin.shape:
            raise ValueError(f"decode step: {T} rows, slots {tuple(self.new_slots.shape)}, rope tables "
                             f"{tuple(self.cos.shape)} and {tuple(self.sin.shape)}")
        c = self.context
        self.max_slot = max(c.max_slot, int(self.new_slots.max()) if T else -1)
        self._struct = _DecodeStep(T, self.new_slots.data_ptr(), self.cos.data_ptr(), self.sin.data_ptr(),
                                   c.slots.data_ptr(), c.seqs.data_ptr(), c.seqs.shape[0], c.q_index.data_ptr())


class AttentionFront:
    """One layer's weights and cache pools, checked once; `__call__` runs its front (module doc)."""

    def __init__(self, *, eps: float, attn_norm: torch.Tensor, ffn_norm: torch.Tensor, q: QuantLinear,
                 k: QuantLinear, v: QuantLinear, o: QuantLinear, heads: int, kv_heads: int, head_dim: int,
                 value_dim: int, biases: tuple = (None, None, None, None), qk_norm: QkNorm = QkNorm.NONE,
                 q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, rope_dims: int = 0,
                 rope_interleaved: bool = False, scale: float = 1.0, window: int = 0,
                 sinks: torch.Tensor | None = None, k_pool: torch.Tensor | KVPool, v_pool: torch.Tensor | KVPool,
                 router: torch.Tensor | None = None, router_bias: torch.Tensor | None = None):
        if not native.AVAILABLE:
            raise RuntimeError(f"native kernels unavailable: {native.UNAVAILABLE_REASON}")
        D, H, G, Dk, Dv = o.out_features, heads, kv_heads, head_dim, value_dim
        if H % G or rope_dims % 2 or rope_dims > min(Dk, 1024) or not isinstance(qk_norm, QkNorm):
            raise ValueError(f"attention front: heads {H}/{G}, rope dims {rope_dims} of {Dk}, qk norm {qk_norm!r}")
        self.hidden_size, self.num_experts = D, 0 if router is None else router.shape[0]
        keep: list = []  # everything the C side points into

        def lin(w: QuantLinear, rows: int, cols: int, bias, name: str) -> _QuantLinear:
            if not (isinstance(w, QuantLinear) and w.route == "native" and w.shape == (rows, cols)):
                raise ValueError(f"attention front: {name} must be a native quantized [{rows}, {cols}] weight, got {w!r}")
            kw = w.kernel  # the linear's own view for the kernels (packed, or its GGUF rows)
            b = _f32(bias, (rows,), f"{name} bias")
            keep.extend((w, kw, b))
            return _QuantLinear(kw.address, kw.stride, kw.type_field, rows, cols, _ptr(b))

        heads_q = {QkNorm.NONE: None, QkNorm.PER_HEAD: (Dk,), QkNorm.FULL: (H * Dk,)}[qk_norm]
        heads_k = {QkNorm.NONE: None, QkNorm.PER_HEAD: (Dk,), QkNorm.FULL: (G * Dk,)}[qk_norm]
        norms = [_f32(attn_norm, (D,), "attn_norm"), _f32(ffn_norm, (D,), "ffn_norm"),
                 _f32(q_norm, heads_q, "q_norm") if heads_q else None, _f32(k_norm, heads_k, "k_norm") if heads_k else None,
                 _f32(sinks, (H,), "sinks"), _f32(router, (self.num_experts, D), "router"),
                 _f32(router_bias, (self.num_experts,), "router bias")]
        keep.extend(norms)
        k_pool, v_pool = (p if isinstance(p, KVPool) else KVPool(p) for p in (k_pool, v_pool))
        for kv, dim, what in ((k_pool, Dk, "key"), (v_pool, Dv, "value")):
            kv.check(f"attention front: the {what}")
            pool = kv.values
            if pool.dim() != 3 or pool.shape[0] != G or pool.shape[2] != dim or not pool.is_contiguous():
                raise ValueError(f"attention front: the {what} pool must be a contiguous CPU [{G}, slots, {dim}] "
                                 f"tensor, got {tuple(pool.shape)} {pool.dtype}")
        if (k_pool.kv_type, k_pool.values.shape[1]) != (v_pool.kv_type, v_pool.values.shape[1]):
            raise ValueError("attention front: key and value pools differ in format or slots")
        keep.extend((k_pool, v_pool))
        self.num_slots = k_pool.values.shape[1]
        (k_scales, k_scale_row, k_scale_head), (v_scales, v_scale_row, v_scale_head) = (
            k_pool.scale_strides(), v_pool.scale_strides())
        self._keep = keep
        qb, kb, vb, ob = biases
        self._struct = _AttnLayer(
            D, H, G, Dk, Dv, eps, _ptr(norms[0]), _ptr(norms[1]),
            lin(q, H * Dk, D, qb, "q"), lin(k, G * Dk, D, kb, "k"), lin(v, G * Dv, D, vb, "v"),
            lin(o, D, H * Dv, ob, "output"), int(qk_norm), _ptr(norms[2]), _ptr(norms[3]), rope_dims,
            int(rope_interleaved), scale, window, _ptr(norms[4]), k_pool.values.data_ptr(), v_pool.values.data_ptr(),
            k_pool.values.stride(1), k_pool.values.stride(0), v_pool.values.stride(1), v_pool.values.stride(0),
            k_pool.kv_type, _ptr(norms[5]), _ptr(norms[6]), self.num_experts, k_scales or None, v_scales or None,
            k_scale_row, k_scale_head, v_scale_row, v_scale_head)

    def __call__(self, step: DecodeStep, x: torch.Tensor,
                 lora: FrontLora | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x float32 [T, D] (updated in place: + attention) -> (the FFN's normed input [T, D],
        router logits [T, E] or None). `lora`: adds adapters' deltas to the products (FrontLora)."""
        T = step.context.num_rows
        self.check(step, x)
        h = torch.empty(T, self.hidden_size, dtype=torch.float32)
        logits = torch.empty(T, self.num_experts, dtype=torch.float32) if self.num_experts else None
        out = None if logits is None else logits.data_ptr()
        if lora is None:  # the usual step: nothing made per call for adapters
            rc = native._lib.smk_attn_front(ctypes.byref(self._struct), ctypes.byref(step._struct), x.data_ptr(),
                                            h.data_ptr(), out, None)
        else:
            failed: list[BaseException] = []
            hook = _LORA_HOOK(self._lora_hook(T, lora, failed))
            rc = native._lib.smk_attn_front(ctypes.byref(self._struct), ctypes.byref(step._struct), x.data_ptr(),
                                            h.data_ptr(), out, hook)
            if failed:
                raise failed[0]
        if rc != 0:
            raise ValueError(f"attention front: native kernel refused the call (code {rc})")
        return h, logits

    def check(self, step: DecodeStep, x: torch.Tensor) -> None:
        """ValueError unless x and the step fit this layer (what the native call trusts)."""
        T = step.context.num_rows
        if x.shape != (T, self.hidden_size) or x.dtype != torch.float32 or not x.is_contiguous() \
                or x.device.type != "cpu":
            raise ValueError(f"attention front: x must be a contiguous CPU float32 [{T}, {self.hidden_size}] "
                             f"tensor, got {tuple(x.shape)} {x.dtype}")
        if step.max_slot >= self.num_slots:
            raise ValueError(f"attention front: slot {step.max_slot} outside a pool of {self.num_slots}")
        if step.cos.shape[1] != self._struct.rope_dims:
            raise ValueError(f"attention front: rope tables of {step.cos.shape[1]} dims, the layer rotates "
                             f"{self._struct.rope_dims}")

    def _lora_hook(self, T: int, lora: FrontLora, failed: list[BaseException]):
        L = self._struct
        D, nq, nk, nv, na = L.D, L.H * L.Dk, L.G * L.Dk, L.G * L.Dv, L.H * L.Dv

        def hook(stage: int, inp: int, out: int) -> int:
            try:
                if stage == 0:
                    qkv = _floats(out, T, nq + nk + nv)
                    lora.qkv(_floats(inp, T, D), qkv[:, :nq], qkv[:, nq:nq + nk], qkv[:, nq + nk:])
                else:
                    lora.output(_floats(inp, T, na), _floats(out, T, D))
                return 0
            except BaseException as e:  # noqa: BLE001 - raised again by the caller, after the native call
                failed.append(e)
                return 1
        return hook
