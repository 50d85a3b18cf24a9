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

from splitmoe.kernels import iq_grids


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


# ---- ternary formats (TQ1_0, TQ2_0): values -1, 0, 1 times one fp16 scale per 256 ----------------

_POW3 = torch.tensor([1, 3, 9, 27, 81], dtype=torch.uint8)


def _trits(packed: torch.Tensor, n_trits: int) -> torch.Tensor:
    """TQ1_0's base-3 bytes -> [n, n_trits, bytes]: trit t of a byte is the top of (byte * 3**t)
    mod 256 scaled by 3 (uint8 multiplication wraps, which is the encoding)."""
    scaled = packed.unsqueeze(-2) * _POW3[:n_trits].view(-1, 1)
    return ((scaled.to(torch.int32) * 3) >> 8) - 1


@_register(T.TQ1_0)
def _tq1_0(blocks: torch.Tensor) -> torch.Tensor:
    # qs[48] | qh[4] | d: elements are trits of qs[0:32] (5 per byte, trit-major), then of
    # qs[32:48], then 4 trits of each qh byte.
    n = blocks.shape[0]
    q = torch.cat((_trits(blocks[:, 0:32], 5).reshape(n, -1), _trits(blocks[:, 32:48], 5).reshape(n, -1),
                   _trits(blocks[:, 48:52], 4).reshape(n, -1)), dim=1)
    return _f16(blocks, 52) * q.float()


@_register(T.TQ2_0)
def _tq2_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _crumbs256(blocks[:, 0:64]).reshape(blocks.shape[0], -1)
    return _f16(blocks, 64) * (q.float() - 1)


# ---- i-quants: codebook formats ------------------------------------------------------------------
# Groups of 4 or 8 values are one index into a grid of llama.cpp's (kernels.iq_grids) with a sign
# per value and a small scale per 16 or 32 values. Scales are formed in gguf-py's (and ggml's)
# order, d * (sub-scale expression) first, so every float32 product rounds the same way.

_KVALUES_IQ4NL = torch.tensor(iq_grids.KVALUES_IQ4NL, dtype=torch.float32)


def _u16(blocks: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """`count` little-endian uint16 from byte `start`, as int32 [n, count] (non-negative)."""
    return blocks[:, start : start + 2 * count].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF


def _u32(blocks: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """`count` little-endian uint32 from byte `start`, as int64 [n, count] (non-negative)."""
    return blocks[:, start : start + 4 * count].contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _lo_hi(x: torch.Tensor) -> torch.Tensor:
    """uint8 [n, k] -> [n, 2k]: each byte's low nibble, then its high nibble."""
    return torch.stack((x & 0xF, x >> 4), dim=-1).reshape(x.shape[0], -1)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """uint8 [n, k] -> [n, 8k]: each byte's bits, LSB first."""
    return ((x.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(x.shape[0], -1)


def _minus(bits: torch.Tensor) -> torch.Tensor:
    """Sign bits (1 = negative) as float32 +-1."""
    return 1 - 2 * bits.float()


def _ksigned(index7: torch.Tensor) -> torch.Tensor:
    """[n, g] 7-bit ksigns indices -> float32 +-1 [n, g, 8]."""
    signs = iq_grids.ksigns()[index7.long()]
    return _minus((signs.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1)


def _lookup(name: str, index: torch.Tensor) -> torch.Tensor:
    return iq_grids.grid(name)[index.long()].float()


def _half_scale(d: torch.Tensor, s: torch.Tensor, mult: float) -> torch.Tensor:
    """d * (0.5 + s) * mult, the sub-block scale of IQ2_*/IQ3_XXS."""
    return d * (0.5 + s.float()) * mult


def _iq_xxs(blocks: torch.Tensor, name: str, mult: float) -> torch.Tensor:
    """IQ2_XXS / IQ3_XXS: per 32 values, grid-index bytes (4 into an 8-wide grid, or 8 into a
    4-wide one) and one uint32 holding four 7-bit ksigns indices and a 4-bit scale. IQ2_XXS
    interleaves the two per 32 values; IQ3_XXS lists all indices first, then the uint32s."""
    n = blocks.shape[0]
    d = _f16(blocks, 0)
    if name == "iq2xxs":
        words = _u32(blocks, 2, 16).reshape(n, 8, 2)
        idx, aux = blocks[:, 2:66].reshape(n, 8, 8)[:, :, 0:4], words[:, :, 1]
    else:
        idx, aux = blocks[:, 2:66].reshape(n, 8, 8), _u32(blocks, 66, 8)
    db = _half_scale(d, aux >> 28, mult).reshape(n, 8, 1, 1)
    signs = _ksigned((aux.unsqueeze(-1) >> torch.tensor([0, 7, 14, 21])) & 0x7F)  # [n, 8, 4, 8]
    grid = _lookup(name, idx).reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, 256)


@_register(T.IQ2_XXS)
def _iq2_xxs(blocks: torch.Tensor) -> torch.Tensor:
    return _iq_xxs(blocks, "iq2xxs", 0.25)


@_register(T.IQ3_XXS)
def _iq3_xxs(blocks: torch.Tensor) -> torch.Tensor:
    return _iq_xxs(blocks, "iq3xxs", 0.5)


@_register(T.IQ2_XS)
def _iq2_xs(blocks: torch.Tensor) -> torch.Tensor:
    # d | qs: 32 uint16 (9-bit grid index, 7-bit ksigns index) | 16 4-bit scales
    n = blocks.shape[0]
    qs = _u16(blocks, 2, 32)
    db = _half_scale(_f16(blocks, 0), _lo_hi(blocks[:, 66:74]), 0.25).reshape(n, 16, 1, 1)
    grid = _lookup("iq2xs", qs & 511).reshape(n, 16, 2, 8)
    signs = _ksigned(qs >> 9).reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, 256)


@_register(T.IQ2_S)
def _iq2_s(blocks: torch.Tensor) -> torch.Tensor:
    # d | qs[32] low index bytes | signs[32] | qh[8] 2-bit index tops | 16 4-bit scales
    n = blocks.shape[0]
    high = (blocks[:, 66:74].unsqueeze(-1) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)) & 3
    idx = blocks[:, 2:34].to(torch.int32) | (high.reshape(n, 32).to(torch.int32) << 8)
    db = _half_scale(_f16(blocks, 0), _lo_hi(blocks[:, 74:82]), 0.25).reshape(n, 16, 1, 1)
    grid = _lookup("iq2s", idx).reshape(n, 16, 2, 8)
    signs = _minus(_bits(blocks[:, 34:66])).reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, 256)


@_register(T.IQ3_S)
def _iq3_s(blocks: torch.Tensor) -> torch.Tensor:
    # d | qs[64] low index bytes | qh[8] index top bits | signs[32] | 8 4-bit scales (odd, 1..31)
    n = blocks.shape[0]
    idx = blocks[:, 2:66].to(torch.int32) | (_bits(blocks[:, 66:74]).to(torch.int32) << 8)
    db = (_f16(blocks, 0) * (1 + 2 * _lo_hi(blocks[:, 106:110]).float())).reshape(n, 8, 1, 1)
    grid = _lookup("iq3s", idx).reshape(n, 8, 4, 8)
    signs = _minus(_bits(blocks[:, 74:106])).reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, 256)


_IQ1_DELTA = 0.125


def _iq1(dl: torch.Tensor, idx: torch.Tensor, negative_delta: torch.Tensor) -> torch.Tensor:
    """dl * (grid + delta) with iq1s_grid entries of 8 and a +-1/8 shift per group; `dl` and
    `negative_delta` broadcast against the [n, groups, 8] grid values."""
    delta = torch.where(negative_delta.bool(), -_IQ1_DELTA, _IQ1_DELTA).float()
    return dl * (_lookup("iq1s", idx) + delta)


@_register(T.IQ1_S)
def _iq1_s(blocks: torch.Tensor) -> torch.Tensor:
    # d | qs[32] low index bytes | qh: 8 uint16, per 32 values: 4 3-bit index tops, a 3-bit
    # scale, the delta's sign
    n = blocks.shape[0]
    qh = _u16(blocks, 34, 8)
    high = (qh.unsqueeze(-1) >> torch.tensor([0, 3, 6, 9])) & 7
    idx = blocks[:, 2:34].to(torch.int32) | (high.reshape(n, 32) << 8)
    dl = (_f16(blocks, 0) * (2 * ((qh >> 12) & 7) + 1).float()).reshape(n, 8, 1, 1)
    out = _iq1(dl, idx.reshape(n, 8, 4), (qh >> 15).reshape(n, 8, 1, 1))
    return out.reshape(n, 256)


@_register(T.IQ1_M)
def _iq1_m(blocks: torch.Tensor) -> torch.Tensor:
    # qs[32] low index bytes | qh[16]: per nibble a 3-bit index top and the delta's sign |
    # 4 uint16: 3-bit scales per 16 values in bits 0-11, the fp16 d in the four top nibbles
    n = blocks.shape[0]
    sc = _u16(blocks, 48, 4)
    d_bits = ((sc >> 12) << torch.tensor([0, 4, 8, 12])).sum(dim=1, keepdim=True)
    d = d_bits.to(torch.int16).view(torch.float16).float()
    scales = ((sc.unsqueeze(-1) >> torch.tensor([0, 3, 6, 9])) & 7).reshape(n, 16)
    dl = (d * (2 * scales + 1).float()).reshape(n, 8, 2, 1, 1)
    qh = _lo_hi(blocks[:, 32:48]).to(torch.int32)
    idx = blocks[:, 0:32].to(torch.int32) | ((qh & 7) << 8)
    out = _iq1(dl, idx.reshape(n, 8, 2, 2), (qh >> 3).reshape(n, 8, 2, 2, 1))
    return out.reshape(n, 256)


@_register(T.IQ4_NL)
def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * _KVALUES_IQ4NL[_nibbles(blocks[:, 2:18]).long()]


@_register(T.IQ4_XS)
def _iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    # d | scales_h: uint16, 2 top bits per 32 values | scales_l: 8 low nibbles | qs[128], each
    # 16 bytes the IQ4_NL nibble layout of 32 values; scales are 6-bit with a -32 bias
    n = blocks.shape[0]
    high = (_u16(blocks, 2, 1) >> torch.arange(0, 16, 2)) & 3
    scales = (_lo_hi(blocks[:, 4:8]).to(torch.int32) | (high << 4)) - 32
    dl = (_f16(blocks, 0) * scales.float()).reshape(n, 8, 1)
    q = _nibbles(blocks[:, 8:136].reshape(n * 8, 16)).reshape(n, 8, 32)
    return (dl * _KVALUES_IQ4NL[q.long()]).reshape(n, 256)
