"""ExpertShard's two paths, as kernels.expert_kernels.ExpertCompute chooses: float32 on the exact
reference, bfloat16/float16 on the fast path (native kernels, or the pure-torch fallback with its
int4 repack cached on disk)."""
from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from splitmoe.demo_model import DemoShape, write_demo_model
from splitmoe.kernels import expert_kernels as ek
from splitmoe.kernels import repack_cache
from splitmoe.kernels.moe import moe_forward
from splitmoe.kernels.repack_cache import RepackCache
from splitmoe.modelfile.expert_tensors import ExpertShard, load_layer_experts
from splitmoe.modelfile.gguf_file import GGUFFile
from tests.support.gguf_edit import rewrite_gguf

NATIVE = pytest.mark.skipif(not ek.native_available(), reason=f"native kernels: {ek.native_unavailable_reason()}")


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory):
    """The demo model with its experts in Q4_0 (what the int4 repack takes)."""
    d = tmp_path_factory.mktemp("q4")
    write_demo_model(d / "f32.gguf", DemoShape(quant="f32"))

    def to_q4(name, data, qtype):
        if "_exps." in name:
            return quantize(data.astype(np.float32), T.Q4_0), T.Q4_0
        return data, qtype
    rewrite_gguf(d / "f32.gguf", d / "demo-q4.gguf", edit_tensor=to_q4)
    return d / "demo-q4.gguf"


def inputs(seed: int, num_tokens: int = 6, hidden: int = 64, num_experts: int = 8, top_k: int = 2):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    ids[0, 1] = -1
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=gen), -1)
    return x, ids, weights


def rel_l2(got, want) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.fixture
def no_native(monkeypatch):
    monkeypatch.setattr(ek, "native_available", lambda: False)
    monkeypatch.setattr(ek, "native_unavailable_reason", lambda: "disabled by the test")


@pytest.fixture
def cache_home(tmp_path):
    return tmp_path / "int4pack"


def test_float32_keeps_the_exact_reference(demo_gguf):
    g = GGUFFile(demo_gguf)
    shard = ExpertShard(g, experts=range(6))
    x, ids, w = inputs(1)
    got = shard.forward(1, x, ids, w)
    assert torch.equal(got, moe_forward(x, ids, w, load_layer_experts(g, 1, range(6))))
    assert shard._fast is None  # nothing prepared for float32


@pytest.mark.parametrize("model", ["demo_gguf", "q4_gguf"])
@pytest.mark.parametrize("mode", [pytest.param("native", marks=NATIVE), "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_takes_the_fast_path(model, mode, dtype, request):
    if mode == "torch":
        request.getfixturevalue("no_native")
    g = GGUFFile(request.getfixturevalue(model))
    shard = ExpertShard(g, experts=range(6))
    for num_tokens in (1, 40):
        x, ids, w = inputs(num_tokens, num_tokens)
        x = x.to(dtype)
        got = shard.forward(0, x, ids, w)
        assert got.dtype == dtype and shard._fast is not None
        want = shard.forward(0, x.float(), ids, w)  # the reference on the same rounded input
        assert rel_l2(got, want) <= 3e-2


def test_fast_path_is_built_once(demo_gguf, monkeypatch):
    calls = []
    real = ek.build_fast_layers

    def build(*a, **kw):
        calls.append(1)
        return real(*a, **kw)
    monkeypatch.setattr(ek, "build_fast_layers", build)
    shard = ExpertShard(GGUFFile(demo_gguf))
    x, ids, w = inputs(2)
    threads = [threading.Thread(target=shard.forward, args=(layer, x.bfloat16(), ids, w))
               for layer in (0, 1) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and sorted(shard.prepare_fast()) == [0, 1]


def test_without_native_q4_experts_are_repacked_once_then_read_from_the_cache(q4_gguf, no_native, cache_home,
                                                                               monkeypatch, caplog):
    repacked = []
    real = repack_cache.repack_expert
    monkeypatch.setattr(repack_cache, "repack_expert", lambda ffn: repacked.append(1) or real(ffn))
    g = GGUFFile(q4_gguf)
    with caplog.at_level(logging.INFO):
        first = ExpertShard(g, layers=[0, 1], experts=range(4), repack_cache=RepackCache(cache_home)).prepare_fast()
    assert len(repacked) == 8 and all(len(layer.int4) == 4 for layer in first.values())
    assert len(list((cache_home / "demo-q4.gguf").iterdir())) == 2
    assert "pure torch, native kernels unavailable (disabled by the test): 8 Q4 experts int4-repacked" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        ExpertShard(GGUFFile(q4_gguf), layers=[0, 1], experts=range(4),
                    repack_cache=RepackCache(cache_home)).prepare_fast()
    assert len(repacked) == 8 and "2 from the cache, 0 repacked" in caplog.text
    # another shard: its own file
    ExpertShard(g, layers=[0], experts=range(3), repack_cache=RepackCache(cache_home)).prepare_fast()
    assert len(repacked) == 11 and len(list((cache_home / "demo-q4.gguf").iterdir())) == 3


@NATIVE
def test_with_native_nothing_is_repacked(q4_gguf, cache_home, caplog):
    with caplog.at_level(logging.INFO):
        fast = ExpertShard(GGUFFile(q4_gguf), repack_cache=RepackCache(cache_home)).prepare_fast()
    assert all(not layer.int4 and layer.native_experts == 8 for layer in fast.values())
    assert "native kernels" in caplog.text and "int4-repacked" not in caplog.text and not cache_home.exists()
