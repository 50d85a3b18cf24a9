"""Q4_0 / Q4_1 / Q4_K weights repacked into torch's int4 layout for `_weight_int4pack_mm_for_cpu`.

The pure-torch decode route (used when the native kernels are unavailable): every 4-bit GGML
format is, per group of 32 values, an unsigned nibble q with a scale and an offset, which is
exactly torch's int4 group quantization

    w = (q - 8) * scale + zero      (scales_and_zeros [K/32, N, 2], groupsize 32)

    Q4_0: w = d * (q - 8)            scale d,           zero 0
    Q4_1: w = d * q + m              scale d,           zero m + 8d
    Q4_K: w = d*sc * q - dmin*m      scale d*sc (per 32), zero 8*d*sc - dmin*m

so the repack is lossless in the nibbles; only scale and zero round to bfloat16 (the CPU kernel
takes them in the activation dtype, and its float32 variant is a slow reference loop). The
packed layout itself is torch's business: `_convert_weight_to_int4pack_for_cpu` makes it (it
depends on torch's version and the CPU's ISA, which is why the on-disk cache keys on both).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from splitmoe.kernels.moe import ExpertFFN
from splitmoe.kernels.quants import QuantTensor

GROUP = 32
INT4_TYPES = frozenset({int(T.Q4_0), int(T.Q4_1), int(T.Q4_K)})
_N_MULTIPLE = 16  # torch's CPU packer wants N % 16 == 0


@dataclass(frozen=True)
class Int4Weight:
    """[n, k] in torch's packed int4 layout: `packed` uint8 [n, k/2], `scales_and_zeros` bf16 [k/32, n, 2]."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor

    @property
    def n(self) -> int:
        return self.packed.shape[0]

    @property
    def k(self) -> int:
        return self.packed.shape[1] * 2

    @property
    def num_bytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """bf16 [m, n] = x [m, k] @ W.T (x is cast to bf16: the only fast activation dtype)."""
        return torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), self.packed, GROUP,
                                                 self.scales_and_zeros)


@functools.cache
def available() -> bool:
    """Whether this torch has the CPU int4 kernels and they compute what this module assumes."""
    if not (hasattr(torch, "_convert_weight_to_int4pack_for_cpu") and hasattr(torch, "_weight_int4pack_mm_for_cpu")):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        q = torch.randint(0, 16, (32, 64), generator=gen, dtype=torch.int32)
        sz = torch.stack([torch.rand(2, 32, generator=gen) + 0.5, torch.randn(2, 32, generator=gen)], -1)
        sz = sz.to(torch.bfloat16)
        x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
        got = Int4Weight(torch._convert_weight_to_int4pack_for_cpu(q, 1), sz).matmul(x).float()
        w = (q.float() - 8) * sz[..., 0].float().repeat_interleave(GROUP, 0).T \
            + sz[..., 1].float().repeat_interleave(GROUP, 0).T
        want = x.float() @ w.T
        return bool((got - want).norm() <= 2e-2 * want.norm())
    except (RuntimeError, NotImplementedError):
        return False


def can_pack(qt: QuantTensor) -> bool:
    return qt.ggml_type in INT4_TYPES and len(qt.shape) == 2 and qt.shape[1] % GROUP == 0


def can_pack_all(qts: Sequence[QuantTensor]) -> bool:
    """Whether `pack(qts)` works: 4-bit types, one row length, rows a multiple of 16 in all."""
    return (bool(qts) and all(can_pack(q) for q in qts) and len({q.shape[1] for q in qts}) == 1
            and sum(q.shape[0] for q in qts) % _N_MULTIPLE == 0 and available())


# The bit twiddling is numpy's: its uint8 shifts and masks are vectorized, torch's (2.x, CPU)
# are several times slower. Scales are multiplied in float32 in the reference's order.

def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, start:start + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, pair_axis: int) -> np.ndarray:
    """uint8 [..., 1, ...] (a size-1 `pair_axis`) -> low nibbles then high nibbles along that axis."""
    shape = list(qs.shape)
    shape[pair_axis] = 2
    out = np.empty(shape, np.uint8)
    lo = [slice(None)] * len(shape)
    hi = list(lo)
    lo[pair_axis], hi[pair_axis] = slice(0, 1), slice(1, 2)
    np.bitwise_and(qs, 0xF, out=out[tuple(lo)])
    np.right_shift(qs, 4, out=out[tuple(hi)])
    return out


def unpack(qt: QuantTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [n, k] in 0..15, scale float32 [n, k/32], zero float32 [n, k/32]): w = (q - 8)*scale + zero."""
    if not can_pack(qt):
        raise ValueError(f"tensor {qt.name!r}: {qt.type_name} {list(qt.shape)} has no int4 repack")
    n, k = qt.shape
    elems, nbytes = GGML_QUANT_SIZES[T(qt.ggml_type)]
    blocks = np.asarray(qt.data).reshape(n * (k // elems), nbytes)
    if qt.ggml_type == T.Q4_K:  # 8 sub-blocks of 32 per 256: element c*64 + hi*32 + l is nibble hi of byte c*32 + l
        q = _nibbles(blocks[:, 16:144].reshape(-1, 4, 1, 32), 2)
        a, b, c = blocks[:, 4:8], blocks[:, 8:12], blocks[:, 12:16]
        sc = np.concatenate((a & 63, (c & 0xF) | ((a >> 6) << 4)), axis=1).astype(np.float32)
        m = np.concatenate((b & 63, (c >> 4) | ((b >> 6) << 4)), axis=1).astype(np.float32)
        scale = _f16(blocks, 0) * sc
        zero = 8 * scale - _f16(blocks, 2) * m
    else:  # Q4_0 / Q4_1: element j < 16 is the low nibble of byte j, j >= 16 the high one of byte j - 16
        first = 2 if qt.ggml_type == T.Q4_0 else 4
        q = _nibbles(blocks[:, first:first + 16].reshape(-1, 1, 16), 1)
        scale = _f16(blocks, 0)
        zero = np.zeros_like(scale) if qt.ggml_type == T.Q4_0 else _f16(blocks, 2) + 8 * scale
    groups = k // GROUP
    return (torch.from_numpy(q.reshape(n, k)), torch.from_numpy(scale.reshape(n, groups)),
            torch.from_numpy(zero.reshape(n, groups)))


def _pack_direct(q: torch.Tensor, out: torch.Tensor) -> None:
    """torch's AVX-512 layout, written without the int32 round trip: per block of 64 rows,
    byte [k, d] holds row d's value at column k in its low nibble and row d + 32's in its high."""
    n, k = q.shape
    q4 = q.numpy().reshape(n // 64, 2, 32, k)
    v = q4[:, 1] << 4
    v |= q4[:, 0]
    out.numpy().reshape(n // 64, k, 32)[...] = v.transpose(0, 2, 1)


@functools.cache
def _direct_layout_matches() -> bool:
    """Whether `_pack_direct` makes exactly what torch's packer makes on this CPU and torch."""
    try:
        q = torch.randint(0, 16, (128, 96), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
        out = torch.empty(128, 48, dtype=torch.uint8)
        _pack_direct(q, out)
        want = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        return want.dtype == torch.uint8 and tuple(want.shape) == (128, 48) and torch.equal(out, want)
    except (RuntimeError, NotImplementedError):
        return False


def pack(qts: Sequence[QuantTensor]) -> Int4Weight:
    """The row-wise concatenation of `qts` (e.g. gate then up) as one int4 weight."""
    if not can_pack_all(qts):
        raise ValueError("int4 pack: want 4-bit tensors of one row length, rows a multiple of 16 "
                         f"in all, and torch's CPU int4 kernels: got {[(q.type_name, q.shape) for q in qts]}")
    k = qts[0].shape[1]
    n = sum(q.shape[0] for q in qts)
    direct = _direct_layout_matches() and all(q.shape[0] % 64 == 0 for q in qts)
    packed = torch.empty(n, k // 2, dtype=torch.uint8) if direct else None
    sz = torch.empty(k // GROUP, n, 2, dtype=torch.bfloat16)
    nibbles = []
    row = 0
    for qt in qts:
        q, scale, zero = unpack(qt)
        rows = slice(row, row + qt.shape[0])
        sz[:, rows] = torch.from_numpy(np.stack((scale.numpy().T, zero.numpy().T), axis=-1)).to(torch.bfloat16)
        if direct:
            _pack_direct(q, packed[rows])
        else:
            nibbles.append(q)
        row += qt.shape[0]
    if not direct:
        packed = torch._convert_weight_to_int4pack_for_cpu(torch.cat(nibbles).to(torch.int32), 1)
    return Int4Weight(packed, sz)


@dataclass(frozen=True)
class Int4Expert:
    """One expert's int4-repacked matrices: gate and up fused ([2*ffn, D]), down when 4-bit too."""

    gate_up: Int4Weight
    down: Int4Weight | None

    @property
    def num_bytes(self) -> int:
        return self.gate_up.num_bytes + (self.down.num_bytes if self.down is not None else 0)


def can_repack(ffn: ExpertFFN) -> bool:
    return can_pack_all([ffn.gate, ffn.up])


def repack_expert(ffn: ExpertFFN) -> Int4Expert:
    down = pack([ffn.down]) if can_pack_all([ffn.down]) else None
    return Int4Expert(pack([ffn.gate, ffn.up]), down)


def to_dense(w: Int4Weight) -> torch.Tensor:
    """float32 [n, k]: what `w.matmul` multiplies by, rounded to bfloat16 (x = identity)."""
    eye = torch.eye(w.k, dtype=torch.bfloat16)
    return w.matmul(eye).float().T.contiguous()
