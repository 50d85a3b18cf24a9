"""Decode attention as one native call per layer (kernels/csrc/attention.cpp).

For steps whose sequences bring few new tokens each (decode): every query row attends over its
sequence's cached context straight from the paged KV cache's pools, the query heads of a kv head
sharing each key and value read, softmax and accumulation in float32, the cache read in its own
format (float32, bfloat16, fp8 e4m3/e5m2, or q8_0's int8 blocks with float16 scales: `KVPool`),
converted in registers. One kernel serves grouped-query attention (sliding window, sinks) and
MLA's absorbed form (one latent "head" whose first dims are also the values).

`AttentionContext` says which slots each query row sees; it is built and checked once per step
and read by every layer, so a layer's call checks only shapes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from splitmoe.kernels import native

# The kernel's kv_type per stored dtype (csrc/smk.h): GGML's ids, and two of its own for fp8.
KV_TYPES = {torch.float32: 0, torch.bfloat16: 30, torch.float8_e4m3fn: 240, torch.float8_e5m2: 241}
Q8_0_TYPE = 8
Q8_0_BLOCK = 32


@dataclass(frozen=True)
class KVPool:
    """A KV cache pool as the kernel reads it: `values` [G, slots, D] or [slots, D] (float32,
    bfloat16, float8, or int8 with `scales`: q8_0's float16 scale of each 32 values, [..., slots, D / 32])."""

    values: torch.Tensor
    scales: torch.Tensor | None = None

    @property
    def kv_type(self) -> int:
        return Q8_0_TYPE if self.scales is not None else KV_TYPES[self.values.dtype]

    def check(self, what: str) -> None:
        t, s = self.values, self.scales
        ok_values = t.dim() in (2, 3) and t.device.type == "cpu" and t.stride(-1) == 1 and (
            t.dtype == torch.int8 if s is not None else t.dtype in KV_TYPES)
        if not ok_values:
            raise ValueError(f"{what} pool must be a CPU float32/bfloat16/float8 (or int8 with "
                             f"scales) [G, slots, D] or [slots, D] tensor with unit stride in D, got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")
        if s is not None and (s.dtype != torch.float16 or s.shape != (*t.shape[:-1], t.shape[-1] // Q8_0_BLOCK)
                              or t.shape[-1] % Q8_0_BLOCK or s.stride(-1) != 1 or s.device.type != "cpu"):
            raise ValueError(f"{what} pool's q8_0 scales must be float16 "
                             f"{(*t.shape[:-1], t.shape[-1] // Q8_0_BLOCK)}, got {tuple(s.shape)} {s.dtype}")

    def scale_strides(self) -> tuple[int, int, int]:
        """(scales address or 0, row stride, head stride) in elements."""
        s = self.scales
        if s is None:
            return 0, 0, 0
        return s.data_ptr(), s.stride(-2), s.stride(0) if s.dim() == 3 else 0


@dataclass(frozen=True)
class AttentionContext:
    """Per sequence: its query rows and its context slots (the query tokens' own slots last)."""

    slots: torch.Tensor  # int64 [sum of context lengths]
    seqs: torch.Tensor  # int64 [sequences, 4]: first query row, query rows, offset into slots, context length
    q_index: torch.Tensor  # int64 [T]: the context index of each query row's own token
    num_rows: int
    max_slot: int

    @classmethod
    def build(cls, rows: Sequence[tuple[int, int, torch.Tensor]]) -> "AttentionContext":
        """rows: per sequence (first query row, query rows, context slots [C] in position order)."""
        seqs, q_index, offset, num_rows = [], [], 0, 0
        for start, n, ctx in rows:
            c = int(ctx.numel())
            if not 0 < n <= c:
                raise ValueError(f"attention context: {n} query rows over a context of {c}")
            seqs.append((start, n, offset, c))
            q_index.extend(range(c - n, c))
            offset += c
            num_rows = max(num_rows, start + n)
        slots = torch.cat([ctx.reshape(-1) for _, _, ctx in rows]).to(device="cpu", dtype=torch.int64).contiguous()
        if slots.numel() and int(slots.min()) < 0:
            raise ValueError("attention context: negative slot")
        return cls(slots, torch.tensor(seqs, dtype=torch.int64).reshape(-1, 4), torch.tensor(q_index, dtype=torch.int64),
                   num_rows, int(slots.max()) if slots.numel() else -1)


def _pool_strides(kv: KVPool, what: str) -> tuple[int, int, int, int]:
    """(slots, row stride, head stride, heads) of a KV pool [G, slots, D] or [slots, D]."""
    kv.check(f"decode attention: {what}")
    pool = kv.values
    if pool.dim() == 2:
        return pool.shape[0], pool.stride(0), 0, 1
    return pool.shape[1], pool.stride(1), pool.stride(0), pool.shape[0]


def decode_attention(ctx: AttentionContext, q: torch.Tensor, k: torch.Tensor | KVPool, v: torch.Tensor | KVPool | None,
                     scale: float, *, window_tokens: int = 0, sinks: torch.Tensor | None = None,
                     value_dims: int | None = None) -> torch.Tensor:
    """float32 [T, H, Dv]: each query row's softmax(scale · q·k (+ sink)) · v over what it sees.

    q [T, H, Dk] (head h uses kv head h // (H / G)); k the key pool [G, slots, Dk] ([slots, Dk]: one
    head); v the value pool [G, slots, Dv], or None when the values are the first `value_dims` of
    each key row (MLA). Pools as tensors are read as stored; `KVPool` adds q8_0's scales. window_tokens > 0: a row sees only its own token and the window-1 before
    it. sinks [H]: a logit per head in the softmax's denominator that adds no value (gpt-oss).
    """
    if q.dim() != 3 or q.shape[0] != ctx.num_rows:
        raise ValueError(f"decode attention: q must be [{ctx.num_rows}, H, D], got {tuple(q.shape)}")
    T, H, Dk = q.shape
    k = k if isinstance(k, KVPool) else KVPool(k)
    num_slots, k_row, k_head, G = _pool_strides(k, "key")
    if v is None:
        if not value_dims or not 0 < value_dims <= Dk or (k.scales is not None and value_dims % Q8_0_BLOCK):
            raise ValueError(f"decode attention: values inside the keys need 0 < value_dims <= {Dk} "
                             f"(whole blocks of {Q8_0_BLOCK} for q8_0)")
        v, Dv, v_row, v_head = k, value_dims, k_row, k_head
    else:
        v = v if isinstance(v, KVPool) else KVPool(v)
        v_slots, v_row, v_head, v_heads = _pool_strides(v, "value")
        if (v_slots, v_heads, v.kv_type) != (num_slots, G, k.kv_type):
            raise ValueError("decode attention: the key and value pools differ in slots, heads or format")
        Dv = v.values.shape[-1]
    if k.values.shape[-1] != Dk or H % G:
        raise ValueError(f"decode attention: q [{T}, {H}, {Dk}] does not fit keys of {G} heads x {k.values.shape[-1]}")
    if ctx.max_slot >= num_slots:
        raise ValueError(f"decode attention: slot {ctx.max_slot} outside a pool of {num_slots}")
    if sinks is not None:
        sinks = sinks.to(device="cpu", dtype=torch.float32).contiguous()
        if sinks.shape != (H,):
            raise ValueError(f"decode attention: sinks must be [{H}], got {tuple(sinks.shape)}")
    qf = q.to(dtype=torch.float32).contiguous()
    out = torch.empty(T, H, Dv, dtype=torch.float32)
    rc = native._lib.smk_attention(
        qf.data_ptr(), T, H, G, Dk, Dv, k.values.data_ptr(), k_row, k_head, v.values.data_ptr(), v_row, v_head,
        k.kv_type, *k.scale_strides(), *v.scale_strides(), ctx.slots.data_ptr(), ctx.seqs.data_ptr(), ctx.seqs.shape[0], ctx.q_index.data_ptr(), scale,
        int(window_tokens), None if sinks is None else sinks.data_ptr(), out.data_ptr())
    if rc != 0:
        raise ValueError(f"decode attention: native kernel refused the call (code {rc})")
    return out
