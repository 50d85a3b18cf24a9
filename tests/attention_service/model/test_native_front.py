"""The attention half of a decode layer as one native call (kernels.decode_layer) against a float64
reference of the same layer, on real models of every family it serves.

One decode step of two sequences over a real paged cache (prefilled by the torch path); for the
first and last layer, both the native front and the torch path it replaces compute the step from
the same residual input and cache. The reference recomputes the layer in float64 from the exactly
dequantized weights: norms, q/k/v with biases, q/k norm, rope (the model's own cos/sin tables),
the new keys and values rounded to the cache's format as both paths store them (bfloat16, or the
8-bit formats the native front quantizes itself), attention over
the cached context (sliding window, sinks), output projection, residual, the FFN norm and the
router. The native front must be within the int8-activation distance of it, and no further than
the torch path is.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from splitmoe.attention_service.model.layers import linear, rms_norm
from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
from splitmoe.attention_service.model.sequence import Sequence
from splitmoe.kernels import native
from splitmoe.kernels.decode_layer import QkNorm
from splitmoe.kernels.linear import QuantLinear
from splitmoe.kernels.quants import dequantize

pytestmark = pytest.mark.skipif(not native.AVAILABLE, reason=f"native kernels: {native.UNAVAILABLE_REASON}")

FIXTURES = ["qwen3moe/qwen3moe-q8_0.gguf",  # per-head q/k norm
            "qwen2moe/qwen2moe-q4_k_m.gguf",  # q/k/v biases, K-quants
            "mixtral/mixtral-q8_0.gguf",  # interleaved rope
            "olmoe/olmoe-q8_0.gguf",  # q/k norm over the whole projection
            "gptoss/gptoss-q8_0.gguf",  # sinks, sliding window, output and router biases
            "deepseek/deepseek-q8_0.gguf",  # interleaved rope, a leading dense layer, shared experts
            "glm4moe/glm4moe-q4_k_m.gguf"]  # partial rotary, q width != hidden, biases, per-head q/k norm
TOL = 1.5e-2  # rel-L2: int8 activations (~0.3% per product) through two products and a softmax


def f64(w) -> torch.Tensor | None:
    if w is None:
        return None
    return (dequantize(w.qt) if isinstance(w, QuantLinear) else w).double()


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def as_stored(fmt, t: torch.Tensor) -> torch.Tensor:
    """t [G, n, D] as the cache in format `fmt` gives it back, in float64."""
    pools, slots = fmt.allocate(tuple(t.shape), torch.device("cpu")), torch.arange(t.shape[1])
    fmt.write(pools, 1, slots, t.float())
    return fmt.read(pools, 1, slots, None, torch.float64)


def reference(model, i: int, x: torch.Tensor, batch, before: dict, fmt) -> tuple[torch.Tensor, ...]:
    """(x after attention, the FFN's normed input, router logits) of layer i, in float64."""
    c, att, layer = model.cfg, model.attention, model.weights.layers[i]
    w, eps = layer.attn, c.norm_eps
    H, G, Dk, Dv = c.num_heads, c.num_kv_heads, c.head_dim, c.value_head_dim
    h = rms(x.double(), layer.attn_norm, eps)
    proj = []
    for weight, bias in ((w.q, w.q_bias), (w.k, w.k_bias), (w.v, w.v_bias)):
        y = h @ f64(weight).T
        proj.append(y if bias is None else y + bias.double())
    q, k, v = proj
    if att.spec.qk_norm == QkNorm.FULL and w.q_norm is not None:  # none where optional and absent
        q, k = rms(q, w.q_norm, eps), rms(k, w.k_norm, eps)
    q, k, v = q.view(-1, H, Dk), k.view(-1, G, Dk), v.view(-1, G, Dv)
    if att.spec.qk_norm == QkNorm.PER_HEAD and w.q_norm is not None:
        q, k = rms(q, w.q_norm, eps), rms(k, w.k_norm, eps)
    cos, sin = (t.double() for t in att.rope.tables(batch.positions))  # [T, 1, dims], pair layout
    d = att.rope.dims

    def rope(t):
        rot = t[..., :d]
        swapped = rot.unflatten(-1, (-1, 2)).flip(-1).flatten(-2) if att.rope.interleaved else \
            torch.cat(rot.chunk(2, -1)[::-1], -1)
        return torch.cat((rot * cos + swapped * sin, t[..., d:]), -1)

    q, k = rope(q), rope(k)
    kc, vc = before["k"].clone(), before["v"].clone()  # [G, slots, D] float64, as stored
    kc[:, batch.new_slots] = as_stored(fmt, k.transpose(0, 1))
    vc[:, batch.new_slots] = as_stored(fmt, v.transpose(0, 1))
    window = att.window_tokens(i)
    out = torch.zeros(x.shape[0], H, Dv, dtype=torch.float64)
    for s in batch.seqs:
        ctx = s.context_slots
        own = len(ctx) - 1
        visible = ctx[max(0, own - window + 1) if window else 0:]
        for head in range(H):
            g = head // (H // G)
            scores = kc[g, visible] @ q[s.start, head] * att.scale
            if w.sinks is not None:
                scores = torch.cat((scores, w.sinks[head].double().view(1)))
            p = torch.softmax(scores, 0)[: len(visible)]
            out[s.start, head] = p @ vc[g, visible]
    o = out.flatten(1) @ f64(w.out).T
    x2 = x.double() + (o if w.out_bias is None else o + w.out_bias.double())
    h2 = rms(x2, layer.ffn_norm, eps)
    moe = layer.moe
    logits = None if moe is None else h2 @ moe.router.double().T + (0 if moe.router_bias is None else moe.router_bias.double())
    return x2, h2, logits


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def check(path, kv_cache_dtype: str = "auto") -> None:
    r = ModelRunner.from_gguf(path, RunnerOptions(dtype=torch.bfloat16, device=torch.device("cpu"),
                                                  kv_cache_tokens=256, kv_block_tokens=4,
                                                  kv_cache_dtype=kv_cache_dtype))
    vocab = r.cfg.vocab_size
    seqs = [Sequence(0, [(7 * j + 3) % vocab for j in range(45)]), Sequence(1, [(5 * j + 1) % vocab for j in range(38)])]
    m = r.model
    with torch.inference_mode():
        r.step(seqs, [44, 37])  # the prompts but their last tokens, on the torch path
        batch = r._build_batch(seqs, [1, 1], False)
        fronts = m._native_fronts(r.kv)
        assert len(fronts) == len(m.weights.layers)
        gen = torch.Generator().manual_seed(0)
        every_slot = torch.arange(r.kv.num_blocks * r.kv.kv_block_tokens)
        for i in (0, len(m.weights.layers) - 1):
            layer = m.weights.layers[i]
            stored = [t for p in r.kv.native_pools(i).values() for t in (p.values, p.scales) if t is not None]
            saved = [t.clone() for t in stored]  # the raw bytes, put back between the two paths
            x = torch.randn(2, r.cfg.hidden_size, generator=gen)
            want = reference(m, i, x, batch, r.kv.read_pooled(i, every_slot, torch.float64), r.kv.format)
            fused = x.clone()
            h_fused, logits_fused = fronts[i](m.attention.decode_step(batch), fused)
            fused_rows = r.kv.read_pooled(i, batch.new_slots, torch.float64)
            for t, s in zip(stored, saved):
                t.copy_(s)
            torch_x = x + m.attention(i, layer.attn, rms_norm(x, layer.attn_norm, r.cfg.norm_eps).to(m.dtype),
                                      batch, r.kv)
            torch_h = rms_norm(torch_x, layer.ffn_norm, r.cfg.norm_eps)
            torch_logits = linear(torch_h, layer.moe.router, layer.moe.router_bias) if layer.moe else None
            delta = want[0] - x.double()  # the attention's own output: the residual would hide its error
            err_fused, err_torch = rel(fused - x, delta), rel(torch_x - x, delta)
            assert err_fused <= TOL and err_fused <= 1.5 * err_torch + 1e-3, (i, err_fused, err_torch)
            assert rel(h_fused, want[1]) <= TOL
            if want[2] is not None:
                assert rel(logits_fused, want[2]) <= TOL and rel(logits_fused, want[2]) <= 1.5 * rel(torch_logits, want[2]) + 1e-3
            # what the cache holds for the new tokens: what the torch path writes, to int8 distance
            # (fp8: the two paths' inputs differ by int8 distance, so a value near a rounding boundary
            # may land one fp8 step apart: 2^-M relative, at most half the values)
            torch_rows = r.kv.read_pooled(i, batch.new_slots, torch.float64)
            rows_tol = {"fp8_e4m3": 2 ** -4, "fp8_e5m2": 2 ** -3}.get(r.kv.format.name, TOL)
            for name, rows in fused_rows.items():
                assert rel(rows, torch_rows[name]) <= rows_tol


def test_demo_model(demo_gguf):
    check(demo_gguf)


@pytest.mark.parametrize("model", FIXTURES)
def test_llama_cpp_fixtures(fixtures_dir, model):
    check(fixtures_dir / model)


@pytest.mark.parametrize("kv_cache_dtype", ["q8_0", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("model", ["qwen3moe/qwen3moe-q8_0.gguf", "gptoss/gptoss-q8_0.gguf"])
def test_eight_bit_caches(fixtures_dir, model, kv_cache_dtype):
    """The front quantizes the new keys and values into the 8-bit cache itself and reads it in place."""
    check(fixtures_dir / model, kv_cache_dtype)


def test_declined_for_layernorm_and_clamped_qkv(fixtures_dir):
    """DBRX's layers are not the native front's (it has RMSNorm and no clamp): the torch path runs them."""
    r = ModelRunner.from_gguf(fixtures_dir / "dbrx" / "dbrx-q8_0.gguf",
                              RunnerOptions(dtype=torch.bfloat16, device=torch.device("cpu"), kv_cache_tokens=64))
    q = r.model.weights.layers[0].attn.q
    assert isinstance(q, QuantLinear) and q.route == "native"  # declined for the layer, not the weights
    assert r.model._native_fronts(r.kv) == []


def test_lora_deltas_inside_the_front(demo_gguf, tmp_path):
    """An adapter on q/k/v/output keeps the one-call front: the call hands its products to the
    adapter's deltas (kernels.decode_layer.FrontLora). In a step mixing an adapted row and a base
    row, the adapted row's attention matches the torch path's with the same adapter (to the int8
    distance) and moves well past it from the base's; the base row is bit-identical to a step
    without adapters."""
    from splitmoe.attention_service.model.lora import AdapterWeights
    from splitmoe.bench.lora_bench import ATTENTION, write_adapter
    from splitmoe.modelfile.gguf_file import GGUFFile
    from splitmoe.modelfile.lora_adapter import load_lora_adapter

    base = GGUFFile(demo_gguf)
    write_adapter(base, tmp_path / "attn.gguf", 8, ATTENTION, b_std=0.1)
    lora = AdapterWeights.of(load_lora_adapter(tmp_path / "attn.gguf", base, "attn"))
    r = ModelRunner.from_gguf(base, RunnerOptions(dtype=torch.bfloat16, device=torch.device("cpu"),
                                                  kv_cache_tokens=256, kv_block_tokens=4))
    vocab, m = r.cfg.vocab_size, r.model
    seqs = [Sequence(0, [(7 * j + 3) % vocab for j in range(30)], lora=lora),
            Sequence(1, [(5 * j + 1) % vocab for j in range(23)])]
    with torch.inference_mode():
        r.step(seqs, [29, 22])
        adapted = r._build_batch(seqs, [1, 1], False)
        plain = dataclasses.replace(adapted, lora=None)
        assert adapted.lora is not None and adapted.lora.attention_side
        fronts = m._native_fronts(r.kv)
        assert len(fronts) == len(m.weights.layers)
        x = torch.randn(2, r.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
        for i in (0, len(fronts) - 1):
            layer = m.weights.layers[i]
            stored = [t for p in r.kv.native_pools(i).values() for t in (p.values, p.scales) if t is not None]
            saved = [t.clone() for t in stored]

            def restore():
                for t, s in zip(stored, saved):
                    t.copy_(s)

            runs = {}
            for name, batch in (("adapted", adapted), ("plain", plain)):
                out = x.clone()
                h, _ = fronts[i](m.attention.decode_step(batch), out, batch.lora and batch.lora.front(i))
                runs[name] = (out - x, h)
                restore()
            torch_delta = m.attention(i, layer.attn, rms_norm(x, layer.attn_norm, r.cfg.norm_eps).to(m.dtype), adapted,
                                      r.kv)
            restore()
            fused, plain_delta = runs["adapted"][0], runs["plain"][0]
            assert rel(fused[0], torch_delta[0].double()) <= TOL, i
            assert rel(fused[0], plain_delta[0].double()) > 10 * TOL, i
            assert torch.equal(fused[1], plain_delta[1]) and torch.equal(runs["adapted"][1][1], runs["plain"][1][1])
