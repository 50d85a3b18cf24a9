"""Token-by-token decoding through the paged KV cache equals one prefill; batching changes nothing."""
import json

import numpy as np
import pytest
import torch

from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
from splitmoe.attention_service.model.sequence import Sequence

ARCHS = ["qwen3moe", "qwen2moe", "mixtral", "olmoe", "dbrx", "deepseek"]


@pytest.fixture(scope="module")
def prompt_ids(fixtures_dir):
    return [p["ids"] for p in json.loads((fixtures_dir / "prompts.json").read_text())["prompts"]]


def runner(fixtures_dir, arch, kv_block_tokens=4):
    # Small KV blocks so a prompt spans many, non-contiguous ones.
    options = RunnerOptions(kv_cache_tokens=512, kv_block_tokens=kv_block_tokens, device=torch.device("cpu"))
    return ModelRunner.from_gguf(fixtures_dir / arch / f"{arch}-q8_0.gguf", options)


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_token_by_token_equals_prefill(fixtures_dir, prompt_ids, arch):
    r = runner(fixtures_dir, arch)
    ids = prompt_ids[1]
    prefill = r.step([Sequence(0, ids)], all_logits=True)
    seq = Sequence(1, ids)
    decoded = torch.cat([r.step([seq], [1]) for _ in ids])
    assert torch.abs(decoded - prefill).max().item() <= 1e-4


def test_mixed_batch_equals_separate_runs(fixtures_dir, prompt_ids):
    """A prefill chunk, a decode step and a fresh prompt in one step give each its own logits."""
    r = runner(fixtures_dir, "qwen2moe")
    alone = [r.step([Sequence(10 + i, ids)], all_logits=True) for i, ids in enumerate(prompt_ids)]

    a, b = Sequence(0, prompt_ids[0]), Sequence(1, prompt_ids[1])
    first = r.step([a, b], [10, 20], all_logits=True)  # two chunked prefills
    second = r.step([a, b], [1, 33], all_logits=True)  # a decode-sized step beside the rest of b
    got_a = torch.cat([first[:10], second[:1]])
    got_b = torch.cat([first[10:], second[1:]])
    assert torch.abs(got_a - alone[0][:11]).max().item() <= 1e-4
    assert torch.abs(got_b - alone[1]).max().item() <= 1e-4


def test_released_blocks_are_reused(fixtures_dir, prompt_ids):
    r = runner(fixtures_dir, "qwen3moe")
    free = r.blocks.num_free_blocks
    seq = Sequence(0, prompt_ids[1])
    first = r.step([seq])
    r.release(seq)
    assert r.blocks.num_free_blocks == free
    again = r.step([Sequence(1, prompt_ids[1])])
    np.testing.assert_allclose(first.numpy(), again.numpy(), atol=1e-5)
