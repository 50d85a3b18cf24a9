"""Decode attention as one native call per layer (kernels/csrc/attention.cpp).

For steps whose sequences bring few new tokens each (decode): every query row attends over its
sequence's cached context straight from the paged KV cache's pools, the query heads of a kv head
sharing each key and value read, softmax and accumulation in float32, the cache read in its own
dtype (float32 or bfloat16). One kernel serves grouped-query attention (sliding window, sinks) and
MLA's absorbed form (one latent "head" whose first dims are also the values).

`AttentionContext` says which slots each query row sees; it is built and checked once per step
and read by every layer, so a layer's call checks only shapes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from splitmoe.kernels import native

_KV_TYPES = {torch.float32: 0, torch.bfloat16: 30}


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


def _pool_strides(pool: torch.Tensor, what: str) -> tuple[int, int, int, int]:
    """(slots, row stride, head stride, heads) of a KV pool [G, slots, D] or [slots, D]."""
    if pool.dim() not in (2, 3) or pool.dtype not in _KV_TYPES or pool.device.type != "cpu" or pool.stride(-1) != 1:
        raise ValueError(f"decode attention: {what} pool must be a CPU float32/bfloat16 [G, slots, D] or [slots, D] "
                         f"tensor with unit stride in D, got {tuple(pool.shape)} {pool.dtype} on {pool.device}")
    if pool.dim() == 2:
        return pool.shape[0], pool.stride(0), 0, 1
    return pool.shape[1], pool.stride(1), pool.stride(0), pool.shape[0]


def decode_attention(ctx: AttentionContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                     scale: float, *, window_tokens: int = 0, sinks: torch.Tensor | None = None,
                     value_dims: int | None = None) -> torch.Tensor:
    """float32 [T, H, Dv]: each query row's softmax(scale · q·k (+ sink)) · v over what it sees.

    q [T, H, Dk] (head h uses kv head h // (H / G)); k the key pool [G, slots, Dk] ([slots, Dk]: one
    head); v the value pool [G, slots, Dv], or None when the values are the first `value_dims` of
    each key row (MLA). window_tokens > 0: a row sees only its own token and the window-1 before
    it. sinks [H]: a logit per head in the softmax's denominator that adds no value (gpt-oss).
    """
    if q.dim() != 3 or q.shape[0] != ctx.num_rows:
        raise ValueError(f"decode attention: q must be [{ctx.num_rows}, H, D], got {tuple(q.shape)}")
    T, H, Dk = q.shape
    num_slots, k_row, k_head, G = _pool_strides(k, "key")
    if v is None:
        if not value_dims or not 0 < value_dims <= Dk:
            raise ValueError(f"decode attention: values inside the keys need 0 < value_dims <= {Dk}")
        v, Dv, v_row, v_head = k, value_dims, k_row, k_head
    else:
        v_slots, v_row, v_head, v_heads = _pool_strides(v, "value")
        if (v_slots, v_heads, v.dtype) != (num_slots, G, k.dtype):
            raise ValueError("decode attention: the key and value pools differ in slots, heads or dtype")
        Dv = v.shape[-1]
    if k.shape[-1] != Dk or H % G:
        raise ValueError(f"decode attention: q [{T}, {H}, {Dk}] does not fit keys of {G} heads x {k.shape[-1]}")
    if ctx.max_slot >= num_slots:
        raise ValueError(f"decode attention: slot {ctx.max_slot} outside a pool of {num_slots}")
    if sinks is not None:
        sinks = sinks.to(device="cpu", dtype=torch.float32).contiguous()
        if sinks.shape != (H,):
            raise ValueError(f"decode attention: sinks must be [{H}], got {tuple(sinks.shape)}")
    qf = q.to(dtype=torch.float32).contiguous()
    out = torch.empty(T, H, Dv, dtype=torch.float32)
    rc = native._lib.smk_attention(
        qf.data_ptr(), T, H, G, Dk, Dv, k.data_ptr(), k_row, k_head, v.data_ptr(), v_row, v_head, _KV_TYPES[k.dtype],
        ctx.slots.data_ptr(), ctx.seqs.data_ptr(), ctx.seqs.shape[0], ctx.q_index.data_ptr(), scale,
        int(window_tokens), None if sinks is None else sinks.data_ptr(), out.data_ptr())
    if rc != 0:
        raise ValueError(f"decode attention: native kernel refused the call (code {rc})")
    return out
