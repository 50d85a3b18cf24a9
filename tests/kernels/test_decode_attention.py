"""kernels.decode_attention (native decode attention) against float64, on every ISA this CPU runs.

Shapes of the served families: grouped-query ratios 1 (OLMoE, Qwen2-MoE), 4 (Mixtral), 8 (Qwen3,
gpt-oss), head dims 64 and 128 and an odd 80 (SIMD tails), MLA's one latent head (576 keys, 512
values), sliding windows, sinks; one query token and several, contexts from 1 token to past the
length at which a context is split across threads; prompts of 9 to 200 rows (the tiled kernel),
alone and beside decode rows; scattered slots; float32 and bfloat16 caches, and the 8-bit ones
(`--kv-cache-dtype` fp8_e4m3, fp8_e5m2, q8_0) read in place.
The reference reads the same cache values (bfloat16, fp8 and q8_0 dequantize exactly), so only
float32 rounding of the kernel remains.
"""
from __future__ import annotations

import functools

import pytest
import torch

from splitmoe.attention_service.model.kv_formats import dequantize_q8_0, quantize_q8_0
from splitmoe.kernels import native
from splitmoe.kernels.decode_attention import AttentionContext, KVPool, decode_attention
from tests.kernels.test_native import ISAS

pytestmark = pytest.mark.skipif(not native.AVAILABLE, reason=f"native kernels: {native.UNAVAILABLE_REASON}")


@pytest.fixture(params=ISAS)
def isa(request):
    native._set_isa(request.param)
    yield request.param
    native._set_isa(native._best_isa())


def reference(q, k_pool, v_pool, rows, scale, window, sinks, value_dims):
    """Row by row in float64: softmax over the visible keys (and the sink) of q·k, times v."""
    T, H, _ = q.shape
    mla = v_pool is None
    k_pool = k_pool[None] if mla else k_pool  # [G, slots, D]
    R = H // k_pool.shape[0]
    out = torch.zeros(T, H, value_dims if mla else v_pool.shape[-1], dtype=torch.float64)
    for start, n, slots in rows:
        C = slots.numel()
        for j in range(n):
            t, own = start + j, C - n + j
            vis = slots[(max(0, own - window + 1) if window else 0):own + 1]
            keys = k_pool[:, vis].double().repeat_interleave(R, 0)  # [H, n, D]
            vals = keys[..., :value_dims] if mla else v_pool[:, vis].double().repeat_interleave(R, 0)
            s = torch.einsum("hnd,hd->hn", keys, q[t].double()) * scale
            if sinks is not None:
                s = torch.cat((s, sinks.double()[:, None]), 1)
            p = torch.softmax(s, 1)[:, : len(vis)]
            out[t] = torch.einsum("hn,hnd->hd", p, vals)
    return out


def make_case(gen, H, G, Dk, Dv, lengths, n_new, num_slots, dtype, scatter, mla=False):
    slots_all = torch.randperm(num_slots, generator=gen) if scatter else torch.arange(num_slots)
    rows, offset, start = [], 0, 0
    for C in lengths:
        n = min(n_new, C)
        rows.append((start, n, slots_all[offset:offset + C].clone()))
        offset += C
        start += n
    T = start
    q = torch.randn(T, H, Dk, generator=gen)
    if mla:
        k_pool, v_pool = torch.randn(num_slots, Dk, generator=gen).to(dtype), None
    else:
        k_pool = torch.randn(G, num_slots, Dk, generator=gen).to(dtype)
        v_pool = torch.randn(G, num_slots, Dv, generator=gen).to(dtype)
    return q, k_pool, v_pool, rows


CASES = [
    # H, G, Dk, Dv, context lengths, new tokens per sequence, window, sinks
    (32, 4, 128, 128, [1], 1, 0, False),  # Qwen3: the first token
    (32, 4, 128, 128, [77], 1, 0, False),  # Qwen3 decode
    (32, 4, 128, 128, [3000], 1, 0, False),  # long: the context is split across threads
    (16, 16, 128, 128, [40, 9, 1], 1, 0, False),  # MHA (ratio 1), three sequences
    (32, 8, 128, 128, [50, 200], 2, 0, False),  # Mixtral ratio 4, two new tokens each
    (64, 8, 64, 64, [130], 1, 128, True),  # gpt-oss: sliding window 128 with sinks
    (64, 8, 64, 64, [100, 700], 3, 0, True),  # gpt-oss full layer with sinks, several rows
    (8, 2, 80, 48, [33, 600], 1, 17, False),  # odd head dims (SIMD tails), short window
    # prompts (8 rows or more of a sequence: the tiled kernel)
    (32, 4, 128, 128, [100], 100, 0, False),  # Qwen3: a whole prompt, tiles of 8 tokens x 8 heads
    (32, 4, 128, 128, [300, 1], 37, 0, False),  # a prompt's chunk after cached context, and a decode row
    (16, 16, 128, 128, [40, 9, 70], 20, 0, False),  # MHA: 64 tokens a tile; 9 rows, a tile barely
    (64, 8, 64, 64, [300], 200, 128, True),  # gpt-oss: window and sinks across tiles
    (8, 2, 80, 48, [33, 600], 30, 17, False),  # odd dims, a window shorter than a key block
    (32, 8, 128, 128, [50, 200], 9, 0, False),  # Mixtral ratio 4: 9 rows, one padded tile
    (40, 1, 96, 72, [130], 130, 0, True),  # one kv head for 40 (rows padded past a vector), sinks
]


@functools.lru_cache(maxsize=None)  # one reference per case, shared by the ISAs
def gqa_case(dtype, H, G, Dk, Dv, lengths, n_new, window, sinks):
    gen = torch.Generator().manual_seed(H * 1000 + sum(lengths) + n_new)
    q, k_pool, v_pool, rows = make_case(gen, H, G, Dk, Dv, lengths, n_new, sum(lengths) + 16, dtype, scatter=True)
    s = torch.randn(H, generator=gen) * 2 if sinks else None
    return q, k_pool, v_pool, rows, s, reference(q, k_pool, v_pool, rows, 0.088, window, s, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("H,G,Dk,Dv,lengths,n_new,window,sinks", CASES)
def test_grouped_query_attention_matches_float64(isa, dtype, H, G, Dk, Dv, lengths, n_new, window, sinks):
    q, k_pool, v_pool, rows, s, want = gqa_case(dtype, H, G, Dk, Dv, tuple(lengths), n_new, window, sinks)
    ctx = AttentionContext.build(rows)
    got = decode_attention(ctx, q, k_pool, v_pool, 0.088, window_tokens=window, sinks=s)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (got.double() - want).abs().max() <= 2e-5 * want.abs().max()


@functools.lru_cache(maxsize=None)
def mla_case(lengths, H=16, L=512, R=64):
    gen = torch.Generator().manual_seed(sum(lengths))
    q, k_pool, _, rows = make_case(gen, H, 1, L + R, L, lengths, 1, sum(lengths) + 5, torch.bfloat16,
                                   scatter=False, mla=True)
    return q, k_pool, rows, reference(q, k_pool, None, rows, 0.05, 0, None, L)


@pytest.mark.parametrize("lengths", [(1,), (60,), (2500, 3)], ids=["1", "60", "2500+3"])
def test_mla_latent_attention_matches_float64(isa, lengths):
    """DeepSeek's absorbed MLA: one shared latent head, keys [L+R], values its first L dims."""
    q, k_pool, rows, want = mla_case(lengths)
    H, L = 16, 512
    ctx = AttentionContext.build(rows)
    got = decode_attention(ctx, q, k_pool, None, 0.05, value_dims=L)
    assert got.shape == (len(lengths), H, L)
    assert (got.double() - want).abs().max() <= 2e-5 * want.abs().max()


def test_isas_agree_closely():
    gen = torch.Generator().manual_seed(5)
    q, k_pool, v_pool, rows = make_case(gen, 32, 4, 128, 128, [300, 5], 1, 320, torch.bfloat16, scatter=True)
    ctx = AttentionContext.build(rows)
    results = {}
    for name in ISAS:
        native._set_isa(name)
        results[name] = decode_attention(ctx, q, k_pool, v_pool, 0.1)
    native._set_isa(native._best_isa())
    for name, r in results.items():
        assert (r - results["scalar"]).abs().max() <= 1e-5 * results["scalar"].abs().max(), name


def test_bad_calls_are_refused_not_read_out_of_bounds():
    gen = torch.Generator().manual_seed(6)
    q, k_pool, v_pool, rows = make_case(gen, 8, 2, 16, 16, [10], 1, 10, torch.float32, scatter=False)
    ctx = AttentionContext.build(rows)
    with pytest.raises(ValueError, match="outside a pool"):
        decode_attention(ctx, q, k_pool[:, :5], v_pool[:, :5], 0.1)
    with pytest.raises(ValueError, match="differ"):
        decode_attention(ctx, q, k_pool, v_pool.bfloat16(), 0.1)
    with pytest.raises(ValueError, match="q must be"):
        decode_attention(ctx, q[:, :, :8].repeat(2, 1, 1), k_pool, v_pool, 0.1)
    with pytest.raises(ValueError, match="does not fit"):
        decode_attention(ctx, torch.randn(1, 6, 16), k_pool[:1].expand(4, -1, -1), v_pool[:1].expand(4, -1, -1), 0.1)
    with pytest.raises(ValueError, match="sinks"):
        decode_attention(ctx, q, k_pool, v_pool, 0.1, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="query rows"):
        AttentionContext.build([(0, 3, torch.arange(2))])
    with pytest.raises(ValueError, match="negative"):
        AttentionContext.build([(0, 1, torch.tensor([-1]))])


# ---- the 8-bit caches, read in place ---------------------------------------------------------------

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def stored(pool: torch.Tensor, fmt: str) -> tuple[KVPool, torch.Tensor]:
    """(the pool as the cache stores it in `fmt`, the float32 values it holds)."""
    if fmt == "q8_0":
        q, d = quantize_q8_0(pool)
        return KVPool(q, d), dequantize_q8_0(q, d)
    f8 = pool.float().clamp(-torch.finfo(FP8[fmt]).max, torch.finfo(FP8[fmt]).max).to(FP8[fmt])
    return KVPool(f8), f8.float()


EIGHT_BIT_CASES = [c for c in CASES if c[2] % 32 == 0 and c[3] % 32 == 0]  # q8_0 rows are whole blocks


@functools.lru_cache(maxsize=None)
def eight_bit_case(fmt, H, G, Dk, Dv, lengths, n_new, window, sinks):
    gen = torch.Generator().manual_seed(H * 1000 + sum(lengths) + n_new + 7)
    q, k_pool, v_pool, rows = make_case(gen, H, G, Dk, Dv, lengths, n_new, sum(lengths) + 16, torch.float32,
                                        scatter=True)
    (k8, kf), (v8, vf) = stored(k_pool * 3, fmt), stored(v_pool, fmt)  # keys of a few units, as after rope
    s = torch.randn(H, generator=gen) * 2 if sinks else None
    return q, k8, v8, rows, s, reference(q, kf, vf, rows, 0.088, window, s, None)


@pytest.mark.parametrize("fmt", ["q8_0", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("H,G,Dk,Dv,lengths,n_new,window,sinks", EIGHT_BIT_CASES)
def test_eight_bit_cache_is_read_in_place(isa, fmt, H, G, Dk, Dv, lengths, n_new, window, sinks):
    """Decode units and prompt tiles convert the stored bytes in registers: the result is attention
    over exactly the values the cache holds."""
    q, k8, v8, rows, s, want = eight_bit_case(fmt, H, G, Dk, Dv, tuple(lengths), n_new, window, sinks)
    got = decode_attention(AttentionContext.build(rows), q, k8, v8, 0.088, window_tokens=window, sinks=s)
    assert (got.double() - want).abs().max() <= 2e-5 * want.abs().max()


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_odd_head_dims_take_the_tails(isa, fmt):
    gen = torch.Generator().manual_seed(11)
    q, k_pool, v_pool, rows = make_case(gen, 8, 2, 80, 48, [33, 600], 30, 650, torch.float32, scatter=True)
    (k8, kf), (v8, vf) = stored(k_pool, fmt), stored(v_pool, fmt)
    want = reference(q, kf, vf, rows, 0.1, 17, None, None)
    got = decode_attention(AttentionContext.build(rows), q, k8, v8, 0.1, window_tokens=17)
    assert (got.double() - want).abs().max() <= 2e-5 * want.abs().max()


@pytest.mark.parametrize("fmt", ["q8_0", "fp8_e4m3"])
@pytest.mark.parametrize("lengths", [(60,), (2500, 3)], ids=["60", "2500+3"])
def test_mla_latent_in_eight_bits(isa, fmt, lengths):
    H, L, R = 16, 512, 64
    gen = torch.Generator().manual_seed(sum(lengths) + 3)
    q, k_pool, _, rows = make_case(gen, H, 1, L + R, L, lengths, 1, sum(lengths) + 5, torch.float32,
                                   scatter=False, mla=True)
    k8, kf = stored(k_pool, fmt)
    want = reference(q, kf, None, rows, 0.05, 0, None, L)
    got = decode_attention(AttentionContext.build(rows), q, k8, None, 0.05, value_dims=L)
    assert (got.double() - want).abs().max() <= 2e-5 * want.abs().max()


def test_eight_bit_pools_are_checked():
    gen = torch.Generator().manual_seed(12)
    q, k_pool, v_pool, rows = make_case(gen, 8, 2, 64, 64, [10], 1, 10, torch.float32, scatter=False)
    ctx = AttentionContext.build(rows)
    (k8, _), (v8, _) = stored(k_pool, "q8_0"), stored(v_pool, "q8_0")
    with pytest.raises(ValueError, match="scales must be float16"):
        decode_attention(ctx, q, KVPool(k8.values, k8.scales.float()), v8, 0.1)
    with pytest.raises(ValueError, match="int8 with scales"):
        decode_attention(ctx, q, k8.values, v8, 0.1)  # int8 without its scales
    with pytest.raises(ValueError, match="differ"):
        decode_attention(ctx, q, k8, stored(v_pool, "fp8_e4m3")[0], 0.1)


def _native_quantize(fmt: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    kv_type = {"q8_0": 8, "fp8_e4m3": 240, "fp8_e5m2": 241}[fmt]
    n, dim = x.shape
    values = torch.empty(n, dim, dtype=torch.int8 if fmt == "q8_0" else torch.uint8)
    scales = torch.empty(n, dim // 32, dtype=torch.float16) if fmt == "q8_0" else None
    rc = native._lib.smk_kv_quantize(kv_type, x.data_ptr(), n, dim, values.data_ptr(),
                                     None if scales is None else scales.data_ptr())
    assert rc == 0
    return values, scales


@pytest.mark.parametrize("fmt", ["q8_0", "fp8_e4m3", "fp8_e5m2"])
def test_native_writes_give_torchs_bits(fmt):
    """The native decode layer writes each new token's keys and values itself (kv_quant.h); the
    bytes are those kv_formats.py's torch writes give a prompt's tokens, ties, subnormals and
    clamped values included."""
    gen = torch.Generator().manual_seed(13)
    x = torch.cat([
        torch.randn(64, 128, generator=gen) * 4,
        torch.randn(16, 128, generator=gen) * 1e-3,  # fp8 subnormals
        torch.randn(8, 128, generator=gen) * 1e3,  # e4m3 clamps at 448
        torch.randint(-64, 64, (16, 128), generator=gen).float() / 16,  # exact halves: rounding ties
        torch.zeros(1, 128),  # a zero q8_0 block: scale 0
    ])
    values, scales = _native_quantize(fmt, x)
    if fmt == "q8_0":
        q, d = quantize_q8_0(x)
        assert torch.equal(values, q) and torch.equal(scales.view(torch.int16), d.view(torch.int16))
    else:
        f8 = x.clamp(-torch.finfo(FP8[fmt]).max, torch.finfo(FP8[fmt]).max).to(FP8[fmt])
        assert torch.equal(values, f8.view(torch.uint8))
