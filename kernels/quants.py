"""GGML block formats: a quantized tensor as stored in GGUF, and its dequantization.

Every format is a pure function from the raw blocks (uint8, one row per quant block) to float32
values, registered by GGML type. Layouts follow ggml's published block definitions
(ggml-common.h); tests check each one against gguf-py's independent numpy implementation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T


class UnsupportedQuantType(ValueError):
    pass


@dataclass(frozen=True)
class QuantTensor:
    """A tensor exactly as the file stores it.

    `shape` is the logical torch-order shape (GGUF lists dims fastest-first, so GGUF [in, out]
    is torch [out, in]). `data` is the raw storage with the same leading dims and, for block
    types, the row's bytes as its last dim; it is usually a read-only view of the mmap.
    """

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    data: np.ndarray

    def __getitem__(self, index: int) -> "QuantTensor":
        """Slice along the leading dim (one expert of a 3-D expert tensor): a view, no copy."""
        return QuantTensor(f"{self.name}[{index}]", self.ggml_type, self.shape[1:], self.data[index])

    @property
    def type_name(self) -> str:
        return T(self.ggml_type).name

    @property
    def num_bytes(self) -> int:
        return int(self.data.nbytes)


BlockDequant = Callable[[torch.Tensor], torch.Tensor]
"""uint8 [n_blocks, quant_block_bytes] -> float32 [n_blocks, quant_block_elems]"""

_DEQUANT: dict[int, BlockDequant] = {}


def _register(ggml_type: T):
    def wrap(fn: BlockDequant) -> BlockDequant:
        _DEQUANT[int(ggml_type)] = fn
        return fn

    return wrap


def supported_types() -> frozenset[int]:
    return frozenset(_DEQUANT) | {int(T.F32), int(T.F16), int(T.BF16)}


def check_supported(qt: QuantTensor) -> None:
    if qt.ggml_type not in supported_types():
        try:
            type_name = T(qt.ggml_type).name
        except ValueError:
            type_name = f"type {qt.ggml_type}"
        raise UnsupportedQuantType(f"tensor {qt.name!r}: quant type {type_name} is not supported")


def dequantize(qt: QuantTensor) -> torch.Tensor:
    """Float32 torch tensor of shape `qt.shape`."""
    check_supported(qt)
    t = qt.ggml_type
    # A private C-order copy: the mmap view is read-only (torch.from_numpy warns on those), and
    # a flat byte buffer lets every type, F32/F16/BF16 included, be reinterpreted the same way.
    raw = torch.from_numpy(np.array(qt.data, order="C").reshape(-1).view(np.uint8))
    if t == T.F32:
        return raw.view(torch.float32).reshape(qt.shape)
    if t == T.F16:
        return raw.view(torch.float16).float().reshape(qt.shape)
    if t == T.BF16:
        return raw.view(torch.bfloat16).float().reshape(qt.shape)
    elems, nbytes = GGML_QUANT_SIZES[T(t)]
    if not qt.shape or qt.shape[-1] % elems or raw.numel() * elems != nbytes * math.prod(qt.shape):
        raise ValueError(
            f"tensor {qt.name!r}: {raw.numel()} bytes of {qt.type_name} do not hold shape {qt.shape}"
        )
    return _DEQUANT[t](raw.reshape(-1, nbytes)).reshape(qt.shape)


# ---- helpers shared by the block formats -------------------------------------------------------
# ggml packs small fields LSB-first; `_fields` unpacks them with the field index as a new axis
# just before the last one, which is the element order every format below wants.

def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The little-endian fp16 at byte `start` of each block, as float32 [n, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _fields(x: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [..., k] -> [..., 8 // bits, k]: field i of every byte is (byte >> i*bits) & mask."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8).view(-1, 1)
    return (x.unsqueeze(-2) >> shifts) & ((1 << bits) - 1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """The 32-element layout: element j < 16 is the low nibble of byte j, j >= 16 the high of j-16."""
    return _fields(qs, 4).reshape(qs.shape[0], -1)


def _qh32(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The 5th bit of each of 32 elements, packed as one little-endian uint32 (bit j: element j)."""
    qh = blocks[:, start : start + 4].contiguous().view(torch.int32)
    return (qh >> torch.arange(32, dtype=torch.int32)) & 1


# ---- legacy 32-element formats ------------------------------------------------------------------

@_register(T.Q8_0)
def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    q = blocks[:, 2:].contiguous().view(torch.int8).float()
    return d * q


@_register(T.Q4_0)
def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 2:18]).float() - 8
    return q * _f16(blocks, 0)


@_register(T.Q4_1)
def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 4:20]).float()
    return q * _f16(blocks, 0) + _f16(blocks, 2)


@_register(T.Q5_0)
def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    q = (_nibbles(blocks[:, 6:22]) | (_qh32(blocks, 2) << 4)).float() - 16
    return q * _f16(blocks, 0)


@_register(T.Q5_1)
def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    q = (_nibbles(blocks[:, 8:24]) | (_qh32(blocks, 4) << 4)).float()
    return q * _f16(blocks, 0) + _f16(blocks, 2)


# ---- k-quants: 256-element super-blocks ---------------------------------------------------------
# Each super-block has 16 sub-blocks of 16 (Q2_K, Q3_K, Q6_K) or 8 of 32 (Q4_K, Q5_K) with their
# own integer scale times the fp16 super-scale. The scale is multiplied in before the quant so
# the float32 rounding matches ggml's dequantize_row_* (d * sc first, then * q).

def _by_sub(q: torch.Tensor, n_sub: int) -> torch.Tensor:
    return q.reshape(q.shape[0], n_sub, -1).float()


def _crumbs256(qs: torch.Tensor) -> torch.Tensor:
    """2-bit quants of 64 bytes: element h*128 + s*32 + l is bits 2s of byte h*32 + l."""
    return _fields(qs.reshape(-1, 2, 32), 2)


@_register(T.Q2_K)
def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    scales = blocks[:, 0:16]
    q = _by_sub(_crumbs256(blocks[:, 16:80]), 16)
    dl = (_f16(blocks, 80) * (scales & 0xF).float()).unsqueeze(-1)
    ml = (_f16(blocks, 82) * (scales >> 4).float()).unsqueeze(-1)
    return (dl * q - ml).reshape(-1, 256)


def _q3_k_scales(s: torch.Tensor) -> torch.Tensor:
    """16 signed 6-bit scales: low nibbles from bytes 0-7 (low halves first), top 2 bits from
    bytes 8-11 (scale i takes bits 2*(i // 4) of byte 8 + i % 4), stored with a +32 bias."""
    low = _fields(s[:, 0:8], 4).reshape(-1, 16)
    high = _fields(s[:, 8:12], 2).reshape(-1, 16)
    return (low | (high << 4)).float() - 32


@_register(T.Q3_K)
def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    # A *clear* hmask bit means "subtract 4": q = (low | hbit << 2) - 4.
    hbit = _fields(blocks[:, 0:32], 1)  # bit i of byte l: element 32*i + l
    low = _crumbs256(blocks[:, 32:96]).reshape(-1, 8, 32)
    q = _by_sub(low | (hbit << 2), 16) - 4
    dl = (_f16(blocks, 108) * _q3_k_scales(blocks[:, 96:108])).unsqueeze(-1)
    return (dl * q).reshape(-1, 256)


def _k4_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 6-bit (scale, min) pairs of Q4_K/Q5_K from 12 bytes a|b|c (4 bytes each):
    pairs 0-3 are the low 6 bits of a (scale) and b (min); pairs 4-7 take their low 4 bits from
    c's nibbles and their top 2 bits from the spare top bits of a and b."""
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((a & 63, (c & 0xF) | ((a >> 6) << 4)), dim=1)
    m = torch.cat((b & 63, (c >> 4) | ((b >> 6) << 4)), dim=1)
    return sc.float(), m.float()


def _k4_apply(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    sc, m = _k4_scale_min(blocks[:, 4:16])
    d = (_f16(blocks, 0) * sc).unsqueeze(-1)
    dm = (_f16(blocks, 2) * m).unsqueeze(-1)
    return (d * _by_sub(q, 8) - dm).reshape(-1, 256)


def _k4_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Element c*64 + hi*32 + l is nibble `hi` of byte c*32 + l (sub-block 2c + hi)."""
    return _fields(qs.reshape(-1, 4, 32), 4)


@_register(T.Q4_K)
def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    return _k4_apply(blocks, _k4_nibbles(blocks[:, 16:144]))


@_register(T.Q5_K)
def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    hbit = _fields(blocks[:, 16:48], 1)  # bit i of byte l: element 32*i + l
    q = _k4_nibbles(blocks[:, 48:176]).reshape(-1, 8, 32) | (hbit << 4)
    return _k4_apply(blocks, q)


@_register(T.Q6_K)
def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    # Element h*128 + k*32 + l: low 4 bits are nibble k // 2 of ql byte h*64 + (k % 2)*32 + l,
    # high 2 bits are bits 2k of qh byte h*32 + l.
    low = _fields(blocks[:, 0:128].reshape(-1, 2, 64), 4).reshape(-1, 8, 32)
    high = _fields(blocks[:, 128:192].reshape(-1, 2, 32), 2).reshape(-1, 8, 32)
    q = _by_sub(low | (high << 4), 16) - 32
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(blocks, 208) * scales).unsqueeze(-1)
    return (d * q).reshape(-1, 256)


# ---- MXFP4 (OCP microscaling, gpt-oss experts) --------------------------------------------------

# e2m1 code points doubled so they are integers; the scale is halved to compensate (as ggml does).
_E2M1_X2 = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32)


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """2**(e - 128) built from its float32 bits, exact also where it is subnormal (e < 2)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


@_register(T.MXFP4)
def _mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    q = _E2M1_X2[_nibbles(blocks[:, 1:17]).long()]
    return q * _e8m0_half(blocks[:, 0:1])
