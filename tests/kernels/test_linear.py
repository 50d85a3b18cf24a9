"""kernels.linear: quantized linears and embeddings against exact dequantize + matmul in float64.

The native route quantizes activations to int8 (per block of at most 256 values, scale amax/127,
round to nearest, as ggml's Q8_0/Q8_K): each product then errs by at most ‖w_block‖₁·amax/254
per block, which is the bound checked, plus float32 rounding. The GEMM route multiplies the
exact dequantized weights in float32. The fallback (no native library, or a type it lacks) keeps
a dense copy in the model's dtype.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

import splitmoe.kernels.linear as kl
from splitmoe.kernels.cpu_features import GEMM_DTYPE_ENV
from splitmoe.kernels.linear import QuantEmbedding, QuantLinear, linear
from splitmoe.kernels.quants import QuantTensor, dequantize
from tests.kernels.test_native import IQ_TYPES as NATIVE_IQ_TYPES
from tests.kernels.test_quants import IQ_TYPES, random_blocks

NATIVE_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4, *NATIVE_IQ_TYPES]
F32_EPS = 2.0 ** -24


def quant_tensor(qtype: T, n: int, k: int, seed: int = 0) -> QuantTensor:
    raw = random_blocks(qtype, (n, k), np.random.default_rng(seed))
    raw.setflags(write=False)  # as the mmap views are
    return QuantTensor(f"w_{qtype.name}", int(qtype), (n, k), raw)


def exact(x: torch.Tensor, qt: QuantTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ W.T, |x| @ |W|.T) in float64."""
    w = dequantize(qt).double()
    return x.double() @ w.T, x.double().abs() @ w.abs().T


def int8_bound(x: torch.Tensor, qt: QuantTensor, block: int = 256) -> torch.Tensor:
    """Σ over blocks of ‖w_block‖₁ · amax(x_block) / 254: the int8 activation rounding's reach."""
    w = dequantize(qt).double().abs()
    m, k = x.shape
    block = min(block, k)
    amax = x.double().abs().view(m, k // block, block).amax(-1)  # [m, blocks]
    w_l1 = w.view(w.shape[0], k // block, block).sum(-1)  # [n, blocks]
    return amax @ w_l1.T / 254


@pytest.fixture
def native_module():
    mod = kl.native()
    if mod is None:
        pytest.skip("native kernels not built")
    return mod


@pytest.mark.parametrize("qtype", NATIVE_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, kl.SMALL_BATCH_ROWS])
def test_few_rows_take_the_int8_kernel_within_its_rounding(native_module, qtype, m):
    k = 512 if GGML_QUANT_SIZES[qtype][0] == 256 else 256
    qt = quant_tensor(qtype, 48, k, seed=m)
    lin = QuantLinear(qt)
    assert lin.route == "native" and lin.dense is None
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    got = lin(x)
    want, mag = exact(x, qt)
    assert got.dtype == torch.float32 and got.shape == (m, 48)
    assert ((got.double() - want).abs() <= int8_bound(x, qt) * 1.01 + 1e-5 * mag + 1e-30).all()
    # the int8 rounding is real (not a float path in disguise), and far inside the bound
    assert (got.double() - want).abs().max() > 0


# What the many-rows route's error may reach, by GEMM dtype (`mag` = |x| @ |W|.T):
# float32 products summed in float32: the recursive-summation bound γ_k ≈ k·eps;
# bfloat16 inputs: x and W each rounded once (2^-9 each), products summed in float32.
GEMM_BOUND = {"float32": lambda k: 2 * k * F32_EPS, "bfloat16": lambda k: 2 ** -7}


@pytest.mark.parametrize("gemm", list(GEMM_BOUND))
@pytest.mark.parametrize("qtype", NATIVE_TYPES, ids=lambda t: t.name)
def test_many_rows_take_dequantize_and_gemm(native_module, qtype, gemm, monkeypatch):
    """Both GEMM dtypes on every CPU (SPLITMOE_GEMM_DTYPE forces one), each held to its own bound."""
    monkeypatch.setenv(GEMM_DTYPE_ENV, gemm)
    monkeypatch.setattr(kl, "CHUNK_ELEMS", 7 * 256)  # several chunks, the last one short
    k = 256
    qt = quant_tensor(qtype, 40, k, seed=1)
    lin = QuantLinear(qt)
    assert len(lin._chunks) == 6
    m = kl.SMALL_BATCH_ROWS + 5
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2))
    got = lin(x)
    want, mag = exact(x, qt)
    assert got.dtype == torch.float32
    assert ((got.double() - want).abs() <= GEMM_BOUND[gemm](k) * mag + 1e-30).all()


def test_bias_and_leading_dims(native_module):
    qt = quant_tensor(T.Q8_0, 24, 64)
    lin = QuantLinear(qt)
    bias = torch.randn(24)
    for x in (torch.randn(2, 3, 64), torch.randn(2, 30, 64)):  # int8 route, then GEMM route
        got = linear(x.bfloat16(), lin, bias)
        assert got.shape == (*x.shape[:-1], 24) and got.dtype == torch.float32
        flat = x.bfloat16().float().reshape(-1, 64)
        want, mag = exact(flat, qt)
        tol = int8_bound(flat, qt, 64) * 1.01 + 2 * 64 * F32_EPS * mag + 1e-6
        assert ((got.reshape(-1, 24).double() - bias.double() - want).abs() <= tol).all()


def test_fallback_without_native_is_a_dense_copy_in_the_model_dtype(monkeypatch):
    monkeypatch.setattr(kl, "_native_module", None)
    qt = quant_tensor(T.Q4_K, 16, 256)
    lin = QuantLinear(qt, dtype=torch.bfloat16)
    assert lin.route == "dense" and lin.dense.dtype == torch.bfloat16
    assert torch.equal(lin.dense, dequantize(qt).bfloat16())
    for m in (1, 40):
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
        got = lin(x)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, torch.nn.functional.linear(x.bfloat16(), lin.dense).float())
    emb = QuantEmbedding(qt, torch.bfloat16)
    ids = torch.tensor([[3, 0], [15, 3]])
    assert torch.equal(emb[ids], dequantize(qt)[ids])


def test_type_without_a_native_matmul_falls_back(native_module):
    assert not native_module.supports(int(T.Q3_K))
    qt = quant_tensor(T.Q3_K, 8, 256)
    lin = QuantLinear(qt, dtype=torch.float32)
    assert lin.route == "dense"
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(0))
    want, mag = exact(x, qt)
    assert ((lin(x).double() - want).abs() <= 2 * 256 * F32_EPS * mag + 1e-30).all()


@pytest.mark.parametrize("qtype", IQ_TYPES, ids=lambda t: t.name)
def test_iq_types_as_linears_and_embeddings(qtype, monkeypatch):
    """With or without a native kernel for the type (and with no native library): each takes the
    route its type has, within that route's bound, and an embedding gives the exact rows."""
    monkeypatch.setenv(GEMM_DTYPE_ENV, "float32")
    qt = quant_tensor(qtype, 32, 256, seed=int(qtype))
    nat = kl.native()
    native_matmul = nat is not None and nat.supports(int(qtype))
    lin = QuantLinear(qt, dtype=torch.float32)
    assert lin.route == ("native" if native_matmul else "dense")
    for m in (1, kl.SMALL_BATCH_ROWS + 5):
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
        want, mag = exact(x, qt)
        int8 = native_matmul and m <= kl.SMALL_BATCH_ROWS
        bound = int8_bound(x, qt) * 1.01 + 1e-5 * mag if int8 else 2 * 256 * F32_EPS * mag
        assert ((lin(x).double() - want).abs() <= bound + 1e-30).all()
    ids = torch.tensor([[5, 0], [31, 5]])
    assert torch.equal(QuantEmbedding(qt, torch.bfloat16)[ids], dequantize(qt)[ids])


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.Q4_0], ids=lambda t: t.name)
def test_embedding_dequantizes_only_the_rows_looked_up(native_module, qtype):
    qt = quant_tensor(qtype, 64, 256)
    emb = QuantEmbedding(qt, torch.bfloat16)
    ids = torch.tensor([5, 0, 63, 5])
    got = emb[ids]
    assert got.dtype == torch.float32 and emb.dtype == torch.bfloat16
    assert torch.equal(got, dequantize(qt)[ids])
    with pytest.raises(IndexError):
        emb[torch.tensor([64])]


def test_dense_weights_keep_torch_semantics():
    w = torch.randn(6, 8, dtype=torch.bfloat16)
    x = torch.randn(3, 8)
    b = torch.randn(6)
    got = linear(x, w, b)  # float32 input meets a bfloat16 weight: computed in the weight's dtype
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, torch.nn.functional.linear(x.bfloat16(), w, b.bfloat16()))
    w32 = w.float()
    assert torch.equal(linear(x, w32, b), torch.nn.functional.linear(x, w32, b))


def test_prepared_weight_matches_native_matmul(native_module):
    qt = quant_tensor(T.Q4_K, 33, 512)
    lin = QuantLinear(qt)
    x = torch.randn(4, 512)
    assert torch.equal(lin(x), native_module.matmul(x, qt))
    with pytest.raises(ValueError):
        lin(torch.randn(1, 256))


def test_rejects_what_is_not_a_quantized_matrix():
    with pytest.raises(ValueError):
        QuantLinear(QuantTensor("v", int(T.Q8_0), (64,), np.zeros((2, 34), np.uint8)))
    with pytest.raises(ValueError):
        QuantLinear(QuantTensor("f", int(T.F32), (2, 4), np.zeros((2, 4), np.float32)))


@pytest.mark.parametrize("one_gemm", [True, False])
@pytest.mark.parametrize("m", [1, 3, kl.SMALL_BATCH_ROWS, kl.SMALL_BATCH_ROWS + 1, 70])
def test_group_of_linears_equals_each_alone(native_module, m, one_gemm, monkeypatch):
    """q, k, v of other types and widths: few rows in one fused call (activations quantized once,
    as each alone quantizes them the same way), many rows in one GEMM over the weights stacked (or,
    past a chunk, each on its own route): equal either way."""
    if not one_gemm:
        monkeypatch.setattr(kl, "CHUNK_ELEMS", 100 * 512)
    ws = [QuantLinear(quant_tensor(T.Q4_K, 64, 512, seed=1)), QuantLinear(quant_tensor(T.Q6_K, 16, 512, seed=2)),
          QuantLinear(quant_tensor(T.Q8_0, 48, 512, seed=3))]
    biases = (torch.randn(64), None, torch.randn(48))
    group = kl.LinearGroup(*ws)
    assert group._fused is not None and group._fused.sizes == (64, 16, 48) and group._one_gemm == one_gemm
    x = torch.randn(2, m, 512, generator=torch.Generator().manual_seed(m)) if m > 1 else torch.randn(m, 512)
    got = group(x, biases)
    for g, w, b in zip(got, ws, biases):
        assert g.shape == (*x.shape[:-1], w.out_features)
        assert torch.equal(g, linear(x, w, b))


def test_a_group_with_a_dense_weight_is_each_alone(native_module):
    q = QuantLinear(quant_tensor(T.Q4_K, 16, 256))
    dense = torch.randn(8, 256)
    group = kl.LinearGroup(q, dense)
    assert group._fused is None
    x = torch.randn(1, 256)
    a, b = group(x)
    assert torch.equal(a, q(x)) and torch.equal(b, linear(x, dense))


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q6_K, T.Q4_K, T.IQ2_XXS], ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, kl.SMALL_BATCH_ROWS, kl.SMALL_BATCH_ROWS + 4])
@pytest.mark.parametrize("rows", [24, 32])
def test_per_head_maps_each_head_on_its_own_rows(native_module, qtype, m, rows):
    """QuantHeads (MLA's attn_k_b / attn_v_b): head h of x [T, H, k] through map h only; few rows within
    the int8 kernel's rounding bound (each head packed by 16 rows where the ISA packs the type and the
    rows are whole groups, in place otherwise), many rows on the dense copy (model dtype bfloat16)."""
    heads, k = 5, 256
    qt = quant_tensor(qtype, heads * rows, k, seed=m)
    maps = kl.QuantHeads(QuantTensor("maps", qt.ggml_type, (heads, rows, k), qt.data), dtype=torch.bfloat16)
    assert maps._native.packed == (rows == 32 and bool(native_module._lib.smk_packed_fast(int(qtype)))
                                   and native_module.repack_enabled())
    x = torch.randn(m, heads, k, generator=torch.Generator().manual_seed(m))
    got = maps(x)
    assert got.shape == (m, heads, rows) and got.dtype == torch.float32
    for h in range(heads):
        part = QuantTensor("h", qt.ggml_type, (rows, k), qt.data[h * rows:(h + 1) * rows])
        want, mag = exact(x[:, h], part)
        if m <= kl.SMALL_BATCH_ROWS:
            tol = int8_bound(x[:, h], part) * 1.01 + 1e-5 * mag + 1e-30
        else:  # bfloat16 copy and inputs (2^-9 each), float32 sums
            tol = 2 ** -7 * mag + 1e-30
        assert ((got[:, h].double() - want).abs() <= tol).all(), h
