"""Decode layers fused with their in-process experts (model/fused_layers.py, one native call each)
against the per-op path they replace, on real models: the same logits to float32 rounding (the
native router's softmax differs from torch's in the last bit), the same tokens counted into the
backend's heat; and the layers that must keep the per-op FFN keep it."""
from __future__ import annotations

import json

import pytest
import torch

import splitmoe.attention_service.model.transformer as transformer_module
from splitmoe.attention_service.model.fused_layers import fused_layers
from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
from splitmoe.attention_service.model.sequence import Sequence
from splitmoe.kernels import native
from splitmoe.kernels.decode_moe_layer import LocalMoELayer

pytestmark = pytest.mark.skipif(not native.AVAILABLE, reason=f"native kernels: {native.UNAVAILABLE_REASON}")

FUSED = ["qwen3moe/qwen3moe-q8_0.gguf", "olmoe/olmoe-q4_k_m.gguf", "mixtral/mixtral-q8_0.gguf",
         "gptoss/gptoss-q8_0.gguf"]  # gpt-oss: softmax over the chosen k, expert biases, its own activation
PER_OP = ["qwen2moe/qwen2moe-q8_0.gguf",  # a shared expert
          "llama4/llama4-q8_0.gguf",  # input-weighted experts (and a shared one)
          "glm4moe/glm4moe-q8_0.gguf"]  # a shared expert (and a leading dense layer)


def runner(path, dtype=torch.bfloat16) -> ModelRunner:
    return ModelRunner.from_gguf(path, RunnerOptions(dtype=dtype, device=torch.device("cpu"), kv_cache_tokens=512,
                                                     kv_block_tokens=4))


def decode(path, ids: list[int], fused: bool, monkeypatch) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(logits of every decode step [steps, 2, vocab], the heat's token table, fused calls made):
    two sequences teacher-forced one token a step, then one sequence alone."""
    calls = []
    with monkeypatch.context() as m:
        if not fused:
            m.setattr(transformer_module, "fused_layers", lambda cfg, spec, layers, *rest: [None] * len(layers))
        real = LocalMoELayer.__call__
        m.setattr(LocalMoELayer, "__call__", lambda self, *a: calls.append(1) or real(self, *a))
        r = runner(path)
        seqs = [Sequence(0, ids[:20]), Sequence(1, ids[3:21])]
        r.step(seqs)
        out = []
        for t in range(21, len(ids)):
            for s, token in zip(seqs, (ids[t], ids[t - 1])):
                s.token_ids.append(token)
            out.append(r.step(seqs, [1, 1]))
        alone = seqs[:1]
        for token in ids[:8]:
            alone[0].token_ids.append(token)
            out.append(torch.cat([r.step(alone, [1])] * 2))
    return torch.stack(out), r.model.experts.heat.snapshot().tokens, len(calls)


@pytest.mark.parametrize("model", FUSED)
def test_fused_as_per_op(fixtures_dir, model, monkeypatch):
    ids = json.loads((fixtures_dir / "prompts.json").read_text())["prompts"][1]["ids"]
    got, got_heat, calls = decode(fixtures_dir / model, ids, True, monkeypatch)
    want, want_heat, none = decode(fixtures_dir / model, ids, False, monkeypatch)
    assert calls > 0 and none == 0
    rel = (got - want).norm(dim=-1) / want.norm(dim=-1)
    # The weights differ in the last bit, which can move one int8 rounding step of an expert's input
    # or the residual's bfloat16 rounding: far under the int8 activations' own ~1e-2.
    assert rel.max() < 2e-3, rel.max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert torch.equal(got_heat, want_heat) and got_heat.sum() > 0


def test_demo_model(demo_gguf, monkeypatch):
    ids = [(i * 37 + 11) % 200 for i in range(40)]
    got, got_heat, calls = decode(demo_gguf, ids, True, monkeypatch)
    want, want_heat, _ = decode(demo_gguf, ids, False, monkeypatch)
    assert calls > 0
    assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max() < 2e-3
    assert torch.equal(got_heat, want_heat)


@pytest.mark.parametrize("model", PER_OP)
def test_declined(fixtures_dir, model):
    r = runner(fixtures_dir / model)
    seq = Sequence(0, [1, 2, 3, 4])
    r.step([seq])
    seq.token_ids.append(5)
    r.step([seq], [1])
    m = r.model
    fronts = m._native_fronts(r.kv) or [None] * len(m.weights.layers)  # Llama 4 has none: declined before
    assert fused_layers(m.cfg, m.spec, m.weights.layers, fronts, m.experts, m.dtype) == [None] * len(fronts)
    assert not any(m._fused)


def test_declined_in_float32(fixtures_dir):
    """The fused call repeats bfloat16's rounding; a float32 model's experts take the exact route."""
    r = runner(fixtures_dir / "qwen3moe/qwen3moe-q8_0.gguf", torch.float32)
    seq = Sequence(0, [1, 2, 3, 4])
    r.step([seq])
    seq.token_ids.append(5)
    r.step([seq], [1])
    assert all(f is None for f in r.model._fused)
