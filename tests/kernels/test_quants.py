"""kernels.quants against gguf-py's independent numpy dequantizers (and quantizers).

Every format is exactly representable in float32 and both sides apply the scales in ggml's
order, so results are compared bit for bit.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFReader
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from splitmoe.kernels import iq_grids
from splitmoe.kernels.quants import QuantTensor, UnsupportedQuantType, dequantize, supported_types

FIXTURES = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures"

# Byte offsets of the fp16 fields inside one block, from ggml-common.h. Random bytes there would
# often be inf/nan; the rest of a block is any bit pattern.
FP16_FIELDS = {
    T.Q4_0: (0,),  # d, qs[16]
    T.Q4_1: (0, 2),  # d, m, qs[16]
    T.Q5_0: (0,),  # d, qh[4], qs[16]
    T.Q5_1: (0, 2),  # d, m, qh[4], qs[16]
    T.Q8_0: (0,),  # d, qs[32]
    T.Q2_K: (80, 82),  # scales[16], qs[64], d, dmin
    T.Q3_K: (108,),  # hmask[32], qs[64], scales[12], d
    T.Q4_K: (0, 2),  # d, dmin, scales[12], qs[128]
    T.Q5_K: (0, 2),  # d, dmin, scales[12], qh[32], qs[128]
    T.Q6_K: (208,),  # ql[128], qh[64], scales[16], d
    T.MXFP4: (),  # e (E8M0 byte), qs[16]
}
# The codebook and ternary formats (issue 13). IQ1_M has no fp16 field of its own: its d is
# spread over the top nibbles of its four scale words (see `set_iq1_m_d`).
IQ_FP16_FIELDS = {
    T.TQ1_0: (52,),  # qs[48], qh[4], d
    T.TQ2_0: (64,),  # qs[64], d
    T.IQ2_XXS: (0,),  # d, qs[32] uint16
    T.IQ2_XS: (0,),  # d, qs[32] uint16, scales[8]
    T.IQ2_S: (0,),  # d, qs[32], signs[32], qh[8], scales[8]
    T.IQ3_XXS: (0,),  # d, qs[64], scales_and_signs[32]
    T.IQ3_S: (0,),  # d, qs[64], qh[8], signs[32], scales[4]
    T.IQ1_S: (0,),  # d, qs[32], qh[8] uint16
    T.IQ1_M: (),  # qs[32], qh[16], scales[4] uint16 (d in their top nibbles)
    T.IQ4_NL: (0,),  # d, qs[16]
    T.IQ4_XS: (0,),  # d, scales_h uint16, scales_l[4], qs[128]
}
BLOCK_TYPES = list(FP16_FIELDS)
IQ_TYPES = list(IQ_FP16_FIELDS)
FP16_FIELDS = FP16_FIELDS | IQ_FP16_FIELDS
FLOAT_TYPES = [T.F32, T.F16, T.BF16]


def random_blocks(qtype: T, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Raw uint8 storage for a tensor of logical `shape` with finite dequantized values."""
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    assert shape[-1] % elems == 0
    n_blocks = int(np.prod(shape)) // elems
    blocks = rng.integers(0, 256, size=(n_blocks, nbytes), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        scale = rng.uniform(-1, 1, n_blocks) * 10.0 ** rng.uniform(-4, 1, n_blocks)
        blocks[:, off : off + 2] = scale.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    if qtype == T.MXFP4:
        blocks[:, 0] = rng.integers(127 - 20, 127 + 20, n_blocks)
    if qtype == T.IQ1_M:
        set_iq1_m_d(blocks, rng.uniform(-1, 1, n_blocks) * 10.0 ** rng.uniform(-4, 1, n_blocks))
    return blocks.reshape(*shape[:-1], shape[-1] // elems * nbytes)


def set_iq1_m_d(blocks: np.ndarray, d: np.ndarray) -> None:
    """Write fp16 `d` into IQ1_M blocks [n, 56]: nibble i of its bits is the top nibble of
    scale word i (bytes 48-55), whose low 12 bits (the 3-bit sub-scales) are kept."""
    words = blocks[:, 48:56].copy().view(np.uint16)
    bits = d.astype(np.float16).view(np.uint16)
    for i in range(4):
        words[:, i] = (words[:, i] & 0x0FFF) | (((bits >> (4 * i)) & 0xF) << 12)
    blocks[:, 48:56] = words.view(np.uint8)


def iq1_m_d(blocks: np.ndarray) -> np.ndarray:
    """The fp16 d of IQ1_M blocks [n, 56], as float32."""
    words = blocks[:, 48:56].copy().view(np.uint16)
    bits = sum((words[:, i] >> 12) << (4 * i) for i in range(4)).astype(np.uint16)
    return bits.view(np.float16).astype(np.float32)


def reference(raw: np.ndarray, qtype: T) -> np.ndarray:
    out = gq.dequantize(raw, qtype)
    assert np.isfinite(out).all(), "test data should be finite (check FP16_FIELDS)"
    return out


def ours(raw: np.ndarray, qtype: T, shape: tuple[int, ...], name: str = "t") -> np.ndarray:
    out = dequantize(QuantTensor(name, int(qtype), shape, raw))
    assert out.dtype == torch.float32 and tuple(out.shape) == shape
    return out.numpy()


def test_every_listed_block_type_is_supported():
    assert {int(t) for t in BLOCK_TYPES + IQ_TYPES + FLOAT_TYPES} == set(supported_types())


@pytest.mark.parametrize("qtype", BLOCK_TYPES + IQ_TYPES, ids=lambda t: t.name)
def test_random_blocks_match_gguf_py(qtype):
    rng = np.random.default_rng(int(qtype))
    shape = (64, 2 * GGML_QUANT_SIZES[qtype][0])
    raw = random_blocks(qtype, shape, rng)
    np.testing.assert_array_equal(ours(raw, qtype, shape), reference(raw, qtype))


@pytest.mark.parametrize("qtype", BLOCK_TYPES + IQ_TYPES, ids=lambda t: t.name)
def test_expert_tensor_and_expert_slice(qtype):
    rng = np.random.default_rng(1000 + int(qtype))
    shape = (3, 5, 256)
    raw = random_blocks(qtype, shape, rng)
    raw.flags.writeable = False  # as the mmap view is
    ref = reference(raw, qtype)
    assert ref.shape == shape
    np.testing.assert_array_equal(ours(raw, qtype, shape), ref)

    qt = QuantTensor("blk.0.ffn_up_exps.weight", int(qtype), shape, raw)
    expert = qt[1]
    assert expert.shape == (5, 256) and expert.name == "blk.0.ffn_up_exps.weight[1]"
    assert np.shares_memory(expert.data, raw)
    np.testing.assert_array_equal(dequantize(expert).numpy(), ref[1])


def test_read_only_data_does_not_warn():
    raw = random_blocks(T.Q4_K, (4, 256), np.random.default_rng(7))
    raw.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dequantize(QuantTensor("t", int(T.Q4_K), (4, 256), raw))
        f32 = np.zeros((2, 3), np.float32)
        f32.flags.writeable = False
        dequantize(QuantTensor("f", int(T.F32), (2, 3), f32))


@pytest.mark.parametrize("qtype", FLOAT_TYPES, ids=lambda t: t.name)
def test_float_types(qtype):
    x = np.random.default_rng(3).standard_normal((2, 3, 8)).astype(np.float32)
    # As GGUFReader hands them out: F32/F16 as typed arrays, BF16 as raw bytes.
    raw = gq.quantize(x, qtype)
    raw.flags.writeable = False
    got = ours(raw, qtype, x.shape)
    np.testing.assert_array_equal(got, gq.dequantize(raw, qtype))
    if qtype == T.F32:
        np.testing.assert_array_equal(got, x)


# quantize -> our dequantize: gguf-py has quantizers for these. The bound is the worst-case
# rounding error of each format as a fraction of the block's largest magnitude (Q4_0/Q5_0 clip
# the most negative-side code, MXFP4's floor(log2) scale can clip the top code).
ROUND_TRIP = {T.Q8_0: 1 / 120, T.Q4_0: 1 / 7.5, T.Q4_1: 1 / 14, T.Q5_0: 1 / 15, T.Q5_1: 1 / 30,
              T.MXFP4: 1 / 4}


@pytest.mark.parametrize("qtype", list(ROUND_TRIP), ids=lambda t: t.name)
def test_round_trip_through_gguf_py_quantizer(qtype):
    elems = GGML_QUANT_SIZES[qtype][0]
    rng = np.random.default_rng(2000 + int(qtype))
    x = (rng.standard_normal((16, 8 * elems)) * 10.0 ** rng.uniform(-3, 2, (16, 1))).astype(np.float32)
    raw = gq.quantize(x, qtype)
    got = ours(raw, qtype, x.shape)
    np.testing.assert_array_equal(got, reference(raw, qtype))

    amax = np.abs(x.reshape(-1, elems)).max(axis=1, keepdims=True)
    err = np.abs(got - x).reshape(-1, elems)
    assert (err <= amax * ROUND_TRIP[qtype]).all(), float((err / amax).max())


def test_mxfp4_every_exponent():
    """All 256 E8M0 bytes, subnormal (0, 1) and overflowing (255: 12 * 2**127) ones included."""
    rng = np.random.default_rng(5)
    blocks = rng.integers(0, 256, size=(256, 17), dtype=np.uint8)
    blocks[:, 0] = np.arange(256)
    with np.errstate(over="ignore"):
        ref = gq.dequantize(blocks, T.MXFP4)
    got = ours(blocks, T.MXFP4, (256, 32))
    np.testing.assert_array_equal(got, ref)


def test_mxfp4_known_values():
    """OCP MX: E8M0 byte 127 is scale 1.0; e2m1 codes 0-7 are 0, .5, 1, 1.5, 2, 3, 4, 6, and
    8-15 their negatives. Byte 0 is 2**-127 (so code 1 gives the float32 subnormal 2**-128)."""
    codes = np.arange(16, dtype=np.uint8)
    qs = np.concatenate([codes[0::2] | (codes[1::2] << 4)] * 2)  # 16 bytes: codes 0,2,..,14 | 1,3,..,15
    blocks = np.stack([np.concatenate([[e], qs]).astype(np.uint8) for e in (127, 0, 130)])
    e2m1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    row = np.concatenate([e2m1[0::2], e2m1[0::2], e2m1[1::2], e2m1[1::2]])
    got = ours(blocks, T.MXFP4, (3, 32))
    np.testing.assert_array_equal(got[0], row)
    np.testing.assert_array_equal(got[1], row * np.float32(2.0**-127))
    assert got[1][16 + 0] == np.float32(2.0**-128)  # code 1
    np.testing.assert_array_equal(got[2], row * 8)


@pytest.mark.parametrize("qtype", [T.Q8_1, T.Q8_K], ids=lambda t: t.name)
def test_unsupported_type_names_tensor_and_type(qtype):
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    qt = QuantTensor("blk.3.ffn_down_exps.weight", int(qtype), (2, elems),
                     np.zeros((2, nbytes), np.uint8))
    with pytest.raises(UnsupportedQuantType) as e:
        dequantize(qt)
    assert "blk.3.ffn_down_exps.weight" in str(e.value) and qtype.name in str(e.value)


@pytest.mark.parametrize("name, cls", [("iq2xxs", gq.IQ2_XXS), ("iq2xs", gq.IQ2_XS), ("iq2s", gq.IQ2_S),
                                       ("iq3xxs", gq.IQ3_XXS), ("iq3s", gq.IQ3_S), ("iq1s", gq.IQ1_S)])
def test_iq_grids_match_gguf_py(name, cls):
    cls.init_grid()
    np.testing.assert_array_equal(iq_grids.grid(name).numpy().astype(np.float32), cls.grid.reshape(cls.grid_shape))


def test_iq_grid_entries_from_ggml_common_h():
    """A few words as ggml-common.h lists them: each uint64/uint32's bytes in memory order."""
    def entry(name, i):
        return bytes(iq_grids.grid(name)[i].to(torch.uint8).tolist())
    assert entry("iq2xxs", 1) == (0x080808080808082B).to_bytes(8, "little")
    assert entry("iq2xs", 511) == (0x2B2B2B2B2B2B2B2B).to_bytes(8, "little")
    assert entry("iq3xxs", 0) == (0x04040404).to_bytes(4, "little")
    assert entry("iq3s", 0) == (0x01010101).to_bytes(4, "little")
    assert entry("iq1s", 1) == (0xFFFFFFFFFFFFFF01).to_bytes(8, "little")


def test_ksigns_and_kvalues_match_gguf_py():
    assert bytes(iq_grids.ksigns().tolist()) == gq.IQ2_XXS.ksigns
    assert iq_grids.KVALUES_IQ4NL == gq.IQ4_NL.kvalues


def test_iq4_nl_known_values():
    """Nibble j of the 16 bytes is code j for the low halves and j+16 for the high ones."""
    codes = np.arange(16, dtype=np.uint8)
    block = np.concatenate([np.float16(0.5).reshape(1).view(np.uint8), codes | (codes[::-1] << 4)])
    got = ours(block.reshape(1, 18), T.IQ4_NL, (1, 32))[0]
    kv = np.array(iq_grids.KVALUES_IQ4NL, np.float32) * 0.5
    np.testing.assert_array_equal(got, np.concatenate([kv, kv[::-1]]))


def test_byte_count_mismatch_is_an_error():
    raw = np.zeros((2, 34), np.uint8)
    with pytest.raises(ValueError, match="bad.weight"):
        dequantize(QuantTensor("bad.weight", int(T.Q8_0), (2, 64), raw))


def test_llama_cpp_fixtures():
    if not FIXTURES.is_dir():
        pytest.skip("../shared/fixtures not found: llama.cpp-made fixtures live beside the clone in CI")
    files = sorted(FIXTURES.rglob("*.gguf"))
    assert files, f"no *.gguf under {FIXTURES}"
    seen: set[str] = set()
    for path in files:
        for t in GGUFReader(path, "r").tensors:
            qtype = T(t.tensor_type)
            shape = tuple(int(d) for d in reversed(t.shape))
            got = ours(t.data, qtype, shape, t.name)
            ref = gq.dequantize(t.data, qtype).reshape(shape)
            np.testing.assert_array_equal(got, ref, err_msg=f"{path.name}: {t.name} ({qtype.name})")
            seen.add(qtype.name)
    # The fixtures are meant to cover these; if they stop doing so, this test lost coverage.
    assert {"Q8_0", "Q4_K", "Q6_K", "MXFP4", "F32"} <= seen, seen
