"""Fewer (or more) routed experts per token at serve time, per server and per request."""
import pytest
import torch

from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
from splitmoe.attention_service.model.sequence import Sequence

IDS = [5, 40, 100, 7, 200, 33, 81, 12]


def runner(model, **options):
    return ModelRunner.from_gguf(model, RunnerOptions(device=torch.device("cpu"), kv_cache_tokens=256, **options))


def logits(r, ids=IDS, seq_id=0, k=0):
    return r.step([Sequence(seq_id, list(ids), num_experts_per_token=k)], all_logits=True)


@pytest.fixture(scope="module")
def default(demo_gguf):
    return runner(demo_gguf)


def test_the_default_is_the_models_own(demo_gguf, default):
    own = default.cfg.num_experts_used
    assert own == 2
    same = logits(runner(demo_gguf, experts_per_token=own))
    assert torch.equal(same, logits(default, seq_id=1))
    assert torch.equal(logits(default, seq_id=2, k=own), logits(default, seq_id=3))


def test_one_expert_per_token_changes_the_logits_as_a_top_1_model_would(demo_gguf, default):
    top1 = logits(runner(demo_gguf, experts_per_token=1))
    assert (top1 - logits(default, seq_id=4)).abs().max() > 1e-2
    # renormalised top-1 of a softmax router: the one expert with weight 1
    assert torch.allclose(logits(default, seq_id=5, k=1), top1, atol=1e-5)


def test_a_request_override_leaves_its_batch_neighbours_alone(default):
    a, b = Sequence(10, list(IDS)), Sequence(11, list(IDS[::-1]), num_experts_per_token=1)
    together = default.step([a, b], all_logits=True)
    alone_a = logits(default, seq_id=12)
    alone_b = logits(default, IDS[::-1], seq_id=13, k=1)
    assert torch.allclose(together[: len(IDS)], alone_a, atol=1e-5)
    assert torch.allclose(together[len(IDS):], alone_b, atol=1e-5)


def test_out_of_range_is_refused(demo_gguf, default):
    with pytest.raises(ValueError, match="experts per token"):
        runner(demo_gguf, experts_per_token=9)
    with pytest.raises(ValueError, match="experts per token"):
        logits(default, seq_id=20, k=99)
