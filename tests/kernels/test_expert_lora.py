"""kernels.expert_lora and `ExpertCompute.forward(..., lora=)`: LoRA on the routed experts, row by row.

The reference is float64, slot by slot, on merged weights: each expert's dequantized matrices plus the
adapter's delta (peft's own `get_delta_weight` from tests/data/lora/references.npz for experts 0 and 5,
scale * B @ A from the file for the others), the base's activation written out (tests/kernels/test_moe.py's
`Float64FFN`). The code under test never merges: it adds the rank-r products to each adapted row. Base
rows, and rows of an adapter without tensors on the layer, must equal a call without adapters bit for bit.
"""
from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from splitmoe.kernels import expert_kernels as ek
from splitmoe.kernels.expert_kernels import ExpertCompute
from splitmoe.kernels.expert_lora import AdaptedExperts, ExpertLayerLora, LoraPair, by_layer, check_rows
from splitmoe.kernels.moe import ACT_SILU, ACT_SWIGLU_OAI
from splitmoe.modelfile.expert_tensors import ExpertShard, load_layer_experts
from splitmoe.modelfile.gguf_file import GGUFFile
from splitmoe.modelfile.lora_adapter import LoraTensor, load_lora_adapter
from tests.kernels.test_expert_kernels import make_experts
from tests.kernels.test_moe import Float64FFN

DATA = Path(__file__).resolve().parents[1] / "data" / "lora"
NUM_EXPERTS, TOP_K, HIDDEN = 16, 4, 128  # the fixture's qwen3moe
MATRICES = ("gate", "up", "down")
# float32: the adapted rows take the exact route (float32 dequantized weights and GEMMs); what is left
# is float32 rounding (measured 5e-7).
F32_TOL = 1e-4
# bfloat16: the fixture's BF16 experts have no native int8 kernel, so the adapted rows take the exact
# float32 route too (the reference reads the same bfloat16-rounded input); the one rounding beyond
# float32 is the answer's to bfloat16 (8 significant bits), at most 2^-8 = 3.9e-3 of each element, so
# of each row's norm too (measured 2.0e-3). A lost delta moves a row by 10-60%.
BF16_TOL = 4e-3
# The native route quantizes activations to int8 per 32 values, as the base's decode kernel: measured
# 1.0-1.2% rel-L2 here on these random experts (tests/kernels/test_expert_kernels.py: 1.2-1.4%, its bound).
NATIVE_TOL = 2e-2
NATIVE = pytest.mark.skipif(not ek.native_available(), reason=f"native kernels: {ek.native_unavailable_reason()}")


@pytest.fixture(scope="module")
def base() -> GGUFFile:
    return GGUFFile(DATA / "base-qwen3moe.gguf")


@pytest.fixture(scope="module")
def adapter(base):
    return load_lora_adapter(DATA / "experts-lora.gguf", base, "experts")


@pytest.fixture(scope="module")
def peft_deltas() -> dict[str, np.ndarray]:
    with np.load(DATA / "references.npz") as z:
        return {k.removeprefix("experts/delta/"): z[k] for k in z.files if k.startswith("experts/delta/")}


def scaled(lora: ExpertLayerLora, factor: float, *, without: str | None = None) -> ExpertLayerLora:
    """A second adapter: the same A and B at another scale, optionally one matrix left out."""
    pairs = {m: None if m == without or p is None else LoraPair(p.a, p.b, p.scale * factor)
             for m in MATRICES for p in [getattr(lora, m)]}
    return ExpertLayerLora(**pairs)


def merged(ffn64: Float64FFN, deltas: dict[str, torch.Tensor]) -> Float64FFN:
    """ffn64 with each matrix plus its float64 delta [out, in] (absent: the base's)."""
    out = copy.copy(ffn64)
    out.layers = [(w + deltas[m] if m in deltas else w, b) for m, (w, b) in zip(MATRICES, ffn64.layers)]
    return out


def reference(hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, ffn_of) -> torch.Tensor:
    """out[t] = sum_k weights[t, k] * FFN(t, ids[t, k])(x[t]) in float64; ffn_of(t, e) None: adds nothing."""
    x = hidden.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            ffn = ffn_of(t, int(ids[t, k]))
            if ffn is not None:
                out[t] += float(weights[t, k]) * ffn(x[t:t + 1])[0]
    return out


def row_rel(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Each row's rel-L2; a row whose experts are all elsewhere must be exactly 0 (else inf)."""
    err, norm = (got.double() - want).norm(dim=1), want.norm(dim=1)
    return torch.where(norm > 0, err / norm.clamp_min(1e-300), torch.where(err > 0, torch.inf, 0.0))


def routing(gen: torch.Generator, num_tokens: int, num_experts: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    return ids, torch.softmax(torch.randn(num_tokens, top_k, generator=gen), dim=-1)


# ---- parsing an adapter ---------------------------------------------------------------------------

def test_by_layer_of_the_fixture_adapter(adapter):
    layers = by_layer(adapter.expert_side())
    assert set(layers) == {0, 1}
    for lora in layers.values():
        assert not lora.empty and all(getattr(lora, m).scale == 1.5 for m in MATRICES)
        assert lora.gate.a.shape == lora.up.a.shape == (16, 4, 128) and lora.gate.b.shape == (16, 32, 4)
        assert lora.down.a.shape == (16, 4, 32) and lora.down.b.shape == (16, 128, 4)
    assert torch.equal(layers[1].down.b, adapter.tensors["blk.1.ffn_down_exps.weight"].b)


@pytest.mark.parametrize("name", ["blk.0.ffn_gate_up_exps.weight", "blk.0.ffn_gate.3.weight",
                                  "blk.0.attn_q.weight", "blk.0.ffn_gate_shexp.weight"])
def test_by_layer_refuses_other_tensors_naming_them(adapter, name):
    tensors = dict(adapter.expert_side())
    t = tensors["blk.0.ffn_gate_exps.weight"]
    tensors[name] = LoraTensor(name, t.a, t.b, t.scale)
    with pytest.raises(ValueError, match=rf"'{name}\.lora_a': LoRA on it is not applied by SplitMoE yet") as e:
        by_layer(tensors)
    assert "\n" not in str(e.value)


def test_lora_pair_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match=r"want \[E, r, in\] / \[E, out, r\]"):
        LoraPair(torch.zeros(4, 2, 8), torch.zeros(4, 6, 3), 1.0)
    gate = LoraPair(torch.zeros(4, 2, 8), torch.zeros(4, 6, 2), 1.0)
    with pytest.raises(ValueError, match="do not fit together"):
        ExpertLayerLora(gate=gate, down=LoraPair(torch.zeros(4, 2, 8), torch.zeros(4, 6, 2), 1.0))


@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("matrix", MATRICES)
def test_rank_r_product_is_peft_delta(adapter, peft_deltas, layer, matrix):
    """delta(x, e) = x @ (scale * B_e A_e)^T: peft's delta on the identity, for experts 0 and 5."""
    pair = getattr(by_layer(adapter.expert_side())[layer], matrix)
    want = peft_deltas[f"blk.{layer}.ffn_{matrix}_exps.weight"]
    for i, e in enumerate((0, 5)):
        got = pair.delta(torch.eye(pair.in_features), e).T
        np.testing.assert_allclose(got.numpy(), want[i], rtol=0, atol=1e-6 * np.abs(want[i]).max())


def test_check_rows_refusals():
    lora = ExpertLayerLora(gate=LoraPair(torch.zeros(4, 2, 8), torch.zeros(4, 6, 2), 1.0))
    with pytest.raises(ValueError, match="listed twice"):
        check_rows([(lora, torch.tensor([0, 2])), (lora, torch.tensor([2]))], 3)
    with pytest.raises(ValueError, match=r"outside \[0, 3\)"):
        check_rows([(lora, torch.tensor([3]))], 3)
    with pytest.raises(ValueError, match="1-D integer"):
        check_rows([(lora, torch.tensor([0.0]))], 3)
    assert check_rows([(ExpertLayerLora(), torch.tensor([0])), (lora, torch.tensor([], dtype=torch.long))], 3) == []


# ---- the fixture: a mixed batch against float64 ---------------------------------------------------

def fixture_ffns(base: GGUFFile, layer: int, adapter, peft_deltas, factor: float) -> dict:
    """expert -> {"base", "a", "b"}: Float64FFN of the base and of the two adapters' merged weights."""
    deltas = {}
    for m in MATRICES:
        t = adapter.tensors[f"blk.{layer}.ffn_{m}_exps.weight"]
        d = t.scale * (t.b.double() @ t.a.double())  # [E, out, in]
        peft = torch.from_numpy(peft_deltas[f"blk.{layer}.ffn_{m}_exps.weight"]).double()
        assert (d[[0, 5]] - peft).abs().max() <= 1e-6 * peft.abs().max()  # the file's pair is peft's delta
        d[[0, 5]] = peft
        deltas[m] = d
    ffns = {}
    for e, ffn in load_layer_experts(base, layer, range(NUM_EXPERTS)).items():
        ffn64 = Float64FFN(ffn)
        ffns[e] = {"base": ffn64, "a": merged(ffn64, {m: deltas[m][e] for m in MATRICES}),
                   "b": merged(ffn64, {m: factor * deltas[m][e] for m in ("gate", "down")})}
    return ffns


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("hosted", ["all", "half"])
def test_mixed_batch_against_float64(base, adapter, peft_deltas, dtype, layer, hosted):
    experts = list(range(NUM_EXPERTS)) if hosted == "all" else list(range(0, NUM_EXPERTS, 2))
    shard = ExpertShard(base, by_layer={layer: experts})
    lora = by_layer(adapter.expert_side())[layer]
    factor = -2.0
    other = scaled(lora, factor, without="up")  # a second adapter: gate and down only, at -2x the scale
    gen = torch.Generator().manual_seed(31 + layer)
    num_tokens = 14
    hidden = torch.randn(num_tokens, HIDDEN, generator=gen).to(dtype)
    ids, weights = routing(gen, num_tokens, NUM_EXPERTS, TOP_K)
    ids[1, 0], ids[4, 1], ids[2, 2] = 0, 5, 5  # peft's own deltas on adapted rows
    ids[7, 3] = ids[12, 0] = -1  # a slot computed elsewhere
    rows_a, rows_b, rows_none = torch.tensor([1, 4, 7, 9, 13]), torch.tensor([2, 5, 12]), torch.tensor([3, 10])
    groups = [(lora, rows_a), (ExpertLayerLora(), rows_none), (other, rows_b)]

    got = shard.forward(layer, hidden, ids, weights, lora=groups)
    plain = shard.forward(layer, hidden, ids, weights)
    assert got.dtype == dtype and got.shape == hidden.shape
    adapted = torch.cat([rows_a, rows_b])
    base_rows = torch.tensor([t for t in range(num_tokens) if t not in set(adapted.tolist())])
    assert torch.equal(got[base_rows], plain[base_rows])  # rows_none among them: bit for bit

    ffns = fixture_ffns(base, layer, adapter, peft_deltas, factor)
    which = {**{t: "a" for t in rows_a.tolist()}, **{t: "b" for t in rows_b.tolist()}}
    want = reference(hidden, ids, weights, lambda t, e: ffns[e][which.get(t, "base")] if e in experts else None)
    tol = F32_TOL if dtype == torch.float32 else BF16_TOL
    assert float(row_rel(got[adapted], want[adapted]).max()) <= tol
    # The adapters change those rows far beyond the bound: a lost or misplaced delta would fail above.
    computed_here = adapted[want[adapted].norm(dim=1) > 0]  # ("half": a row may have all its experts elsewhere)
    assert len(computed_here) >= 5 and float(row_rel(plain[computed_here], want[computed_here]).min()) > 10 * tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_row_adapted(base, adapter, peft_deltas, dtype):
    """No base row: the base path is skipped, the adapted answers are the whole output."""
    shard = ExpertShard(base, layers=[0])
    lora = by_layer(adapter.expert_side())[0]
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(5, HIDDEN, generator=gen).to(dtype)
    ids, weights = routing(gen, 5, NUM_EXPERTS, TOP_K)
    got = shard.forward(0, hidden, ids.int(), weights, lora=[(lora, torch.arange(5))])
    ffns = fixture_ffns(base, 0, adapter, peft_deltas, 1.0)
    want = reference(hidden, ids, weights, lambda t, e: ffns[e]["a"])
    assert float(row_rel(got, want).max()) <= (F32_TOL if dtype == torch.float32 else BF16_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adapters_without_tensors_on_the_layer_are_the_base(base, dtype):
    shard = ExpertShard(base, layers=[1])
    gen = torch.Generator().manual_seed(8)
    hidden = torch.randn(6, HIDDEN, generator=gen).to(dtype)
    ids, weights = routing(gen, 6, NUM_EXPERTS, TOP_K)
    got = shard.forward(1, hidden, ids, weights, lora=[(ExpertLayerLora(), torch.tensor([0, 2, 5]))])
    assert torch.equal(got, shard.forward(1, hidden, ids, weights))


# ---- quantized experts: the native route, biases and gpt-oss's activation ---------------------------

D, F, SYNTH_EXPERTS, SYNTH_TOP_K = 256, 256, 6, 2  # tests/kernels/test_expert_kernels.py's experts
SYNTH_HOSTED = [0, 1, 2, 3]


def random_lora(seed: int, rank: int = 4, scale: float = 2.0) -> ExpertLayerLora:
    """A ~ N(0, 1/in), B ~ N(0, 0.1^2): each delta ~20% of the base product, as the fixture's."""
    gen = torch.Generator().manual_seed(seed)

    def pair(out: int, inp: int) -> LoraPair:
        return LoraPair(torch.randn(SYNTH_EXPERTS, rank, inp, generator=gen) / inp ** 0.5,
                        torch.randn(SYNTH_EXPERTS, out, rank, generator=gen) * 0.1, scale)

    return ExpertLayerLora(gate=pair(F, D), up=pair(F, D), down=pair(D, F))


def lora_deltas(lora: ExpertLayerLora, e: int) -> dict[str, torch.Tensor]:
    return {m: p.scale * (p.b[e].double() @ p.a[e].double()) for m in MATRICES for p in [getattr(lora, m)] if p}


@NATIVE
@pytest.mark.parametrize("activation,biases", [(ACT_SILU, False), (ACT_SWIGLU_OAI, True)])
def test_native_and_exact_routes_on_quantized_experts(activation, biases):
    experts = make_experts(T.Q4_K, 3, down_type=T.Q6_K, activation=activation, biases=biases)
    lora_a, lora_b = random_lora(1), random_lora(2, rank=8, scale=-1.0)
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(8, D, generator=gen).to(torch.bfloat16)
    ids, weights = routing(gen, 8, SYNTH_EXPERTS, SYNTH_TOP_K)
    groups = [(lora_a, torch.tensor([0, 3, 6, 7])), (lora_b, torch.tensor([1, 4]))]
    layer = AdaptedExperts(experts, SYNTH_EXPERTS)
    native = layer.forward(hidden, ids, weights, groups, native_max_tokens=1 << 30)
    exact = layer.forward(hidden, ids, weights, groups, native_max_tokens=0)
    assert not torch.equal(native, exact)  # the int8 products did run
    f64 = {e: Float64FFN(f) for e, f in experts.items()}
    adapter_of = {0: lora_a, 3: lora_a, 6: lora_a, 7: lora_a, 1: lora_b, 4: lora_b}
    rows = torch.tensor(list(adapter_of))
    want = reference(hidden[rows], ids[rows], weights[rows],
                     lambda i, e: merged(f64[e], lora_deltas(adapter_of[int(rows[i])], e)) if e in f64 else None)
    assert float(row_rel(exact, want).max()) <= F32_TOL
    assert float((native.double() - want).norm() / want.norm()) <= NATIVE_TOL


@NATIVE
def test_decode_batch_through_expert_compute_on_quantized_experts():
    """bfloat16 and few tokens: base rows on the base's native kernel, adapted rows on the native route."""
    experts = make_experts(T.Q4_K, 4, down_type=T.Q6_K)
    compute = ExpertCompute({3: experts}, SYNTH_EXPERTS, lambda layer, es: "synthetic", "synthetic")
    lora = random_lora(9)
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(6, D, generator=gen).to(torch.bfloat16)
    ids, weights = routing(gen, 6, SYNTH_EXPERTS, SYNTH_TOP_K)
    rows = torch.tensor([1, 2, 5])
    got = compute.forward(3, hidden, ids, weights, lora=[(lora, rows)])
    plain = compute.forward(3, hidden, ids, weights)
    base_rows = torch.tensor([0, 3, 4])
    assert torch.equal(got[base_rows], plain[base_rows])
    f64 = {e: Float64FFN(f) for e, f in experts.items()}
    want = reference(hidden[rows], ids[rows], weights[rows],
                     lambda i, e: merged(f64[e], lora_deltas(lora, e)) if e in f64 else None)
    assert float((got[rows].double() - want).norm() / want.norm()) <= NATIVE_TOL
    assert float((plain[rows].double() - want).norm() / want.norm()) > 5 * NATIVE_TOL
