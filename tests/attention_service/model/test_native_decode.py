"""The native attention inside real models: every call of a bfloat16 prompt chunk (the tiled
kernel) and decode is checked against the torch implementation (`grouped_attention`,
`latent_attention`) on the same queries and the same cache, so the pools, strides, slots, windows
and sinks it is handed are the right ones.

This is the path of MLA models and of layers without a native attention front (a weight type the
kernels lack); the fronts, which call the same kernel from C++, are switched off here and tested
in test_native_front.py.

Whole-model logits cannot show this sharply: each quantized linear rounds its input to int8, which
hides float32-level differences or turns one into a visible flip of a rounding step.
"""
from __future__ import annotations

import json

import pytest
import torch

import splitmoe.attention_service.model.attention as attention_module
import splitmoe.attention_service.model.mla as mla_module
from splitmoe.attention_service.model.attention import grouped_attention
from splitmoe.attention_service.model.kv_formats import dequantize_q8_0
from splitmoe.attention_service.model.mla import latent_attention
from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
from splitmoe.attention_service.model.sequence import Sequence
from splitmoe.attention_service.model.transformer import MoETransformer
from splitmoe.kernels import native
from splitmoe.kernels.decode_attention import KVPool

pytestmark = pytest.mark.skipif(not native.AVAILABLE, reason=f"native kernels: {native.UNAVAILABLE_REASON}")

FIXTURES = ["gptoss/gptoss-q8_0.gguf",  # sinks, a 32-token sliding window on even layers
            "deepseek2/deepseek2-q8_0.gguf", "deepseek3/deepseek3-q4_k_m.gguf",  # MLA
            "mixtral/mixtral-q8_0.gguf", "qwen2moe/qwen2moe-q8_0.gguf",
            "dbrx/dbrx-q8_0.gguf",  # clamped q/k/v
            "glm4moe/glm4moe-q8_0.gguf",  # q width != hidden
            "llama4/llama4-q8_0.gguf"]  # chunked layers (chunks beyond the prompt) and a NoPE one


def stored_values(p: KVPool) -> torch.Tensor:
    """What a pool holds, exactly: bfloat16 as is, fp8 and q8_0 dequantized to float32."""
    if p.scales is not None:
        return dequantize_q8_0(p.values, p.scales)
    return p.values if p.values.dtype == torch.bfloat16 else p.values.float()


def torch_reference(ctx, q, k, v, scale, window_tokens=0, sinks=None, value_dims=None):
    k, v = (stored_values(p) if isinstance(p, KVPool) else p for p in (k, v))
    outs = []
    for start, n, offset, length in ctx.seqs.tolist():
        slots = ctx.slots[offset:offset + length]
        rows, positions = q[start:start + n].float(), ctx.q_index[start:start + n]
        if v is None:
            outs.append(latent_attention(rows, k[slots], positions, scale, value_dims).float())
        else:
            outs.append(grouped_attention(rows, k[:, slots], v[:, slots], positions, scale,
                                          window_tokens=window_tokens, sinks=sinks).float())
    return torch.cat(outs)


def checked_decode(monkeypatch) -> list[int]:
    """Wrap the native call in both attention modules; returns a list that counts the checked calls."""
    checked = []
    real = attention_module.decode_attention

    def both(ctx, q, k, v, scale, **kw):
        got = real(ctx, q, k, v, scale, **kw)
        want = torch_reference(ctx, q, k, v, scale, **kw)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max() + 1e-6
        checked.append(1)
        return got

    monkeypatch.setattr(attention_module, "decode_attention", both)
    monkeypatch.setattr(mla_module, "decode_attention", both)
    monkeypatch.setattr(MoETransformer, "_native_fronts", lambda self, kv: [])
    return checked


def decode(path, ids, batch: int = 2, chunk: int = 36, kv_cache_dtype: str = "auto") -> None:
    r = ModelRunner.from_gguf(path, RunnerOptions(dtype=torch.bfloat16, device=torch.device("cpu"),
                                                  kv_cache_tokens=512, kv_block_tokens=4,
                                                  kv_cache_dtype=kv_cache_dtype))
    seqs = [Sequence(i, ids[i:]) for i in range(batch)]  # different lengths, interleaved blocks
    first = min(chunk, len(ids) - batch - 4)
    r.step(seqs, [first] * batch)  # a prompt chunk: tiles (past gpt-oss's 32-token window on the fixture)
    r.step(seqs, [3, 2][:batch])  # short chunks: per-row units
    for _ in range(len(ids) - batch - first - 3):
        r.step(seqs, [1] * batch)


def test_demo_model(demo_gguf, monkeypatch):
    checked = checked_decode(monkeypatch)
    decode(demo_gguf, [(i * 37 + 11) % 200 for i in range(30)])
    assert checked


@pytest.mark.parametrize("model", FIXTURES)
def test_llama_cpp_fixtures(fixtures_dir, model, monkeypatch):
    ids = json.loads((fixtures_dir / "prompts.json").read_text())["prompts"][1]["ids"]
    assert len(ids) > 40  # past gpt-oss's 32-token window
    checked = checked_decode(monkeypatch)
    decode(fixtures_dir / model, ids)
    assert checked


@pytest.mark.parametrize("model,kv_cache_dtype", [("gptoss/gptoss-q8_0.gguf", "q8_0"),
                                                  ("mixtral/mixtral-q8_0.gguf", "fp8_e5m2"),
                                                  ("deepseek3/deepseek3-q4_k_m.gguf", "fp8_e4m3")])  # MLA's latent
def test_eight_bit_caches(fixtures_dir, model, kv_cache_dtype, monkeypatch):
    """Prompt tiles and decode rows read the 8-bit cache in place: attention over exactly what it holds."""
    ids = json.loads((fixtures_dir / "prompts.json").read_text())["prompts"][1]["ids"]
    checked = checked_decode(monkeypatch)
    decode(fixtures_dir / model, ids, kv_cache_dtype=kv_cache_dtype)
    assert checked
