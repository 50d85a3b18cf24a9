"""Weights packed by 16 rows at load (kernels/csrc/repack.cpp) against the same references as the
in-place kernels (tests/kernels/test_native.py): the exact product of the int8-rounded activations
up to float32 summation, on every ISA this CPU can run. Packing happens only where the CPU's ISA
has the SIMD kernel for it (AVX-512); a weight packed there must still run when the ISA is then
lowered (the portable kernel), and a CPU without it keeps every weight in place.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from splitmoe.kernels import native
from splitmoe.kernels.moe import ACT_SILU, ACT_SWIGLU_OAI
from tests.kernels.test_native import (
    ISAS,
    MOE_TOL_EMULATED,
    E,
    K,
    RefFFN,
    check_matmul,
    make_experts,
    moe_reference,
    qt,
    rel_l2,
)

pytestmark = pytest.mark.skipif(not native.AVAILABLE, reason=f"native kernels unavailable: {native.UNAVAILABLE_REASON}")

PACKABLE = [T.Q4_K, T.Q6_K, T.Q8_0, T.MXFP4]


def packs_here(qtype: T) -> bool:
    """Whether this CPU's best ISA has a packed kernel for the type (AVX-512 BW or VNNI)."""
    return native.repack_enabled() and bool(native._lib.smk_packed_fast(int(qtype)))


def needs_packing(qtype: T):
    if not packs_here(qtype):
        pytest.skip(f"no packed {qtype.name} kernel on {native._best_isa()} (weights stay in place there)")


@pytest.fixture(params=ISAS)
def lowered(request):
    """Runs the test's calls at each ISA after its weights were packed at the best one."""
    yield lambda: native._set_isa(request.param)
    native._set_isa(native._best_isa())


@pytest.mark.parametrize("qtype", PACKABLE, ids=lambda t: t.name)
@pytest.mark.parametrize("rows, k", [(16, 256), (48, 2048), (32, 768)])
def test_packed_matmul_every_token_count(qtype, rows, k, lowered):
    needs_packing(qtype)
    w = qt(qtype, (rows, k), seed=rows + k)
    mm = native.WeightMatmul(w, pack=True)
    assert mm.packed == (True,)
    lowered()
    gen = torch.Generator().manual_seed(k)
    for m in [*range(1, 18), 37]:  # every tile size up to two full tiles of 8 (one of 16 for Q8_0, MXFP4), a remainder
        x = torch.randn(m, k, generator=gen)
        check_matmul(mm(x), x, w, (qtype.name, native.isa(), rows, k, m))


@pytest.mark.parametrize("qtype", [T.Q8_0, T.MXFP4], ids=lambda t: t.name)
@pytest.mark.parametrize("k", [96, 2880])
def test_packed_32_value_blocks_rows_of_whole_blocks_not_super_blocks(qtype, k, lowered):
    """Q8_0 and MXFP4 pack by 32-value blocks: rows such as gpt-oss's 2880 (not a multiple of 256) too."""
    needs_packing(qtype)
    w = qt(qtype, (32, k), seed=k)
    mm = native.WeightMatmul(w, pack=True)
    assert mm.packed == (True,)
    lowered()
    gen = torch.Generator().manual_seed(k)
    for m in (1, 3, 8, 13):
        x = torch.randn(m, k, generator=gen)
        check_matmul(mm(x), x, w, (qtype.name, native.isa(), k, m))


def test_packed_beside_in_place_weights_in_one_call():
    """q, k and v as the attention side fuses them: packed and unpacked rows in one work list."""
    needs_packing(T.Q4_K)
    ws = [qt(T.Q4_K, (32, 512), seed=1, name="q"), qt(T.Q4_K, (19, 512), seed=2, name="k"),
          qt(T.Q5_0, (16, 512), seed=3, name="v"), qt(T.Q6_K, (16, 512), seed=4, name="o"),
          qt(T.Q8_0, (16, 512), seed=6, name="g")]
    mm = native.WeightMatmul(*ws, pack=True)
    # 19 rows: not whole groups; Q5_0: no packed layout; Q8_0 packed where VNNI is (unsigned bytes)
    assert mm.packed == (True, False, False, True, packs_here(T.Q8_0))
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(0))
    for part, w in zip(mm(x).split(mm.sizes, dim=1), ws):
        check_matmul(part, x, w, w.name)


def test_packing_is_off_when_asked_and_in_place_is_the_default(monkeypatch):
    w = qt(T.Q4_K, (32, 512), seed=5)
    assert native.WeightMatmul(w).packed == (False,)
    monkeypatch.setenv("SPLITMOE_KERNELS_REPACK", "0")
    assert native.WeightMatmul(w, pack=True).packed == (False,)
    assert native.MoELayer(make_experts(ACT_SILU, False, types=(T.Q4_K, T.Q4_K, T.Q4_K)), E).packed_bytes == 0


def test_packed_and_in_place_agree_to_float32_summation():
    needs_packing(T.Q4_K)
    w = qt(T.Q4_K, (64, 1024), seed=9)
    x = torch.randn(11, 1024, generator=torch.Generator().manual_seed(9))
    a, b = native.WeightMatmul(w)(x), native.WeightMatmul(w, pack=True)(x)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(a.abs().max()))


@pytest.mark.parametrize("tokens, activation, biases, up, down", [(1, ACT_SILU, False, T.Q4_K, T.Q4_K),
                                                                  (64, ACT_SWIGLU_OAI, True, T.Q4_K, T.Q6_K),
                                                                  (5, ACT_SWIGLU_OAI, True, T.MXFP4, T.MXFP4),
                                                                  (9, ACT_SILU, False, T.Q8_0, T.Q8_0)])
def test_moe_layer_with_packed_experts(tokens, activation, biases, up, down, lowered):
    """Experts as the seeds ship them: Qwen's Q4_K/Q6_K, gpt-oss's MXFP4 (biased, clamped SwiGLU), Q8_0."""
    needs_packing(up)
    needs_packing(down)
    experts = make_experts(activation, biases, types=(up, up, down), seed=tokens + 7)
    layer = native.MoELayer(experts, E)
    per_expert = sum(native._lib.smk_packed_size(int(m.ggml_type), *m.shape)
                     for m in (experts[0].gate, experts[0].up, experts[0].down))
    assert layer.packed_bytes == E * per_expert
    lowered()
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, experts[0].gate.shape[1], generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, K, generator=gen), -1)
    got = layer.forward(x, ids, weights)
    # against the float64 definition with the kernels' int8 roundings (test_native's tight check;
    # its loose one measures this random data's quantization error, not the kernel)
    ffns = {e: RefFFN(f) for e, f in experts.items()}
    assert rel_l2(got, moe_reference(x, ids, weights, ffns, quantized=True)) <= MOE_TOL_EMULATED


def test_repack_refuses_what_it_cannot_pack():
    lib = native._lib
    assert lib.smk_packed_size(int(T.Q4_K), 19, 256) == 0  # rows not whole groups of 16
    assert lib.smk_packed_size(int(T.Q4_K), 16, 100) == 0
    assert lib.smk_packed_size(int(T.Q5_0), 16, 256) == 0  # no packed layout for the type
    assert lib.smk_packed_size(int(T.Q8_0), 16, 96) == 16 // 16 * 3 * 544  # Q8_0: whole 32-value blocks
    assert lib.smk_packed_size(int(T.Q8_0), 16, 100) == 0
    src = np.zeros((19, 144), dtype=np.uint8)
    out = np.zeros(4096, dtype=np.uint8)
    assert lib.smk_repack(int(T.Q4_K), src.ctypes.data, 144, 19, 256, out.ctypes.data) == -1
