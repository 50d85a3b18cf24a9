"""kernels.native (the C++ kernels) against float64 references built from kernels.quants.

matmul quantizes the activations to int8 per block of 32 (scale = max|x| / 127), so its result
differs from the exact product by the rounding of x: uniform within half a step (max|x| / 127),
i.e. a standard deviation of step / sqrt(12). For Gaussian x a block's max is about 2.07 sigma,
so that is 0.47% of sigma, and a dot product with independent weights carries the same relative
error: 0.5% rel-L2 expected, 0.46-0.57% measured over every format. The bound used, 1e-2,
leaves headroom for that and is far below what any wrong scale, offset, nibble order or sign
would give (those err by O(1)). A second, much tighter check compares with the exact product of
the int8-rounded activations (emulated in torch), where only float32 summation differs. Every
ISA this CPU can run is tested, all against the same references.
"""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from splitmoe.kernels import native
from splitmoe.kernels.moe import ACT_SILU, ACT_SWIGLU_OAI, ExpertFFN, moe_forward
from splitmoe.kernels.quants import QuantTensor, dequantize
from tests.kernels.test_quants import BLOCK_TYPES, FLOAT_TYPES, FP16_FIELDS, random_blocks

pytestmark = pytest.mark.skipif(not native.AVAILABLE, reason=f"native kernels unavailable: {native.UNAVAILABLE_REASON}")

# The IQ types with int8 kernels (the ternary ones take kernels.quants' dequantization).
IQ_TYPES = [T.IQ4_NL, T.IQ4_XS, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M]
MATMUL_TYPES = [T.Q4_K, T.Q6_K, T.Q8_0, T.Q4_0, T.MXFP4, T.Q5_K, T.Q5_0, T.Q5_1, T.Q4_1, *IQ_TYPES]
TOL = 1e-2


def _isas() -> list[str]:
    if not native.AVAILABLE:
        return ["scalar"]
    order = ["scalar", "avx2", "avx512bw", "avx512vnni"]
    return order[: order.index(native._best_isa()) + 1]


ISAS = _isas()


@pytest.fixture(params=ISAS)
def isa(request):
    native._set_isa(request.param)
    yield request.param
    native._set_isa(native._best_isa())


def qt(qtype: T, shape: tuple[int, ...], seed: int, name: str = "w") -> QuantTensor:
    raw = random_blocks(qtype, shape, np.random.default_rng(seed))
    raw.flags.writeable = False  # as the mmap view is
    return QuantTensor(name, int(qtype), shape, raw)


def tame(qtype: T, shape: tuple[int, ...], seed: int, name: str, scale: float) -> QuantTensor:
    """Random blocks with every fp16 scale (and min) in [scale/2, scale]: weights of one
    magnitude, as trained ones are, so that an MoE's output is O(1)."""
    rng = np.random.default_rng(seed)
    raw = random_blocks(qtype, shape, rng)
    elems, nbytes = GGML_QUANT_SIZES[qtype]
    bl = raw.reshape(-1, nbytes)
    for off in FP16_FIELDS[qtype]:
        d = (rng.uniform(0.5, 1.0, len(bl)) * scale).astype(np.float16)
        bl[:, off:off + 2] = d.view(np.uint8).reshape(-1, 2)
    if qtype == T.MXFP4:
        bl[:, 0] = 127 + int(np.round(np.log2(scale))) + rng.integers(-1, 1, len(bl))
    if qtype in (T.Q4_K, T.Q5_K):  # 6-bit scales and mins: keep the mins below the scales' reach
        pass
    raw.flags.writeable = False
    return QuantTensor(name, int(qtype), shape, raw)


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-300))


def ref_matmul(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    return x.double() @ dequantize(w).double().T


def quantize_act(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels see it: int8 per block of 32, scale max|x| / 127 (float32 ops as in C)."""
    b = x.float().reshape(x.shape[0], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    # a true division (the scalar 127.0 / amax is computed as 127 * (1 / amax): rounds differently)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(b * inv).clamp(-127, 127)
    return (q.double() * (amax / 127.0).double()).reshape(x.shape)


def check_matmul(got: torch.Tensor, x: torch.Tensor, w: QuantTensor, what) -> float:
    """Tight: equal to the exact product of the int8-quantized activations up to float32
    summation error. Returns the rel-L2 error against the exact product of x."""
    wd = dequantize(w).double()
    xq = quantize_act(x)
    bound = 2e-6 * (xq.abs() @ wd.abs().T) + 1e-30
    assert ((got.double() - xq @ wd.T).abs() <= bound).all(), what
    return rel_l2(got, x.double() @ wd.T)


def test_reports_isa_and_threads():
    assert native.isa() in ("avx512vnni", "avx512bw", "avx2", "scalar")
    assert native.get_num_threads() >= 1
    assert all(native.supports(int(t)) for t in MATMUL_TYPES)
    assert not native.supports(int(T.F32)) and not native.supports(int(T.TQ1_0))


@pytest.mark.parametrize("qtype", MATMUL_TYPES, ids=lambda t: t.name)
def test_matmul_every_type_and_isa(qtype, isa):
    elems = GGML_QUANT_SIZES[qtype][0]
    gen = torch.Generator().manual_seed(int(qtype))
    for i, (m, n, k) in enumerate([(1, 19, elems), (37, 21, 3 * max(256, elems)), (4, 5, 2 * 256 + (32 if elems == 32 else 0))]):
        w = qt(qtype, (n, k), seed=100 * int(qtype) + i)
        x = torch.randn(m, k, generator=gen)
        got = native.matmul(x, w)
        assert got.dtype == torch.float32 and got.shape == (m, n)
        err = check_matmul(got, x, w, (qtype.name, isa, m, n, k))
        if m * n > 100:  # enough dot products for the error's average to be a fair bound
            assert err <= TOL, (qtype.name, isa, m, n, k, err)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0, T.MXFP4, *IQ_TYPES], ids=lambda t: t.name)
def test_matmul_every_token_tile(qtype, isa):
    """Every token count up to two full tiles and a remainder (the SIMD kernels decode a weight
    block once for up to 8 tokens, 16 for the IQ grid formats), against the exact product of the
    quantized activations. MXFP4 and IQ4_NL rows end in a 32-value tail after two 256-value groups,
    as gpt-oss's 2880 does."""
    k = 544 if qtype in (T.MXFP4, T.IQ4_NL) else 512
    w = qt(qtype, (9, k), seed=11 + int(qtype))
    gen = torch.Generator().manual_seed(int(qtype))
    for m in [*range(1, 20), 31, 32, 37]:
        x = torch.randn(m, k, generator=gen)
        check_matmul(native.matmul(x, w), x, w, (qtype.name, isa, m))


def test_vbmi_grid_decoder_bit_identical():
    """IQ3_XXS's grid rows by byte permutations (VBMI) give the per-row lookups' results bit for bit,
    every token tile and a row longer than one super-block."""
    if native._best_isa() != "avx512vnni" or not native._set_vbmi(True):
        pytest.skip("this CPU has no AVX-512 VBMI kernels (Zen 4 and later, Ice Lake and later have them)")
    native._set_isa("avx512vnni")
    try:
        w = qt(T.IQ3_XXS, (37, 3 * 256), seed=5)
        gen = torch.Generator().manual_seed(5)
        for m in (1, 2, 7, 16, 17, 40):
            x = torch.randn(m, 3 * 256, generator=gen)
            native._set_vbmi(False)
            plain = native.matmul(x, w)
            native._set_vbmi(True)
            assert torch.equal(native.matmul(x, w), plain), m
    finally:
        native._set_vbmi(True)
        native._set_isa(native._best_isa())


def test_isas_agree_closely():
    """The SIMD paths compute the same integer sums as the scalar one: only float summation
    order differs."""
    w = qt(T.Q4_K, (33, 512), seed=7)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(7))
    results = {}
    for name in ISAS:
        native._set_isa(name)
        results[name] = native.matmul(x, w)
    native._set_isa(native._best_isa())
    for name, r in results.items():
        assert float((r - results["scalar"]).abs().max()) <= 1e-5 * float(r.abs().max()), name


def test_matmul_inputs():
    w = qt(T.Q8_0, (7, 64), seed=1)
    base = torch.randn(64, 3, generator=torch.Generator().manual_seed(1))
    x = base.T  # not contiguous
    assert not x.is_contiguous()
    check_matmul(native.matmul(x, w), x, w, "non-contiguous")
    out = torch.full((3, 7), 5.0)
    assert native.matmul(x, w, out=out) is out  # overwritten, not added
    check_matmul(out, x, w, "out")
    assert native.matmul(torch.zeros(0, 64), w).shape == (0, 7)
    assert native.matmul(torch.zeros(2, 64), w).abs().max() == 0


@pytest.mark.parametrize("bad, match", [
    (lambda x, w: native.matmul(x.double(), w), "float32"),
    (lambda x, w: native.matmul(x[:, :32], w), "columns"),
    (lambda x, w: native.matmul(x[0], w), "2-D"),
    (lambda x, w: native.matmul(x, QuantTensor("f", int(T.F32), (2, 64), np.zeros((2, 64), np.float32))), "F32"),
    (lambda x, w: native.matmul(x, QuantTensor("s", int(T.Q8_0), (2, 64), np.zeros((2, 60), np.uint8))), "bytes"),
    (lambda x, w: native.matmul(x, w, out=torch.zeros(3, 8)), "out"),
    (lambda x, w: native.matmul(x, w, out=torch.zeros(3, 7, dtype=torch.float64)), "out"),
    (lambda x, w: native.matmul(x, "w"), "QuantTensor"),
])
def test_matmul_rejects_bad_inputs(bad, match):
    w = qt(T.Q8_0, (7, 64), seed=1)
    with pytest.raises(ValueError, match=match):
        bad(torch.randn(3, 64), w)


@pytest.mark.parametrize("qtype", BLOCK_TYPES + FLOAT_TYPES + [t for t in IQ_TYPES if t not in BLOCK_TYPES],
                         ids=lambda t: t.name)
def test_dequantize_bit_identical(qtype):
    elems = GGML_QUANT_SIZES[qtype][0]
    k = max(256, elems)
    if qtype in FLOAT_TYPES:
        x = torch.randn(13, 40, generator=torch.Generator().manual_seed(3))
        raw = gq.quantize(x.numpy(), qtype)
        w = QuantTensor("f", int(qtype), (13, 40), raw)
    else:
        w = qt(qtype, (300, k), seed=int(qtype))  # enough rows to run on the pool
    want = dequantize(w)
    got = native.dequantize(w)
    assert got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    rows = torch.tensor([5, 0, 5, w.shape[0] - 1])
    torch.testing.assert_close(native.dequantize(w, rows=rows), want[rows], rtol=0, atol=0)
    bf = native.dequantize(w, torch.bfloat16, rows=rows.int())
    assert bf.dtype == torch.bfloat16 and torch.equal(bf.view(torch.int16), want[rows].bfloat16().view(torch.int16))
    out = torch.empty(w.shape, dtype=torch.bfloat16)
    assert native.dequantize(w, torch.bfloat16, out=out) is out
    assert torch.equal(out.view(torch.int16), want.bfloat16().view(torch.int16))


@pytest.mark.parametrize("qtype", IQ_TYPES, ids=lambda t: t.name)
def test_iq_dequantize_every_isa(qtype, isa):
    """The IQ types dequantize to the same bits whatever the ISA (IQ4 with pshufb where it has AVX2)."""
    w = qt(qtype, (40, 512), seed=int(qtype) + 1)
    want = dequantize(w)
    assert torch.equal(native.dequantize(w).view(torch.int32), want.view(torch.int32)), isa
    bf = native.dequantize(w, torch.bfloat16)
    assert torch.equal(bf.view(torch.int16), want.bfloat16().view(torch.int16)), isa


def test_dequantize_expert_tensor_and_errors():
    w = qt(T.Q6_K, (3, 4, 256), seed=5)
    assert torch.equal(native.dequantize(w), dequantize(w))
    assert torch.equal(native.dequantize(w[1]), dequantize(w[1]))
    with pytest.raises(ValueError, match="out of range"):
        native.dequantize(w[0], rows=torch.tensor([4]))
    with pytest.raises(ValueError, match="dtype"):
        native.dequantize(w[0], torch.float16)
    with pytest.raises(ValueError, match="unsupported"):
        native.dequantize(QuantTensor("tq", int(T.TQ1_0), (1, 256), np.zeros((1, 54), np.uint8)))


# ---- MoE ----------------------------------------------------------------------------------------

D, FFN, E, K = 512, 256, 6, 2
# Scale per unit of the fp16 d: the IQ4 codes are O(50) (IQ4_XS's sub-block scales O(16) on top),
# the 2-bit IQ types' values O(50) per unit of d, the 3-bit ones' O(100), the other types' quants O(10).
TAME_SCALE = {T.IQ4_NL: 1e-3, T.IQ4_XS: 6e-5, T.IQ2_XXS: 1e-3, T.IQ2_XS: 1e-3, T.IQ2_S: 1e-3, T.IQ3_XXS: 4e-4,
              T.IQ3_S: 4e-4, T.IQ1_S: 1e-2}


def make_experts(activation: str, biases: bool, types=(T.Q4_K, T.Q4_K, T.Q6_K), seed: int = 0) -> dict[int, ExpertFFN]:
    gen = torch.Generator().manual_seed(seed)

    def bias(n):
        return 0.5 * torch.randn(n, generator=gen) if biases else None

    # random quants have mean |q| ~ 8-16 per unit of scale, so these keep gate/up O(1-10)
    # (swiglu_oai's clamps at 7 are reached) and the output O(1)
    sc = [TAME_SCALE.get(t, 0.003) for t in types]
    return {e: ExpertFFN(tame(types[0], (FFN, D), seed * 1000 + 3 * e, f"gate{e}", sc[0]),
                         tame(types[1], (FFN, D), seed * 1000 + 3 * e + 1, f"up{e}", sc[1]),
                         tame(types[2], (D, FFN), seed * 1000 + 3 * e + 2, f"down{e}", sc[2]),
                         bias(FFN), bias(FFN), bias(D), activation)
            for e in range(E)}


class RefFFN:
    """One expert in float64 from its exactly dequantized weights (native.dequantize: faster than
    the reference, and bit-identical to it, as test_dequantize_bit_identical checks)."""

    def __init__(self, f: ExpertFFN):
        self.w = [native.dequantize(m).double() for m in (f.gate, f.up, f.down)]
        self.b = [None if b is None else b.double() for b in (f.gate_bias, f.up_bias, f.down_bias)]
        self.activation = f.activation

    def lin(self, i: int, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.w[i].T
        return y if self.b[i] is None else y + self.b[i]

    def __call__(self, x: torch.Tensor, quantized: bool) -> torch.Tensor:
        q = quantize_act if quantized else (lambda v: v.double())
        g, u = self.lin(0, q(x)), self.lin(1, q(x))
        if self.activation == ACT_SILU:
            h = g * torch.sigmoid(g) * u
        else:
            g, u = g.clamp(max=7.0), u.clamp(-7.0, 7.0)
            h = (u + 1) * g * torch.sigmoid(1.702 * g)
        return self.lin(2, q(h.float()) if quantized else h)


def moe_reference(x, ids, weights, ffns: dict[int, RefFFN], quantized: bool = False) -> torch.Tensor:
    """The definition in float64 (each slot's weight times its expert's FFN, summed per token);
    `quantized`: with the kernels' int8 rounding of the tokens and of the intermediate
    activations (float32 there, as the kernel has them)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e, f in ffns.items():
        tok, k = (ids == e).nonzero(as_tuple=True)
        if len(tok):
            out.index_add_(0, tok, weights[tok, k].double()[:, None] * f(x[tok], quantized))
    return out


# Measured rel-L2 against the exact float64 result with these random weights: 0.1-1.8%. The
# intermediate activations are heavy-tailed (products of two Gaussians, clamped or not), so their
# per-32 int8 rounding costs more than the tokens' does, and the two roundings add up. The
# emulated reference, which rounds where the kernel does, must agree far more closely: there
# the only differences are float32 summation and the odd intermediate rounding that flips by
# one step because the kernel's float32 value differs from float64 in the last bits (measured:
# below 1e-5).
MOE_TOL, MOE_TOL_EMULATED = 3e-2, 1e-4


def check_moe(got, x, ids, weights, experts) -> None:
    ffns = {e: RefFFN(f) for e, f in experts.items()}
    assert rel_l2(got, moe_reference(x, ids, weights, ffns, quantized=True)) <= MOE_TOL_EMULATED
    assert rel_l2(got, moe_reference(x, ids, weights, ffns)) <= MOE_TOL


@pytest.mark.parametrize("tokens, activation, biases", [(1, ACT_SILU, False), (1, ACT_SWIGLU_OAI, True),
                                                        (64, ACT_SWIGLU_OAI, True)])
def test_moe_layer_matches_reference(tokens, activation, biases):
    experts = make_experts(activation, biases, seed=tokens)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, D, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)])
    if tokens > 1:
        assert set(ids.flatten().tolist()) == set(range(E))  # every expert hit
    weights = torch.softmax(torch.randn(tokens, K, generator=gen), -1)
    layer = native.MoELayer(experts, E)
    check_moe(layer.forward(x, ids, weights), x, ids, weights, experts)


def test_moe_idle_foreign_and_unhosted_experts_and_accumulation():
    experts = make_experts(ACT_SWIGLU_OAI, True, types=(T.MXFP4, T.MXFP4, T.Q8_0), seed=3)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, D, generator=gen)
    ids = torch.tensor([[0, 1], [1, 3], [-1, 0], [3, 3], [0, 1], [8, 1], [4, 0], [1, 0], [0, -1]], dtype=torch.int32)
    weights = torch.rand(9, K, generator=gen)
    shard = {e: experts[e] for e in (0, 1, 2)}  # 2 hosted but idle; 3, 4 routed but not hosted; 8 unknown
    layer = native.MoELayer(shard, 10)
    prior = torch.randn(9, D, generator=gen)
    out = prior.clone()
    assert layer.forward(x, ids.long(), weights, out=out) is out
    check_moe(out - prior, x, ids, weights, shard)
    # only tokens routed to a hosted expert changed
    untouched = out[3] - prior[3]
    assert untouched.abs().max() == 0


def test_moe_silu_q8_and_mixed_types_against_kernels_moe():
    experts = make_experts(ACT_SILU, False, types=(T.Q8_0, T.Q4_0, T.Q5_K), seed=4)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, D, generator=gen)
    ids = torch.randint(0, E, (5, K), generator=gen)
    weights = torch.rand(5, K, generator=gen)
    got = native.MoELayer(experts, E).forward(x, ids, weights)
    assert rel_l2(got, moe_forward(x, ids, weights, experts).double()) <= MOE_TOL  # the torch path


@pytest.mark.parametrize("types", [(T.IQ4_XS, T.IQ4_XS, T.IQ4_NL), (T.IQ4_NL, T.IQ4_NL, T.IQ4_XS),
                                   (T.IQ2_XXS, T.IQ2_XXS, T.IQ3_XXS), (T.IQ2_XS, T.IQ2_S, T.IQ3_S),
                                   (T.IQ1_S, T.IQ1_S, T.IQ2_XXS)],  # DeepSeek-R1's dynamic 1-bit quants
                         ids=lambda ts: "-".join(t.name for t in ts))
def test_moe_iq_types_every_isa(types, isa):
    """The IQ kernels inside the MoE layer (the intermediate activations quantized by the layer
    itself), decode and an 8-token tile and a remainder, on every ISA."""
    experts = make_experts(ACT_SILU, False, types=types, seed=6)
    layer = native.MoELayer(experts, E)
    gen = torch.Generator().manual_seed(6)
    for tokens in (1, 11):
        x = torch.randn(tokens, D, generator=gen)
        ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)])
        weights = torch.softmax(torch.randn(tokens, K, generator=gen), -1)
        check_moe(layer.forward(x, ids, weights), x, ids, weights, experts)


def test_moe_rejects_bad_inputs():
    experts = make_experts(ACT_SILU, False, seed=5)
    layer = native.MoELayer({0: experts[0]}, E)
    x, ids, w = torch.randn(2, D), torch.zeros(2, K, dtype=torch.long), torch.ones(2, K)
    for args, match in [((x.double(), ids, w), "float32"), ((x[:, :256], ids, w), "columns"),
                        ((x, ids.float(), w), "expert_ids"), ((x, ids, w[:, :1]), "expert_weights"),
                        ((x, ids[:1], w), "expert_ids")]:
        with pytest.raises(ValueError, match=match):
            layer.forward(*args)
    with pytest.raises(ValueError, match="out"):
        layer.forward(x, ids, w, out=torch.zeros(2, D + 1))
    f32 = QuantTensor("g", int(T.F32), (FFN, D), np.zeros((FFN, D), np.float32))
    with pytest.raises(ValueError, match="F32"):
        native.MoELayer({0: ExpertFFN(f32, experts[0].up, experts[0].down)}, E)
    with pytest.raises(ValueError, match="outside"):
        native.MoELayer({7: experts[0]}, E)
    assert native.MoELayer({}, E).forward(x, ids, w).abs().max() == 0


def test_threads_agree():
    w = qt(T.Q4_K, (300, 1024), seed=9)
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(9))
    n0 = native.get_num_threads()
    try:
        native.set_num_threads(1)
        one = native.matmul(x, w)
        native.set_num_threads(3)
        assert native.get_num_threads() == 3
        assert torch.equal(native.matmul(x, w), one)  # rows are independent: same bits
    finally:
        native.set_num_threads(n0)


def test_missing_library_logs_one_warning_and_falls_back(tmp_path, caplog):
    """Loaded from a folder without the .so: AVAILABLE False, a reason, one warning line, and
    the API says so instead of crashing."""
    import importlib.util
    import shutil

    shutil.copy(native.__file__, tmp_path / "native_probe.py")
    spec = importlib.util.spec_from_file_location("native_probe", tmp_path / "native_probe.py")
    probe = importlib.util.module_from_spec(spec)
    with caplog.at_level(logging.WARNING, logger="splitmoe.kernels"):
        spec.loader.exec_module(probe)
    assert probe.AVAILABLE is False and "_native" in probe.UNAVAILABLE_REASON
    lines = [r for r in caplog.records if r.name == "splitmoe.kernels"]
    assert len(lines) == 1 and "pure-torch fallback" in lines[0].getMessage()
    assert not probe.supports(int(T.Q4_K))
    with pytest.raises(RuntimeError, match="unavailable"):
        probe.matmul(torch.zeros(1, 32), qt(T.Q8_0, (1, 32), seed=0))


@pytest.mark.stack
def test_concurrent_callers_and_fork():
    """Python threads calling at once (the GIL is released: one gets the pool, the others run
    alone) get the same bits as a lone caller; a forked child (no pool threads) still works."""
    import os
    import threading
    import time

    w = qt(T.Q4_K, (512, 512), seed=11)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(11))
    n0 = native.get_num_threads()
    native.set_num_threads(2)
    try:
        want = native.matmul(x, w)
        errors = []

        def worker():
            for _ in range(20):
                if not torch.equal(native.matmul(x, w), want):
                    errors.append("mismatch")

        threads = [threading.Thread(target=worker) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        pid = os.fork()
        if pid == 0:  # child: must neither hang on the parent's pool nor crash
            ok = torch.equal(native.matmul(x, w), want)
            os._exit(0 if ok else 1)
        deadline = time.monotonic() + 30
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                pytest.fail("forked child hung")
            time.sleep(0.01)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    finally:
        native.set_num_threads(n0)


@pytest.mark.parametrize("shape", [(7,), (3, 2048), (40, 5, 128), (2, 3, 100)])
def test_rms_norm_rows_as_float64_and_views_as_copies(shape):
    """csrc/norm.cpp: each row scaled by 1 / sqrt(mean(x^2) + eps) (the sum of squares in double) and the
    weight; a head-split view of a wider projection (rows strided) gives what its contiguous copy gives."""
    gen = torch.Generator().manual_seed(len(shape))
    n = shape[-1]
    wide = torch.randn(*shape[:-1], n + 24, generator=gen) * 3
    x = wide[..., 5:5 + n]  # rows not contiguous with each other
    w = torch.randn(n, generator=gen)
    got = native.rms_norm(x, w, 1e-6)
    assert got.shape == x.shape and got.is_contiguous() and got.dtype == torch.float32
    xd = x.double()
    want = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert torch.allclose(got.double(), want, rtol=3e-7, atol=1e-7)
    assert torch.equal(got, native.rms_norm(x.contiguous(), w, 1e-6))
    torch.testing.assert_close(got, torch.nn.functional.rms_norm(x, (n,), w, 1e-6), rtol=2e-6, atol=1e-6)
    with pytest.raises(ValueError, match="rms_norm"):
        native.rms_norm(x.double(), w, 1e-6)
    with pytest.raises(ValueError, match="weight"):
        native.rms_norm(x, w[:-1], 1e-6)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dims", [64, 128])
def test_rope_rows_are_the_torch_paths_bits(interleaved, dims, monkeypatch):
    """csrc/rope.cpp against layers.Rope's torch route on the same tables: equal bits, over strided views
    (q and k split from one projection) and a partial rotation (dims < head_dim: the rest copied)."""
    from splitmoe.attention_service.model import layers

    gen = torch.Generator().manual_seed(dims + interleaved)
    T, H, D = 37, 6, 128
    proj = torch.randn(T, H * D + 40, generator=gen) * 4
    x = proj[:, 8:8 + H * D].view(T, H, D)
    rope = layers.Rope(dims, 10000.0, interleaved)
    positions = torch.arange(100, 100 + T)
    cos, sin = rope.tables(positions)
    got = native.rope(x, cos[:, 0].contiguous(), sin[:, 0].contiguous(), interleaved)
    assert got.is_contiguous() and torch.equal(got[..., dims:], x[..., dims:])
    monkeypatch.setattr(layers, "NATIVE_ROWS_MIN_VALUES", 1 << 40)  # Rope takes the torch route
    want = rope(x, positions)
    assert torch.equal(got, want) and not torch.equal(got[..., :dims], x[..., :dims])
    monkeypatch.setattr(layers, "NATIVE_ROWS_MIN_VALUES", 1)  # and the native one
    assert torch.equal(rope(x, positions), want)
    with pytest.raises(ValueError, match="rope"):
        native.rope(x.double(), cos[:, 0], sin[:, 0], interleaved)
