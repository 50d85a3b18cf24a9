"""HostedShard: requests in bfloat16 take the experts' fast path, prepared when the shard is built."""
from __future__ import annotations

import pytest
import torch

from splitmoe.expert_service.shard import HostedShard
from splitmoe.modelfile.gguf_file import GGUFFile


def inputs(seed: int, num_tokens: int = 5):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, 64, generator=gen)
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(num_tokens)])
    ids[0, 0] = -1
    return x, ids, torch.softmax(torch.randn(num_tokens, 2, generator=gen), -1)


def test_bfloat16_requests_match_float32(demo_gguf):
    hosted = HostedShard(GGUFFile(demo_gguf), experts=range(5))
    x, ids, w = inputs(1)
    want, _ = hosted.forward(1, x.bfloat16().float(), ids, w)
    got, compute_s = hosted.forward(1, x.bfloat16(), ids.int(), w.bfloat16())
    assert got.dtype == torch.bfloat16 and compute_s > 0
    assert float((got.double() - want.double()).norm() / want.double().norm()) <= 3e-2
    assert sum(hosted.token_counts().values()) == 2 * int(((ids >= 0) & (ids < 5)).sum())


def test_fast_path_is_prepared_with_the_shard(demo_gguf):
    hosted = HostedShard(GGUFFile(demo_gguf), layers=[0], experts=range(4))
    old = hosted._shard
    assert old._fast is not None and sorted(old._fast) == [0]
    hosted.load([1], range(2, 6))  # LoadShard: a new shard, prepared before it is swapped in
    assert hosted._shard is not old and sorted(hosted._shard._fast) == [1]
    x, ids, w = inputs(2)
    out, _ = hosted.forward(1, x.bfloat16(), ids, w)
    assert out.dtype == torch.bfloat16


def test_lazy_and_empty_shards_prepare_nothing(demo_gguf):
    assert HostedShard(GGUFFile(demo_gguf), layers=(), experts=())._shard._fast is None
    lazy = HostedShard(GGUFFile(demo_gguf), prepare_fast=False)
    assert lazy._shard._fast is None
    x, ids, w = inputs(3)
    lazy.forward(0, x.bfloat16(), ids, w)
    assert lazy._shard._fast is not None
    with pytest.raises(ValueError, match="not hosted"):
        lazy.forward(5, x.bfloat16(), ids, w)
